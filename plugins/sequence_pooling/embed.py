"""The pooler of the ``embed`` task: pool -> Dense -> Matryoshka slice -> L2 normalize."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from poolrunner.core import (
    DenseLayerSpec,
    ModelConfig,
    ModelLoadError,
    Pooler,
    PoolerOutput,
    PoolingMetadata,
    PoolingParams,
    PoolingTask,
    check_dimensions,
    load_weights,
)

from .methods import pooling_method


class EmbeddingPooler(Pooler):
    """One embedding per request, in the order sentence-transformers applies its modules.

    Pooling (per ``model_config.pooling_type``; several modes are concatenated) is followed by the
    folder's Dense projections, then the Matryoshka slice ``[:dimensions]``, then L2 normalization
    when it is on: a sliced vector has norm 1 and equals ``normalize(full[:dimensions])``.
    """

    def __init__(self, model_config: ModelConfig, dense_layers: list[nn.Module]) -> None:
        super().__init__()
        self.model_config = model_config
        self.method = pooling_method(model_config)
        self.dense = nn.Sequential(*dense_layers)

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> EmbeddingPooler:
        return cls(model_config, [_load_dense(spec) for spec in model_config.dense_layers])

    accepted_params = frozenset({"dimensions", "normalize", "use_activation"})

    @property
    def reads_rows(self) -> str:  # type: ignore[override]
        """CLS pooling alone reads only each request's first row, LAST pooling alone its last."""
        return {("CLS",): "first", ("LAST",): "last"}.get(self.model_config.pooling_modes, "all")

    def get_supported_tasks(self) -> frozenset[PoolingTask]:
        return frozenset({"embed"})

    def check_params(self, params: PoolingParams) -> None:
        """Reject other tasks' options and ``dimensions`` a non-Matryoshka model cannot honour.

        :raises InvalidRequestError: naming the model, the value and what is allowed.
        """
        super().check_params(params)
        check_dimensions(self.model_config, params.dimensions, self.model_config.embedding_size)

    def forward(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        pooled = self.dense(self.method(hidden_states, metadata.query_start_loc))
        settings = [self._settings(p) for p in metadata.pooling_params]
        if len(set(settings)) == 1:  # the common case: one tensor op for the whole step
            return _finish(pooled, *settings[0])
        return [_finish(row, *s) for row, s in zip(pooled, settings, strict=True)]

    def _settings(self, params: PoolingParams) -> tuple[int | None, bool]:
        # vLLM folds normalization into use_activation for embed; an explicit normalize wins.
        for choice in (params.normalize, params.use_activation, self.model_config.normalize):
            if choice is not None:
                return params.dimensions, choice
        raise AssertionError("unreachable: model_config.normalize is always set")


def _finish(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Slice first, then normalize (infinity once normalized before slicing: wrong norms)."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


class _Dense(nn.Module):
    """A sentence-transformers Dense module: ``activation(linear(x))``, in float32."""

    def __init__(self, spec: DenseLayerSpec) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        activation = getattr(nn, spec.activation, None)
        if not (isinstance(activation, type) and issubclass(activation, nn.Module)):
            raise ModelLoadError(f"{spec.path}: activation {spec.activation!r} is not a torch.nn module")
        self.activation = activation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


def _load_dense(spec: DenseLayerSpec) -> nn.Module:
    layer = _Dense(spec)
    folder = Path(spec.path)
    files = [folder / name for name in ("model.safetensors", "pytorch_model.bin") if (folder / name).is_file()]
    if not files:
        raise ModelLoadError(f"{folder}: Dense module has no model.safetensors or pytorch_model.bin")
    state = load_weights(files[0])
    layer.load_state_dict({k: v.float() for k, v in state.items()})
    return layer
