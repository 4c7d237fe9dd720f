"""SmolLM2-135M-Instruct (a real 30-layer decoder) against transformers, in float32, on real
English text from gensim's test data (Lee news documents, Pang & Lee polarity sentences).

* ``token_embed``: every token's hidden state equals ``AutoModel`` ``last_hidden_state``.
* ``embed`` (the default task of a ``LlamaForCausalLM`` folder, LAST pooling): the last real
  token's hidden state, normalized, in a batch of different lengths and in a batch of two texts
  of identical token length (which must stay causal: each equals that text run alone).
* A reward model (``LlamaForSequenceClassification``, one label) whose ``score`` head is a
  ridge fit of the polarity label on LAST-token features: ``classify`` equals the sigmoid of
  ``AutoModelForSequenceClassification`` logits, with the same held-out predictions.
* A process-reward model (``LlamaForTokenClassification``, labels ``-``/``+``, its ``score``
  head a ridge fit of each step's polarity at the step-tag token ``"\\n"``): STEP pooling returns
  the rows of ``softmax(logits)`` at the tag positions, with ``returned_token_ids`` columns.

pad == eos == ``<|im_end|>`` (id 2) and no BOS/EOS is added: references find the last real
token from the attention mask, never from the pad id. Every text stays at or under 64 tokens.
The measured figures are printed (``pytest -s``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import poolrunner
from tests.helpers import MIN_COSINE, cosine_rows, normalized
from tests.models.smollm2 import SMOLLM2_HIDDEN_SIZE, SMOLLM2_PAD_ID, smollm2_folder

pytestmark = pytest.mark.slow

MAX_TOKENS = 64  # every text, in poolrunner and in every reference alike
TRAIN_PER_CLASS = 30  # polarity sentences per label the reward head is fitted on
TEST_PER_CLASS = 20  # held-out sentences per label
RIDGE_LAMBDAS = (1.0, 10.0, 100.0, 1000.0)  # chosen by 5-fold CV on the training split only
REWARD_TARGET = 3.0  # ridge target +-3: sigmoid probabilities well away from 0.5
PRM_LABELS = {0: "-", 1: "+"}
STEP_TAG_TEXT = "\n"  # one token in SmolLM2's byte-level BPE (checked in the fixture)
STEP_MAX_TOKENS = 16  # 3 steps of "Step k: <sentence>\n" stay within MAX_TOKENS
PROB_RTOL = 2e-3  # required for classify probabilities
PRM_ATOL_REQUIRED = 3e-2
PRM_ATOL = 1e-4  # what actually holds in fp32 (asserted)


def _report(name: str, **figures: float | str) -> None:
    shown = ", ".join(
        f"{k}={v:.10f} (1-cos {1 - v:.1e})" if "cosine" in k
        else f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in figures.items()
    )
    print(f"\n[smollm2] {name}: {shown}")


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


# --------------------------------------------------------------------------- data


def _test_data(name: str) -> str:
    spec = importlib.util.find_spec("gensim")  # the data only: gensim itself is never imported
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(spec.submodule_search_locations[0], "test", "test_data", name)


@pytest.fixture(scope="module")
def polarity() -> tuple[list[str], np.ndarray]:
    """``pang_lee_polarity.cor``: 200 lines ``__label__neg|pos <sentence>``, 100 of each, in
    label blocks. Returns the sentences and labels (1 = pos)."""
    with open(_test_data("pang_lee_polarity.cor"), encoding="cp1252") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    assert len(lines) == 200
    labels, sentences = zip(*(line.split(" ", 1) for line in lines), strict=True)
    assert set(labels) == {"__label__neg", "__label__pos"}
    y = np.array([label == "__label__pos" for label in labels], dtype=np.int64)
    assert y.sum() == 100
    return list(sentences), y


# --------------------------------------------------------------------------- transformers reference


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok.pad_token_id == tok.eos_token_id == SMOLLM2_PAD_ID
    return tok


@pytest.fixture(scope="module")
def base_model(folder):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaModel"
    return model


def token_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """The ids poolrunner sees too (``add_special_tokens`` as the model's tokenizer does: none)."""
    ids = [list(row) for row in tokenizer(list(texts), truncation=True, max_length=MAX_TOKENS)["input_ids"]]
    assert all(SMOLLM2_PAD_ID not in row for row in ids), "a text contains the pad (== eos) id"
    return ids


def padded_forward(model, ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(outputs [n, T, ...] float64, lengths [n])``: one right-padded batch (pad id 2) with an
    attention mask; ``last_hidden_state`` or ``logits``, whichever the model returns."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), SMOLLM2_PAD_ID, dtype=torch.int64)
    mask = torch.zeros(len(ids), width, dtype=torch.int64)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=mask)
    states = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return states.double().numpy(), mask.sum(1).numpy()


def last_hidden(model, ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Hidden state of each input's last real token; the position comes from the mask."""
    states, lengths = padded_forward(model, ids)
    return states[np.arange(len(ids)), lengths - 1]


def alone_forward(model, ids: Sequence[int]) -> np.ndarray:
    """One input by itself, no padding, no mask: ``[len, ...]``."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)]))
    states = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return states[0].double().numpy()


# --------------------------------------------------------------------------- poolrunner runtimes


@pytest.fixture(scope="module")
def token_embed_runtime(folder):
    import poolrunner

    return poolrunner.Runtime(folder, task="token_embed", dtype="float32")


@pytest.fixture(scope="module")
def embed_runtime(folder):
    import poolrunner

    return poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- 1. token_embed


def test_token_embed_equals_last_hidden_state(token_embed_runtime, tokenizer, base_model, lee_sentences):
    texts = [lee_sentences[1], lee_sentences[2], lee_sentences[9], " ".join(lee_sentences[4].split()[:4])]
    ids = token_ids(tokenizer, texts)
    lengths = [len(row) for row in ids]
    assert len(set(lengths)) == len(texts) and max(lengths) <= MAX_TOKENS, lengths

    got = token_embed_runtime.encode(texts)
    expected, ref_lengths = padded_forward(base_model, ids)
    assert list(ref_lengths) == lengths
    cosines, abs_dev = [], 0.0
    for i, rows in enumerate(got):
        assert rows.dtype == np.float32 and rows.shape == (lengths[i], SMOLLM2_HIDDEN_SIZE)
        want = expected[i, : lengths[i]]
        cosines.append(cosine_rows(rows, want))
        abs_dev = max(abs_dev, float(np.abs(rows - want).max()))
    per_token = np.concatenate(cosines)
    _report("token_embed vs AutoModel last_hidden_state", tokens=str(per_token.size), lengths=str(lengths),
            min_cosine=float(per_token.min()), max_abs_dev=abs_dev)
    assert per_token.min() >= MIN_COSINE


# --------------------------------------------------------------------------- 2. embed (LAST)


def test_default_task_is_embed_with_last_pooling(embed_runtime):
    assert embed_runtime.task == "embed"
    assert embed_runtime.model_config.pooling_type == "LAST"


def test_embed_last_token_different_lengths(embed_runtime, tokenizer, base_model, lee_sentences):
    texts = [lee_sentences[0], lee_sentences[5], lee_sentences[9], " ".join(lee_sentences[3].split()[:3])]
    ids = token_ids(tokenizer, texts)
    lengths = [len(row) for row in ids]
    assert len(set(lengths)) == len(texts) and max(lengths) <= MAX_TOKENS, lengths

    got = embed_runtime.embed(texts)
    assert got.shape == (len(texts), SMOLLM2_HIDDEN_SIZE) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    expected = normalized(last_hidden(base_model, ids))
    cosines = cosine_rows(got, expected)
    # Pooling the wrong row (the one before the last real token) would be far off.
    states, _ = padded_forward(base_model, ids)
    wrong = cosine_rows(got, normalized(states[np.arange(len(ids)), np.array(lengths) - 2]))
    _report("embed LAST, different lengths", lengths=str(lengths), min_cosine=float(cosines.min()),
            max_abs_dev=float(np.abs(got - expected).max()), max_cosine_to_previous_token=float(wrong.max()))
    assert cosines.min() >= MIN_COSINE
    assert wrong.max() < 0.99


def _equal_length_texts(tokenizer, first: str, second: str) -> tuple[str, str]:
    """Word prefixes of two different sentences with the same token count (longest found, at
    most ``MAX_TOKENS``)."""
    def prefixes(sentence: str) -> dict[int, str]:
        words = sentence.split()
        found: dict[int, str] = {}
        for k in range(3, len(words) + 1):
            text = " ".join(words[:k])
            found.setdefault(len(tokenizer(text)["input_ids"]), text)
        return found

    a, b = prefixes(first), prefixes(second)
    common = [n for n in a if n in b and n <= MAX_TOKENS]
    assert common, "no common token length"
    n = max(common)
    return a[n], b[n]


def test_embed_last_token_equal_lengths_stays_causal(embed_runtime, tokenizer, base_model, lee_sentences):
    texts = list(_equal_length_texts(tokenizer, lee_sentences[3], lee_sentences[6]))
    ids = token_ids(tokenizer, texts)
    assert len(ids[0]) == len(ids[1]) >= 20 and ids[0] != ids[1], [len(row) for row in ids]

    got = embed_runtime.embed(texts)
    alone = np.stack([normalized(alone_forward(base_model, row)[-1]) for row in ids])
    cosines = cosine_rows(got, alone)
    # The two texts differ: a batch that mixed them (non-causal or cross-request attention)
    # would make both vectors alike; they are not.
    apart = float(cosine_rows(alone[0], alone[1])[0])
    _report("embed LAST, equal lengths vs each text alone", tokens=str(len(ids[0])),
            min_cosine=float(cosines.min()), max_abs_dev=float(np.abs(got - alone).max()),
            cosine_between_texts=apart)
    assert cosines.min() >= MIN_COSINE
    assert apart < 0.99
    # The same single text embedded alone through poolrunner is the same vector as in the batch.
    single = embed_runtime.embed(texts[1])
    assert cosine_rows(single, got[1])[0] >= MIN_COSINE


# --------------------------------------------------------------------------- 3a. reward model


def _ridge(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """Ridge regression without intercept (``LlamaForSequenceClassification.score`` has no bias;
    center ``x`` and ``y`` first for a fit with one)."""
    return np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y)


def _cv_lambda(x: np.ndarray, y: np.ndarray, folds: int = 5) -> float:
    """The ridge penalty with the best k-fold accuracy, on the training split only."""
    order = np.random.default_rng(0).permutation(len(y))
    accuracy = {}
    for lam in RIDGE_LAMBDAS:
        hits = 0
        for fold in np.array_split(order, folds):
            train = np.setdiff1d(order, fold)
            hits += int(((x[fold] @ _ridge(x[train], y[train], lam) > 0) == (y[fold] > 0)).sum())
        accuracy[lam] = hits / len(y)
    return max(RIDGE_LAMBDAS, key=lambda lam: (accuracy[lam], lam))


class RewardModel:
    def __init__(self, folder, test_sentences: list[str], test_labels: np.ndarray, lam: float, train_acc: float):
        self.folder = folder
        self.test_sentences = test_sentences
        self.test_labels = test_labels
        self.lam = lam
        self.train_acc = train_acc


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, folder, tokenizer, base_model, polarity) -> RewardModel:
    """``LlamaForSequenceClassification`` (``num_labels=1``) on the SmolLM2 backbone; ``score``
    is a ridge fit of the polarity label (+-3) on transformers' LAST-token features of the first
    30 neg + 30 pos sentences. Held out: the next 20 of each."""
    from transformers import LlamaForSequenceClassification

    sentences, labels = polarity
    neg, pos = np.flatnonzero(labels == 0), np.flatnonzero(labels == 1)
    train = np.concatenate([neg[:TRAIN_PER_CLASS], pos[:TRAIN_PER_CLASS]])
    test = np.concatenate([neg[TRAIN_PER_CLASS:TRAIN_PER_CLASS + TEST_PER_CLASS],
                           pos[TRAIN_PER_CLASS:TRAIN_PER_CLASS + TEST_PER_CLASS]])
    ids = token_ids(tokenizer, [sentences[i] for i in train])
    order = sorted(range(len(ids)), key=lambda k: len(ids[k]))  # similar lengths: little padding
    features = np.zeros((len(ids), SMOLLM2_HIDDEN_SIZE))
    for start in range(0, len(order), 20):
        rows = order[start : start + 20]
        features[rows] = last_hidden(base_model, [ids[k] for k in rows])
    target = REWARD_TARGET * (2.0 * labels[train] - 1.0)
    lam = _cv_lambda(features, target)
    weight = _ridge(features, target, lam)
    train_acc = float(((features @ weight > 0) == (target > 0)).mean())

    model = LlamaForSequenceClassification.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32, num_labels=1, pad_token_id=SMOLLM2_PAD_ID,
    ).eval()
    with torch.no_grad():
        model.score.weight.copy_(torch.from_numpy(weight).float().unsqueeze(0))
    model.config.architectures = ["LlamaForSequenceClassification"]
    model.config.pad_token_id = SMOLLM2_PAD_ID
    out = tmp_path_factory.mktemp("smollm2_reward")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return RewardModel(out, [sentences[i] for i in test], labels[test], lam, train_acc)


def test_reward_model_classify_matches_transformers(reward_model, tokenizer):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    import poolrunner

    config = AutoConfig.from_pretrained(reward_model.folder, local_files_only=True)
    assert config.architectures == ["LlamaForSequenceClassification"]
    assert config.num_labels == 1 and config.pad_token_id == SMOLLM2_PAD_ID

    texts = reward_model.test_sentences
    runtime = poolrunner.Runtime(reward_model.folder, dtype="float32")
    assert runtime.task == "classify"
    results = runtime.classify(texts, truncate_prompt_tokens=MAX_TOKENS)
    got = np.array([result.probs for result in results], dtype=np.float64)
    assert got.shape == (len(texts), 1)
    del runtime

    reference = AutoModelForSequenceClassification.from_pretrained(
        reward_model.folder, local_files_only=True, dtype=torch.float32).eval()
    # Right padding with pad_token_id set: transformers reads the rightmost non-pad token, which
    # is the last real one since no text contains id 2 (checked in token_ids).
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
    assert tokenizer.padding_side == "right"
    with torch.inference_mode():
        logits = reference(**encoded).logits.double().numpy()
    expected = sigmoid(logits)

    abs_dev = float(np.abs(got - expected).max())
    rel_dev = float((np.abs(got - expected) / np.abs(expected)).max())
    predicted, reference_predicted = got[:, 0] > 0.5, expected[:, 0] > 0.5
    accuracy = float((predicted == reward_model.test_labels.astype(bool)).mean())
    reference_accuracy = float((reference_predicted == reward_model.test_labels.astype(bool)).mean())
    _report("reward classify vs sigmoid(AutoModelForSequenceClassification)", texts=str(len(texts)),
            ridge_lambda=reward_model.lam, train_acc=reward_model.train_acc, max_abs_dev=abs_dev,
            max_rel_dev=rel_dev, prob_range=f"{expected.min():.3f}..{expected.max():.3f}",
            heldout_acc=accuracy, reference_heldout_acc=reference_accuracy)
    np.testing.assert_allclose(got, expected, rtol=PROB_RTOL)
    assert (predicted == reference_predicted).all()
    assert accuracy == reference_accuracy
    assert accuracy >= 0.6  # a real (if small) sentiment signal, not chance
    assert expected.min() < 0.3 and expected.max() > 0.7  # probabilities spread, not all ~0.5


# --------------------------------------------------------------------------- 3b. process reward


@pytest.fixture(scope="module")
def step_tag(tokenizer) -> int:
    tag = tokenizer.encode(STEP_TAG_TEXT, add_special_tokens=False)
    assert len(tag) == 1, f"{STEP_TAG_TEXT!r} is not a single token: {tag}"
    return tag[0]


def _steps(sentences: Sequence[str]) -> str:
    return "".join(f"Step {k + 1}: {sentence}{STEP_TAG_TEXT}" for k, sentence in enumerate(sentences))


class StepData:
    """Process-reward data from short polarity sentences (at most ``STEP_MAX_TOKENS`` tokens, so
    a text of up to 3 steps stays within ``MAX_TOKENS``): each step is ``Step k: <sentence>\\n``
    and its label the sentence's polarity. ``train_texts`` (10 texts x 3 steps) fit the head;
    ``texts`` (3, 2 and 3 steps, 8 other sentences) are the ones compared."""

    def __init__(self, tokenizer, polarity: tuple[list[str], np.ndarray]) -> None:
        sentences, labels = polarity
        short = [i for i in range(len(sentences))
                 if len(tokenizer(sentences[i])["input_ids"]) <= STEP_MAX_TOKENS]
        neg = [i for i in short if labels[i] == 0]
        pos = [i for i in short if labels[i] == 1]
        assert len(neg) >= 20 and len(pos) >= 20, (len(neg), len(pos))
        rng = np.random.default_rng(7)
        train = rng.permutation(neg[:15] + pos[:15]).tolist()
        held = rng.permutation(neg[15:19] + pos[15:19]).tolist()
        self.train_texts = [_steps([sentences[i] for i in train[k : k + 3]]) for k in range(0, 30, 3)]
        self.train_labels = labels[train]
        groups = [held[:3], held[3:5], held[5:8]]
        self.texts = [_steps([sentences[i] for i in group]) for group in groups]
        self.labels = labels[held]


@pytest.fixture(scope="module")
def step_data(tokenizer, polarity) -> StepData:
    return StepData(tokenizer, polarity)


@pytest.fixture(scope="module")
def prm_texts(step_data) -> list[str]:
    return step_data.texts


@pytest.fixture(scope="module")
def prm_folder(tmp_path_factory, folder, tokenizer, base_model, step_data, step_tag):
    """``LlamaForTokenClassification`` (labels ``-``/``+``) on the SmolLM2 backbone whose
    ``score`` head is a ridge fit (with intercept) of the step's polarity (+-3) on transformers'
    hidden states at the step tags of the training texts: rows ``[-w/2, w/2]``, bias
    ``[-b/2, b/2]``, so ``softmax(logits)[+] == sigmoid(w . h + b)``."""
    from transformers import LlamaForTokenClassification

    ids = token_ids(tokenizer, step_data.train_texts)
    assert max(len(row) for row in ids) <= MAX_TOKENS
    assert [row.count(step_tag) for row in ids] == [3] * len(ids)
    states, _ = padded_forward(base_model, ids)
    features = np.concatenate([states[i, : len(row)][np.array(row) == step_tag] for i, row in enumerate(ids)])
    target = REWARD_TARGET * (2.0 * step_data.train_labels - 1.0)
    mean_x, mean_y = features.mean(0), target.mean()
    weight = _ridge(features - mean_x, target - mean_y, _cv_lambda(features - mean_x, target - mean_y))
    bias = float(mean_y - mean_x @ weight)

    model = LlamaForTokenClassification.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32, id2label=PRM_LABELS,
        label2id={v: k for k, v in PRM_LABELS.items()}, pad_token_id=SMOLLM2_PAD_ID,
    ).eval()
    with torch.no_grad():
        half = torch.from_numpy(weight).float() / 2
        model.score.weight.copy_(torch.stack([-half, half]))
        model.score.bias.copy_(torch.tensor([-bias / 2, bias / 2]))
    model.config.architectures = ["LlamaForTokenClassification"]
    out = tmp_path_factory.mktemp("smollm2_prm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prm_reference(prm_folder, tokenizer, prm_texts, step_tag):
    """``(ids, raw logits per text [len, 2])`` from ``AutoModelForTokenClassification``."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        prm_folder, local_files_only=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForTokenClassification"
    ids = token_ids(tokenizer, prm_texts)
    assert max(len(row) for row in ids) <= MAX_TOKENS
    assert [row.count(step_tag) for row in ids] == [3, 2, 3]  # one tag per step, no merges
    logits, lengths = padded_forward(model, ids)
    return ids, [logits[i, :n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def prm_runtime(prm_folder):
    import poolrunner

    runtime = poolrunner.Runtime(prm_folder, dtype="float32")
    assert runtime.task == "token_classify"
    return runtime


def _at_tags(ids: list[int], rows: np.ndarray, tag: int) -> np.ndarray:
    return rows[np.array(ids) == tag]


def _check_rows(name: str, got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [g.shape for g in got] == [e.shape for e in expected]
    dev = max(float(np.abs(g - e).max()) for g, e in zip(got, expected, strict=True))
    _report(name, rows=str(sum(len(e) for e in expected)), max_abs_dev=dev)
    assert dev <= PRM_ATOL_REQUIRED
    assert dev <= PRM_ATOL


def test_prm_step_rows_equal_softmax_at_tags(prm_runtime, prm_reference, prm_texts, step_tag, step_data):
    ids, logits = prm_reference
    # Without STEP pooling: every token, softmax over both labels.
    _check_rows("prm all tokens, softmax", prm_runtime.encode(prm_texts), [softmax(r) for r in logits])
    got = prm_runtime.encode(prm_texts, step_tag_id=step_tag)
    expected = [_at_tags(row_ids, softmax(rows), step_tag) for row_ids, rows in zip(ids, logits, strict=True)]
    assert [len(g) for g in got] == [3, 2, 3]
    _check_rows("prm step_tag rows, softmax", got, expected)
    spread = np.concatenate(expected)[:, 1]
    accuracy = float(((spread > 0.5) == step_data.labels.astype(bool)).mean())
    _report("prm P(+) at the step tags", values=" ".join(f"{p:.3f}" for p in spread),
            labels=" ".join(map(str, step_data.labels)), heldout_step_acc=accuracy)
    assert spread.min() < 0.4 and spread.max() > 0.6, spread  # the head is not flat


def test_prm_returned_token_ids(prm_runtime, prm_reference, prm_texts, step_tag):
    """Documented semantics (poolers.py): the activation runs over the selected columns alone.
    One column under softmax is always 1.0, so its values are compared as raw logits."""
    ids, logits = prm_reference
    at_tags = [_at_tags(row_ids, rows, step_tag) for row_ids, rows in zip(ids, logits, strict=True)]

    ones = prm_runtime.encode(prm_texts, step_tag_id=step_tag, returned_token_ids=[1])
    assert [g.shape for g in ones] == [(3, 1), (2, 1), (3, 1)]
    assert all(np.allclose(g, 1.0, atol=1e-6) for g in ones)

    raw = prm_runtime.encode(prm_texts, step_tag_id=step_tag, returned_token_ids=[1], use_activation=False)
    _check_rows("prm step_tag, returned_token_ids=[1], raw logits", raw, [r[:, [1]] for r in at_tags])

    both = prm_runtime.encode(prm_texts, step_tag_id=step_tag, returned_token_ids=[0, 1])
    _check_rows("prm step_tag, returned_token_ids=[0, 1], softmax", both, [softmax(r) for r in at_tags])

    swapped = prm_runtime.encode(prm_texts, step_tag_id=step_tag, returned_token_ids=[1, 0])
    _check_rows("prm step_tag, returned_token_ids=[1, 0], softmax", swapped,
                [softmax(r[:, [1, 0]]) for r in at_tags])


# ---- Chunked prefill on the real model (issue: 55, 56 and 57 tokens with a 10-token budget) ----
# token_embed and embed: tests/engine/test_chunked_prefill.py (they read the runner's caches).


def test_chunked_prefill_token_classify_equals_one_pass(prm_folder, smollm2_chunk_prompts):
    whole = poolrunner.Runtime(prm_folder, dtype="float32", load_entrypoints=False)
    chunked = poolrunner.Runtime(prm_folder, dtype="float32", load_entrypoints=False, max_num_batched_tokens=10)
    assert whole.task == chunked.task == "token_classify"
    for one, many in zip(whole.encode(smollm2_chunk_prompts), chunked.encode(smollm2_chunk_prompts), strict=True):
        np.testing.assert_allclose(many, one, atol=1e-5)
