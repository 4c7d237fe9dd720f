"""Score templates: a (query, document) pair formatted into one prompt before tokenization.

An LLM reranker scores the prompt it was trained on, not a bare pair: without it its scores are
close to random (vLLM warns as much). ``score_template`` (``--score-template``) is Jinja, rendered
as transformers renders chat templates (a sandbox, ``trim_blocks``, ``lstrip_blocks``), with:

* ``query`` and ``document``: the pair's texts;
* ``messages``: ``[{"role": "query", "content": query}, {"role": "document", "content": document}]``,
  the form vLLM's score templates read, so theirs work unchanged;
* the tokenizer's special tokens (``bos_token``, ``eos_token``...), as in a chat template.

The rendered text is tokenized as one text, special tokens added (vLLM tokenizes it the same way).
Two templates are built in, chosen by name or, when ``score_template`` is not set, by what the
folder says it is (:func:`builtin_for`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from attrs import Attribute, field, frozen

from poolrunner.core.errors import InvalidRequestError, ModelLoadError
from poolrunner.core.types import ModelConfig, PoolingTask

logger = logging.getLogger(__name__)

QWEN3_RERANKER = "qwen3_reranker"
BGE_RERANKER_V2_GEMMA = "bge_reranker_v2_gemma"

DEFAULT_QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

# The prompt of the Qwen3-Reranker model card (huggingface.co/Qwen/Qwen3-Reranker-0.6B, README:
# `prefix`, `format_instruction` and `suffix`, and its default instruction), which vLLM's
# examples/pooling/score/template/qwen3_reranker.jinja also writes. The suffix ends with two
# newlines: the last is written as an expression, because Jinja drops a template's final newline.
_QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {{ instruction | default('" + DEFAULT_QWEN3_INSTRUCTION + "', true) }}\n"
    "<Query>: {{ query }}\n<Document>: {{ document }}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n{{ '\\n' }}"
)

# FlagEmbedding's prompt for its LLM rerankers (FlagEmbedding/inference/reranker/decoder_only/base.py:
# "A: {query}", "\n", "B: {passage}", "\n", then the default prompt below), as vLLM's
# examples/pooling/score/template/bge-reranker-v2-gemma.jinja joins it into one text; the
# tokenizer adds Gemma's <bos>.
_BGE_RERANKER_V2_GEMMA_TEMPLATE = (
    "A: {{ query }}\nB: {{ document }}\nGiven a query A and a passage B, determine whether the passage "
    "contains an answer to the query by providing a prediction of either 'Yes' or 'No'."
)

BUILTIN_TEMPLATES: Mapping[str, str] = {
    QWEN3_RERANKER: _QWEN3_RERANKER_TEMPLATE,
    BGE_RERANKER_V2_GEMMA: _BGE_RERANKER_V2_GEMMA_TEMPLATE,
}
"""Built-in templates by name (the Jinja source)."""

# What a folder's path or `_name_or_path` says it is (hub ids keep the name in the cache path).
_FOLDER_NAMES = {
    QWEN3_RERANKER: re.compile(r"qwen3-reranker", re.IGNORECASE),
    BGE_RERANKER_V2_GEMMA: re.compile(r"bge-reranker-v2-gemma", re.IGNORECASE),
}
_PAIR_VARIABLES = ({"query", "document"}, {"messages"})


def check_setting(_instance: object, attribute: Attribute, value: Any) -> None:
    """attrs validator of ``score_template``: ``None``, a built-in name, or Jinja text."""
    if value is None or value in BUILTIN_TEMPLATES:
        return
    if not isinstance(value, str) or not ("{{" in value or "{%" in value):
        raise InvalidRequestError(
            f"{attribute.name} must be a built-in template name ({', '.join(BUILTIN_TEMPLATES)}) or Jinja text "
            f"that uses {{{{ query }}}} and {{{{ document }}}}, got {value!r:.200}"
        )


@frozen(eq=False)
class ScoreTemplate:
    """A compiled score template.

    :ivar name: The built-in name, or ``custom``.
    :ivar source: The Jinja text.
    """

    name: str
    source: str
    _template: Any = field(repr=False)
    _special_tokens: Mapping[str, str] = field(repr=False)

    def render(self, query: str, document: str) -> str:
        """The prompt of one pair.

        :raises InvalidRequestError: when the template fails on it (``raise_exception``, a bad filter).
        """
        import jinja2

        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            return self._template.render(**self._special_tokens, query=query, document=document, messages=messages)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the score template failed on a (query, document) pair: {exc}") from None


def compile_template(source: str, name: str = "custom", special_tokens: Mapping[str, str] | None = None,
                     ) -> ScoreTemplate:
    """``source`` compiled in transformers' chat-template environment.

    :raises ModelLoadError: for a syntax error, or a template that reads neither ``query`` and
        ``document`` nor ``messages`` (it would give every pair the same prompt).
    """
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    try:
        variables = meta.find_undeclared_variables(environment.parse(source))
        template = environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"score template {name!r} is not valid Jinja (line {exc.lineno}): {exc.message}") from None
    if not any(needed <= variables for needed in _PAIR_VARIABLES):
        raise ModelLoadError(
            f"score template {name!r} reads neither {{{{ query }}}} and {{{{ document }}}} nor messages, so every pair "
            "would get the same prompt"
        )
    return ScoreTemplate(name, source, template, dict(special_tokens or {}))


def builtin_for(model_config: ModelConfig) -> str | None:
    """The built-in template the folder asks for: ``qwen3_reranker`` when ``hf_overrides`` say
    ``is_original_qwen3_reranker`` or the folder is named like Qwen3-Reranker; ``bge_reranker_v2_gemma``
    when it is named like bge-reranker-v2-gemma; else ``None``."""
    if model_config.hf_config.get("is_original_qwen3_reranker") is True:
        return QWEN3_RERANKER
    names = f"{model_config.path} {model_config.hf_config.get('_name_or_path') or ''}"
    return next((name for name, pattern in _FOLDER_NAMES.items() if pattern.search(names)), None)


def for_runtime(setting: str | None, model_config: ModelConfig, task: PoolingTask,
                special_tokens: Mapping[str, str]) -> ScoreTemplate | None:
    """The template a runtime applies to score pairs: ``setting`` (a built-in name or Jinja
    text), else the built-in the folder asks for (:func:`builtin_for`), else ``None``.

    A template applies to a cross-encoder (the runtime's task ``classify`` with one label); a
    built-in the folder asks for is left out otherwise, with a warning.

    :param special_tokens: The tokenizer's special tokens by name (``bos_token``...).
    :raises ModelLoadError: for a ``setting`` the runtime cannot use, or a template that does not compile.
    """
    cross_encoder = task == "classify" and len(model_config.labels) == 1
    if setting is None:
        setting = builtin_for(model_config)
        if setting is not None and not cross_encoder:
            logger.warning(
                "%s looks like an LLM reranker (%s) but serves %r with %d labels, so pairs are scored without its "
                "prompt; load it with hf_overrides (e.g. --hf-overrides '{\"architectures\": "
                "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                "\"is_original_qwen3_reranker\": true}') to rerank", model_config.name, setting, task,
                len(model_config.labels))
            return None
    if setting is None:
        if cross_encoder and model_config.token_logits is not None:  # a causal LM scoring from token logits
            logger.warning(
                "%s scores from the logits of %d vocabulary tokens (hf_overrides' classifier_from_token) with no "
                "score template, so each (query, document) pair is tokenized as a bare text pair; LLM rerankers "
                "read their prompt's answer: give --score-template (score_template=) the prompt the model card "
                "gives, or is_original_qwen3_reranker for Qwen3-Reranker", model_config.name,
                len(model_config.token_logits.token_ids))
        return None
    if not cross_encoder:
        raise ModelLoadError(
            f"score_template formats (query, document) pairs for a cross-encoder (task 'classify' with one label); "
            f"model {model_config.name!r} serves {task!r} with {len(model_config.labels)} labels"
        )
    if setting in BUILTIN_TEMPLATES:
        return compile_template(BUILTIN_TEMPLATES[setting], setting, special_tokens)
    return compile_template(setting, "custom", special_tokens)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)
