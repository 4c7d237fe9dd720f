"""Adapters inside the model: each adapted layer adds ``scale * B_a(A_a x)`` to the rows of the
requests of adapter ``a``, one small product pair per adapter present in the step; the base
weights are shared and never copied.

Which rows belong to which adapter comes from two places:

- **token rows** (the backbone's layers): the step's ``lora_ids`` model input (``[num_tokens]``,
  0 for the base model), which the runner reorders, pads and reshapes with the tokens; a
  pre-hook on the backbone takes it out of the forward's keyword arguments and groups the rows.
- **pooled rows** (heads, which poolers run on one row per request, or per token for token
  heads): the ``pool`` hook's metadata, set in :data:`POOLED` while the poolers run.

A forward hook on each adapted module (PyTorch's ``register_forward_hook``) adds the term to the
module's output: the module itself, its weights and whatever else holds it stay as they are.
"""

from __future__ import annotations

import contextvars
import copy
from typing import Any

import torch
from attrs import define, field, frozen
from torch import nn

from poolrunner.core import ModelLoadError
from poolrunner.core.kernels.onednn import PackedLinear
from poolrunner.plugins.lora.folder import WEIGHTS_FILE, LoraPair, PeftFolder

MODEL_INPUT = "lora_ids"
"""The step's per-token adapter numbers, ``[num_tokens]`` int64 (0: the base model)."""

POOLED: contextvars.ContextVar[tuple[tuple[int, ...], tuple[int, ...]] | None] = contextvars.ContextVar(
    "poolrunner_lora_pooled", default=None)
"""While poolers run: each request's adapter number (0: none) and prompt length, in metadata order."""



@frozen(eq=False)
class RowPlan:
    """A module output's adapted rows, ordered by adapter once for all the layers that use it.

    :ivar rows: ``[num_adapted]`` int64: the rows of requests with an adapter, adapter by adapter.
    :ivar segments: ``(adapter number, start, end)``: ``rows[start:end]`` are that adapter's.
    :ivar first: When ``rows`` is ``first, first + 1, ...``: the adapted rows are one slice, nothing
        to gather (the runner packs a step's requests adapter by adapter, so they usually are);
        else ``None``.
    """

    rows: torch.Tensor
    segments: list[tuple[int, int, int]]
    first: int | None


@frozen(kw_only=True, eq=False)
class Adapter:
    """One loaded adapter: its pairs by module path (the model's own) and its trained heads."""

    lora_id: int
    pairs: dict[str, LoraPair]
    heads: dict[str, nn.Module]


