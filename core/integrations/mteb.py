"""An MTEB encoder over a :class:`~poolrunner.core.runtime.Runtime`.

``mteb.evaluate(PoolrunnerEncoder(runtime), tasks)`` scores a model served by poolrunner as
mteb scores the same folder through sentence-transformers: the same prompt choice (mteb's own
``get_prompt_name`` over the model's prompts: task name and type, then ``query`` /
``document``), ``encode_query`` / ``encode_document`` by the prompt type, the model's
``similarity_fn_name``, and texts past the model maximum cut to it (``truncate_prompt_tokens=-1``),
as sentence-transformers cuts them at its ``max_seq_length``. Needs ``pip install mteb``; nothing
is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta
from mteb.types import PromptType

from poolrunner.core.runtime import Runtime

if TYPE_CHECKING:
    from mteb.abstasks.task_metadata import TaskMetadata
    from mteb.types import BatchedInput
    from torch.utils.data import DataLoader


class PoolrunnerEncoder(AbsEncoder):
    """mteb's ``EncoderProtocol`` for a loaded runtime (``embed`` task).

    :param runtime: The runtime to evaluate; or a model folder / hub id, loaded with
        ``runtime_options``.
    :param model_prompts: Prompts by mteb name (task name, task type, ``query``, ``document``);
        ``None``: the model's own (``config_sentence_transformers.json``).
    :param name: The model name mteb records in its results; ``None``: the folder's name.
    :param truncate_prompt_tokens: Each text's tokens kept (``-1``: the model maximum, as
        sentence-transformers keeps); ``None``: a longer text is refused
        (:class:`~poolrunner.core.errors.PromptTooLongError`) and the evaluation stops.
    """

    def __init__(self, runtime: Runtime | str | None = None, model_prompts: Mapping[str, str] | None = None, *,
                 name: str | None = None, truncate_prompt_tokens: int | None = -1, **runtime_options: Any) -> None:
        self.model = runtime if isinstance(runtime, Runtime) else Runtime(runtime, **runtime_options)
        self.truncate_prompt_tokens = truncate_prompt_tokens
        config = self.model.model_config
        self.model_prompts = dict(config.prompts if model_prompts is None else model_prompts) or None
        self.mteb_model_meta = ModelMeta.create_empty({
            "name": name or f"poolrunner/{config.name.rstrip('/').rsplit('/', 1)[-1]}",
            "embed_dim": config.embedding_size, "max_tokens": config.max_model_len,
            "similarity_fn_name": config.similarity_fn_name, "framework": ["PyTorch"],
        })

    def encode(self, inputs: DataLoader[BatchedInput], *, task_metadata: TaskMetadata, hf_split: str,
               hf_subset: str, prompt_type: PromptType | None = None, **kwargs: Any) -> np.ndarray:
        """``[num_texts, d]`` float32 embeddings of the texts of ``inputs``, in order."""
        texts = [text for batch in inputs for text in batch["text"]]
        prompt_name = self.get_prompt_name(task_metadata, prompt_type)
        options: dict[str, Any] = {"truncate_prompt_tokens": self.truncate_prompt_tokens}
        if prompt_name:
            options["prompt"] = self.model_prompts[prompt_name]
        if prompt_type == PromptType.query:
            return self.model.encode_query(texts, **options)
        if prompt_type == PromptType.document:
            return self.model.encode_document(texts, **options)
        return self.model.embed(texts, **options)

    # mteb's evaluators expect torch tensors back, as sentence-transformers returns (they call
    # float() on a [1, 1] result, which numpy refuses).
    def similarity(self, embeddings1: np.ndarray, embeddings2: np.ndarray) -> torch.Tensor:
        """``[n, m]`` float32 by the model's ``similarity_fn_name``."""
        return torch.from_numpy(self.model.similarity(np.asarray(embeddings1), np.asarray(embeddings2)))

    def similarity_pairwise(self, embeddings1: np.ndarray, embeddings2: np.ndarray) -> torch.Tensor:
        """``[n]`` float32 by the model's ``similarity_fn_name``."""
        return torch.from_numpy(self.model.similarity_pairwise(np.asarray(embeddings1), np.asarray(embeddings2)))
