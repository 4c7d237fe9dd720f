"""``poolrunner.integrations.mteb.PoolrunnerEncoder`` runs mteb tasks end to end, offline (mteb's
mock tasks), and scores what mteb's own sentence-transformers wrapper scores on the same folder."""

from __future__ import annotations

import mteb
import numpy as np
import pytest
from datasets import Dataset
from mteb.mocks import ALL_MOCK_TASK_TEST_GRID
from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper
from mteb.types import PromptType
from sentence_transformers import SentenceTransformer
from torch.utils.data import DataLoader

from poolrunner.integrations.mteb import PoolrunnerEncoder
from tests.helpers import MIN_COSINE, cosine_rows
from tests.test_st_metadata import MEAN, POOLING, SBERT_256, TRANSFORMER

TASKS = ("MockRetrievalTask", "MockSTSTask", "MockClassificationTask", "MockRerankingTask", "MockSummarizationTask")
TEXTS = ["Where do cats sleep?", "Cats sleep in warm places.", "The sun is a star."]

# Warnings from inside mteb, not this adapter's doing: its mock tasks have a handful of samples
# (sklearn warns about empty classes), and its sentence-transformers wrapper calls mteb's own
# deprecated ModelMeta.from_hub(fill_missing=...) and sentence-transformers' renamed
# get_sentence_embedding_dimension.
pytestmark = [
    pytest.mark.filterwarnings("ignore::sklearn.exceptions.UndefinedMetricWarning"),
    pytest.mark.filterwarnings("ignore:The fill_missing parameter is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The `get_sentence_embedding_dimension` method has been renamed:FutureWarning"),
]


def _scores(model) -> dict[str, float]:
    tasks = [task for task in ALL_MOCK_TASK_TEST_GRID if task.metadata.name in TASKS]
    results = mteb.evaluate(model, tasks, cache=None, overwrite_strategy="always", show_progress_bar=False)
    return {result.task_name: result.get_score() for result in results}


def test_mock_tasks_score_as_sentence_transformers(model_path, runtime):
    ours = _scores(PoolrunnerEncoder(runtime))
    reference = _scores(SentenceTransformerEncoderWrapper(SentenceTransformer(str(model_path), device="cpu")))
    assert set(ours) == set(TASKS)
    assert ours == pytest.approx(reference, abs=1e-6)


@pytest.mark.parametrize("prompt_type", [PromptType.query, PromptType.document, None])
def test_prompts_follow_mteb_rules(make_minilm_folder, prompt_type):
    folder = make_minilm_folder("mteb-prompts", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")],
                                pooling=MEAN, sbert_config=SBERT_256,
                                st_config={"prompts": {"query": "query: ", "document": "passage: ",
                                                       "Retrieval-query": "find: "}})
    task = next(task for task in ALL_MOCK_TASK_TEST_GRID if task.metadata.name == "MockRetrievalTask")
    inputs = DataLoader(Dataset.from_dict({"text": TEXTS}), batch_size=2)  # as mteb feeds encoders
    options = {"task_metadata": task.metadata, "hf_split": "test", "hf_subset": "default", "prompt_type": prompt_type}
    ours = PoolrunnerEncoder(str(folder), dtype="float32").encode(inputs, **options)
    reference = SentenceTransformerEncoderWrapper(SentenceTransformer(str(folder), device="cpu")).encode(
        inputs, **options)
    assert ours.shape == (3, 384) and ours.dtype == np.float32
    assert cosine_rows(ours, np.asarray(reference)).min() >= MIN_COSINE


def test_texts_past_the_model_maximum_are_cut_as_sentence_transformers_cuts(model_path, runtime):
    """mteb corpora hold texts longer than all-MiniLM-L6-v2's 256 tokens: sentence-transformers
    keeps the first 256, and so does the encoder by default; ``truncate_prompt_tokens=None``
    refuses them, naming the limit."""
    from poolrunner.core.errors import PromptTooLongError

    long_text = " ".join(["The committee met on Tuesday to discuss the river's flooding."] * 40)
    texts = [long_text, *TEXTS]
    task = next(task for task in ALL_MOCK_TASK_TEST_GRID if task.metadata.name == "MockSTSTask")
    inputs = DataLoader(Dataset.from_dict({"text": texts}), batch_size=2)
    options = {"task_metadata": task.metadata, "hf_split": "test", "hf_subset": "default"}
    ours = PoolrunnerEncoder(runtime).encode(inputs, **options)
    reference = SentenceTransformerEncoderWrapper(SentenceTransformer(str(model_path), device="cpu")).encode(
        inputs, **options)
    assert len(runtime.tokenize([long_text])[0]) > 256
    assert cosine_rows(ours, np.asarray(reference)).min() >= MIN_COSINE
    with pytest.raises(PromptTooLongError, match=r"input 0 has \d+ tokens, more than the maximum of 256"):
        PoolrunnerEncoder(runtime, truncate_prompt_tokens=None).encode(inputs, **options)