@define(eq=False)
class LoraModel:
    """The adapters of one model and the hooks that apply them; kept on the model itself
    (``model.poolrunner_lora``), so two runtimes never share one.
    """

    model: nn.Module
    adapters: dict[int, Adapter] = field(factory=dict)
    hooked: set[str] = field(factory=set)
    token_plan: RowPlan | None = None
    token_rows: int = 0
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None
    """The last layer input whose adapted rows were gathered, and those rows in float32: the
    query, key and value layers read one input."""

    @classmethod
    def of(cls, model: nn.Module) -> LoraModel:
        """The model's adapters, the backbone's pre- and post-hooks installed the first time."""
        state = model.__dict__.get("poolrunner_lora")
        if state is None:
            state = cls(model)
            model.__dict__["poolrunner_lora"] = state  # a plain attribute, outside state_dict
            model.base_model.register_forward_pre_hook(state._begin_step, with_kwargs=True)
            model.base_model.register_forward_hook(state._end_step, always_call=True)
        return state

    def load(self, lora_id: int, folder: PeftFolder) -> Adapter:
        """Bind ``folder``'s tensors to this model's modules and serve them as ``lora_id``.

        :raises ModelLoadError: naming the tensor and the module for a module the model lacks,
            a layer that is not linear, or shapes that do not fit (another base model).
        """
        modules = dict(self.model.named_modules())
        device = next(self.model.parameters()).device
        pairs = {}
        shared = _shared_row_layers(self.model.config)
        for peft_path, pair in folder.pairs.items():
            path = self._resolve(peft_path, modules, folder)
            if path.rsplit(".", 1)[-1] in shared:
                raise ModelLoadError(
                    f"{folder.path / WEIGHTS_FILE}: module {peft_path!r}: {type(self.model).__name__} also runs this "
                    "layer on its relative position embeddings, shared by every request of a step, so an adapter "
                    "there cannot apply to its own requests only (LoRA on its other layers is served)")
            module = modules[path]
            in_features, out_features = _linear_shape(module, f"{folder.path / WEIGHTS_FILE}: module {peft_path!r}")
            if pair.a.shape[1] != in_features or pair.b.shape[0] != out_features:
                raise ModelLoadError(
                    f"{folder.path / WEIGHTS_FILE}: module {peft_path!r}: lora_A {tuple(pair.a.shape)} and lora_B "
                    f"{tuple(pair.b.shape)} do not fit the model's layer ({in_features} -> {out_features}): an "
                    f"adapter of another base model?")
            pairs[path] = LoraPair(a=pair.a.to(device), b=pair.b.to(device), scale=pair.scale)
        heads = {}
        for peft_path, state_dict in folder.saved.items():
            path = self._resolve(peft_path, modules, folder)
            if self._in_backbone(path):
                raise ModelLoadError(f"{folder.path / WEIGHTS_FILE}: modules_to_save {peft_path!r} is inside the "
                                     "backbone; only heads (run by the poolers) are served")
            heads[path] = _trained_copy(modules[path], state_dict, f"{folder.path / WEIGHTS_FILE}: "
                                        f"modules_to_save {peft_path!r}")
        adapter = Adapter(lora_id=lora_id, pairs=pairs, heads=heads)
        for path in [*pairs, *heads]:
            if path not in self.hooked:
                modules[path].register_forward_hook(self._hook(path, pooled_only=path in heads))
                self.hooked.add(path)
        self.adapters[lora_id] = adapter
        return adapter

    def _resolve(self, peft_path: str, modules: dict[str, nn.Module], folder: PeftFolder) -> str:
        """The model's path of a module PEFT saved as ``peft_path``: the same, or with the
        backbone's prefix (``bert.``) added or removed, as the adapter was made on a model with
        or without a head."""
        prefix = self.model.base_model_prefix
        candidates = [peft_path, f"{prefix}.{peft_path}", peft_path.removeprefix(f"{prefix}.")]
        for path in candidates:
            if path in modules and (path != "" or peft_path == ""):
                return path
        raise ModelLoadError(f"{folder.path / WEIGHTS_FILE}: module {peft_path!r} is not in "
                             f"{type(self.model).__name__}: an adapter of another base model?")

    def _in_backbone(self, path: str) -> bool:
        backbone = self.model.base_model
        if backbone is self.model:
            return True
        return any(module is backbone for name, module in self.model.named_modules()
                   if path == name or path.startswith(name + ".") and name)

    def unload(self, lora_id: int) -> bool:
        """Drop adapter ``lora_id`` (its hooks stay, doing nothing for it)."""
        return self.adapters.pop(lora_id, None) is not None

    # ---- per step ----

    def _begin_step(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ids = kwargs.pop(MODEL_INPUT, None)
        if ids is None:
            self.token_plan = None
            return None
        flat = ids.reshape(-1)
        self.token_rows = flat.numel()
        self.token_plan = _plan(flat)
        return args, kwargs

    def _end_step(self, *_: Any) -> None:
        self.token_plan = None
        self.gathered = None

    def _rows(self, num_rows: int, pooled_only: bool) -> RowPlan | None:
        """The adapters' row groups for a module output of ``num_rows`` rows, or ``None``."""
        pooled = POOLED.get()
        if pooled is not None:
            ids, lengths = pooled
            if num_rows == len(ids):
                return _plan(torch.tensor(ids))
            if num_rows == sum(lengths):
                return _plan(torch.repeat_interleave(torch.tensor(ids), torch.tensor(lengths)))
            raise RuntimeError(f"LoRA: a head ran on {num_rows} rows, neither the {len(ids)} requests nor their "
                               f"{sum(lengths)} tokens")
        if pooled_only or self.token_plan is None:
            return None
        # A backbone's own pooler (BERT's) runs on one row inside the forward; the runner drops
        # its output, and the classify head runs it again on the pooled rows (above).
        return self.token_plan if num_rows == self.token_rows else None

    def _hook(self, path: str, *, pooled_only: bool) -> Any:
        def apply(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            if not self.adapters:
                return None
            x = args[0]
            plan = self._rows(x.reshape(-1, x.shape[-1]).shape[0], pooled_only)
            if plan is None:
                return None
            return self._apply(path, x, output, plan)
        return apply

    def _apply(self, path: str, x: torch.Tensor, output: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """``output`` with each adapter's term added to its rows (its own head's output there, for
        a head it trained), in place: the adapted rows gathered once per layer input, two products
        per adapter on a contiguous slice of them, one add back; when the rows are side by side
        (:attr:`RowPlan.first`), neither gather nor scatter."""
        out = output.reshape(-1, output.shape[-1])
        selected = self._gather(x, plan)
        delta = None
        for lora_id, start, end in plan.segments:
            adapter = self.adapters.get(lora_id)
            if adapter is None:
                raise RuntimeError(f"LoRA adapter number {lora_id} is not loaded")
            head = adapter.heads.get(path)
            if head is not None:  # PEFT's ModulesToSaveWrapper: the adapter's own copy answers
                rows = plan.rows[start:end]
                out.index_copy_(0, rows, head(selected[start:end].to(x.dtype)).reshape(len(rows), -1).to(out.dtype))
                continue
            pair = adapter.pairs.get(path)
            if pair is None:
                continue
            if delta is None:
                delta = self._delta(out, plan)
            # PEFT runs the adapter in its weights' float32 and adds in float32 (autocast_adapter_dtype).
            if delta is out:  # float32 rows side by side: added in place
                out[plan.first + start:plan.first + end].addmm_(selected[start:end] @ pair.at, pair.bt)
            else:
                torch.mm(selected[start:end] @ pair.at, pair.bt, out=delta[start:end])
        if delta is not None and delta is not out:
            if plan.first is not None:
                rows = out[plan.first:plan.first + len(plan.rows)]
                rows.copy_(rows.float() + delta)
            elif out.dtype == torch.float32:
                out.index_add_(0, plan.rows, delta)
            else:  # rows without a term add 0: unchanged, heads' rows included
                out.index_copy_(0, plan.rows, (out.index_select(0, plan.rows).float() + delta).to(out.dtype))
        return out.view(output.shape)  # ``output`` itself, unless reshaping it had to copy

    @staticmethod
    def _delta(out: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """Where the adapters' terms go: ``out`` itself when it is float32 and the rows are a
        slice of it, else a zeroed ``[num_adapted, out_features]`` float32 buffer."""
        if out.dtype == torch.float32 and plan.first is not None:
            return out
        return torch.zeros(len(plan.rows), out.shape[-1], dtype=torch.float32, device=out.device)

    def _gather(self, x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """``[num_adapted, in_features]`` float32: ``x``'s adapted rows in ``plan``'s order."""
        if self.gathered is not None and self.gathered[0] is x and plan is self.token_plan:
            return self.gathered[1]
        x_rows = x.reshape(-1, x.shape[-1])
        if plan.first is not None:
            selected = x_rows[plan.first:plan.first + len(plan.rows)].float()
        else:
            selected = x_rows.index_select(0, plan.rows).float()
        if plan is self.token_plan:
            self.gathered = (x, selected)
        return selected


def _plan(ids: torch.Tensor) -> RowPlan | None:
    """The :class:`RowPlan` of per-row adapter numbers ``ids`` (0: none); ``None`` without any."""
    adapted = ids.nonzero().squeeze(1)
    if len(adapted) == 0:
        return None
    numbers, order = torch.sort(ids.index_select(0, adapted), stable=True)
    present, counts = torch.unique_consecutive(numbers, return_counts=True)
    ends = counts.cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    rows = adapted.index_select(0, order)
    first = int(rows[0])
    side_by_side = int(rows[-1]) - first == len(rows) - 1 and bool((rows.diff() == 1).all())
    return RowPlan(rows, list(zip(present.tolist(), starts, ends, strict=True)), first if side_by_side else None)


def _shared_row_layers(config: Any) -> frozenset[str]:
    """Names of the layers a model also runs on rows every request of a step shares: DeBERTa's
    disentangled attention projects its relative position embeddings with ``query_proj`` and
    ``key_proj`` (``share_att_key``) or with its ``pos_*`` layers (transformers'
    ``DisentangledSelfAttention``). PEFT adds its one adapter's term there too."""
    deberta = getattr(config, "model_type", None) in ("deberta", "deberta-v2")
    if not deberta or not getattr(config, "relative_attention", False):
        return frozenset()
    if getattr(config, "share_att_key", False):
        return frozenset({"query_proj", "key_proj"})
    return frozenset({"pos_key_proj", "pos_query_proj", "pos_proj", "pos_q_proj"})


def _linear_shape(module: nn.Module, where: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of ``nn.Linear`` (or its prepacked
    :class:`~poolrunner.core.kernels.onednn.PackedLinear`, loaded unfused when adapters are served)
    or transformers' ``Conv1D`` (GPT-2's, ``weight`` ``[in, out]``: PEFT's ``fan_in_fan_out``)."""
    if isinstance(module, nn.Linear | PackedLinear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.nf
    raise ModelLoadError(f"{where} is a {type(module).__name__}; LoRA is served on linear layers only")


def _trained_copy(module: nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> nn.Module:
    """A copy of head ``module`` holding the adapter's trained weights, without any hook."""
    head = copy.deepcopy(module)
    for submodule in head.modules():
        submodule._forward_hooks.clear()
        submodule._forward_pre_hooks.clear()
    expected = {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}
    given = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    if expected != given:
        raise ModelLoadError(f"{where}: tensors {given} do not fit the model's {expected}")
    head.load_state_dict({name: tensor.to(next(iter(head.state_dict().values())).dtype)
                          for name, tensor in state_dict.items()})
    return head.eval()

