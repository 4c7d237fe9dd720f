"""Exceptions raised by poolrunner, all in this one module. Every one derives from
:class:`PoolrunnerError`; callers (the command line's hints, the server's status codes) key on
these types, never on message text."""

from __future__ import annotations


class PoolrunnerError(Exception):
    """Base class of every error poolrunner raises on purpose."""


class PluginLoadError(PoolrunnerError):
    """A plugin could not be imported or registered.

    The message names the plugin, its distribution and version, and the cause; the original
    exception is chained as ``__cause__``.
    """


class PluginHookError(PoolrunnerError):
    """A plugin's hook raised an exception that is not poolrunner's own (a bug in the plugin):
    the message names the plugin, its distribution, the hook and the exception, chained as
    ``__cause__``. At load the runtime is refused; in a step, that step's requests fail."""


class PoolerOutputError(PoolrunnerError):
    """A pooler returned outputs that break :data:`~poolrunner.core.plugin_api.pooler.PoolerOutput`'s
    contract (not one result per request, or a built-in task's result of the wrong rank): the
    message names the task and the pooler's class; that step's requests fail."""


class PluginConflictError(PoolrunnerError):
    """Two plugins claim the same thing (a registration name, or a ``prepare_inputs`` key)."""


class UnsupportedTaskError(PoolrunnerError, ValueError):
    """The requested pooling task is not served for this model by the installed plugins.

    :ivar task: The task asked for, when one was named.
    """

    def __init__(self, message: str, *, task: str | None = None) -> None:
        super().__init__(message)
        self.task = task


class ModelLoadError(PoolrunnerError, ValueError):
    """The model folder is missing, incomplete, or describes a pipeline poolrunner cannot run."""


class InvalidRequestError(PoolrunnerError, ValueError):
    """A request, its parameters or a runtime argument were rejected before reaching the engine.

    Raised before the request is admitted, so other requests are never affected.

    :ivar param: The request field at fault, when one is (the HTTP error's ``param``).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """An input has more tokens than the model takes, and no truncation was asked for."""


class InputTooLongError(InvalidRequestError):
    """A text input has more characters than ``max_input_chars``, checked before it is tokenized.

    :ivar truncation_helps: Truncating the text to the model maximum would read it (its advice
        names truncation); a surface advising its own truncation field does so only then.
    """

    def __init__(self, message: str, *, param: str | None = None, truncation_helps: bool = False) -> None:
        super().__init__(message, param=param)
        self.truncation_helps = truncation_helps


class TokenOutOfVocabularyError(InvalidRequestError):
    """A token-id input holds an id outside the model's vocabulary (often another tokenizer's ids)."""


class DimensionsNotSupportedError(InvalidRequestError):
    """Matryoshka ``dimensions`` were asked of a model not marked Matryoshka."""


class UnsupportedAttentionError(ModelLoadError):
    """A model's attention layer asks for something the packed attention does not implement."""


class QueueFullError(PoolrunnerError):
    """The loop already holds ``max_pending`` unfinished requests; nothing was queued."""


class LoopClosedError(PoolrunnerError):
    """The loop is stopping or stopped and takes no new requests."""


class StepFailedError(PoolrunnerError):
    """The engine step that ran this request failed; the cause is chained as ``__cause__``.

    Only that step's requests fail; the loop keeps serving the others.
    """


class NonFiniteOutputError(PoolrunnerError):
    """A request's pooled output holds NaN or an infinity (the model overflowed on it at its
    dtype, or its weights or a LoRA adapter's hold such values): the request fails rather than
    answer values that are not numbers (JSON ``null``, quantized codes of 0). HTTP 422: it is
    not retried, since the same input fails again."""


class RayNotInstalledError(PoolrunnerError, ImportError):
    """Ray Data, Ray Serve (or pyarrow) is not installed: ``pip install -e '.[ray]'`` in a poolrunner checkout."""


class JobConflictError(PoolrunnerError):
    """The output folder holds the results of a job with other settings."""


class ReplicaStartError(PoolrunnerError):
    """Ray Serve could not start the replicas (the model did not load in them, say); the message
    ends with the replica's own error."""


def truncation_helps(error: Exception) -> bool:
    """Whether truncation would read the input ``error`` refuses as too long: always for one
    over the model's tokens, for one over ``max_input_chars`` where the core found so
    (:attr:`InputTooLongError.truncation_helps`). A surface advises its own truncation field
    only then."""
    return isinstance(error, PromptTooLongError) or (isinstance(error, InputTooLongError) and error.truncation_helps)


def with_advice(message: str, advice: str) -> str:
    """An error's ``message`` with its advice (after the first ``;``: what to pass to the Python
    API) replaced by ``advice``: a surface's own, naming that surface's fields, or a narrower one."""
    return f"{message.partition(';')[0]}; {advice}"
