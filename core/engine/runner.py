"""Runs one step: packed inputs -> model forward -> pooling -> output handle.

With chunked prefill a request's prompt runs over several steps. Its keys and values are
kept in a :class:`KVCache` and its hidden states of earlier chunks are kept (cloned: the next
step reuses the buffers); when its last chunk runs, the pooler sees the whole prompt's hidden
states, exactly as if it had run in one step. So every pooler (CLS, MEAN, LAST, ALL, STEP, and
third-party ones) works across chunks unchanged, and a request yields nothing until it finishes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from attrs import frozen
from torch import nn

from poolrunner.core.engine.buckets import bucket_num_tokens
from poolrunner.core.errors import ModelLoadError, PoolerOutputError
from poolrunner.core.hooks import Hooks
from poolrunner.core.kernels.attention import ATTENTION_NAME, LAYOUT_KWARG, KVCache, PackedLayout, probe_attention
from poolrunner.core.model.metadata import position_offset
from poolrunner.core.plugin_api.batch import InputBatch, PoolingMetadata
from poolrunner.core.plugin_api.output import OutputHandle
from poolrunner.core.plugin_api.pooler import Pooler, PoolerOutput
from poolrunner.core.plugin_api.request import RequestState
from poolrunner.core.types import ModelConfig, PoolingTask

# Padded path (families without the attention interface): a group of requests grows while its
# padded size stays within this factor of its real tokens.
MAX_PADDING_RATIO = 1.25


class ModelRunner:
    """Owns the model, a pooler per served task and the state of partly prefilled requests.

    Requests of different tasks share a step: one forward pass, then each task's pooler pools
    its own requests.
    """

    def __init__(
        self, model: nn.Module, poolers: Mapping[PoolingTask, Pooler], hooks: Hooks, model_config: ModelConfig, *,
        default_task: PoolingTask, bucket_tokens: bool = False, native_attention: bool = False,
        rows_layer: bool = False,
    ) -> None:
        """:param poolers: The pooler of each served task.
        :param default_task: The task :attr:`pooler` serves (the runtime's default).
        :param bucket_tokens: Round each step's token count up to a bucket
            (:func:`~poolrunner.core.engine.buckets.bucket_num_tokens`) so kernels are reused: on the CPU.
        :param native_attention: Attend in one kernel call per window where a layer's mask allows:
            poolrunner's CPU kernel (:mod:`~poolrunner.core.kernels.cpu_kernels`, already built),
            on CUDA flash attention's variable-length one (:mod:`~poolrunner.core.kernels.cuda_attention`).
        :param rows_layer: The model's last layer can compute only each request's first or last
            row (:mod:`~poolrunner.core.model.inlined_blocks`): steps whose poolers read nothing else
            ask it to, unless a plugin that does not ship with poolrunner implements ``pool`` (it is
            promised every row).
        :raises ModelLoadError: for a pooler whose ``reads_rows`` is not ``all``, ``first`` or ``last``."""
        for task, pooler in poolers.items():
            if pooler.reads_rows not in ("all", "first", "last"):
                raise ModelLoadError(f"the {task!r} pooler {type(pooler).__qualname__} declares reads_rows="
                                     f"{pooler.reads_rows!r}; it must be 'all', 'first' or 'last'")
        self.model = model  # with its heads: what adapters load into
        self.backbone = model.base_model  # hidden states; heads belong to poolers
        self.poolers = dict(poolers)
        self.pooler = self.poolers[default_task]
        self.hooks = hooks
        self.model_config = model_config
        self.bucket_tokens = bucket_tokens
        self.native_attention = native_attention
        self.rows_layer = rows_layer and hooks.only_builtin("pool")
        # transformers derives RoBERTa-family positions from the ids (starting after the padding
        # index) only when none are passed; packed position ids must carry the same offset.
        self.position_offset = position_offset(model_config.model_type, model_config.hf_config.get("pad_token_id"))
        self.position_pad_id = self.position_offset - 1 if self.position_offset else None
        self.kv_caches: dict[str, KVCache] = {}
        self.partial_hidden: dict[str, list[torch.Tensor]] = {}
        # Families whose attention does not dispatch through transformers' attention interface
        # (DeBERTa-v2, MPNet) run each step as padded batches with an attention mask instead.
        self.packed = getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
        self.causal = self.packed and probe_attention(
            self.backbone, model_config.architecture, next(model.parameters()).device, self.position_offset
        )
        """No layer lets a token see a later one, so prompts may run in chunks (chunked prefill)."""

    @torch.inference_mode()
    def execute(self, batch: InputBatch) -> tuple[list[RequestState], OutputHandle | None]:
        """Run ``batch``; pool the requests it finishes and start moving their results to the CPU.

        :returns: The requests finished this step (packing order) and a handle whose
            ``get_output()`` gives one result per finished request; ``None`` when none finished.
        """
        finishing = [
            state.num_computed_tokens + count == state.num_tokens
            for state, count in zip(batch.requests, batch.num_scheduled_tokens, strict=True)
        ]
        hidden_states = self.forward(batch, finishing)
        finished = [state for state, done in zip(batch.requests, finishing, strict=True) if done]
        offsets = batch.query_start_loc_cpu.tolist()
        for i, state in enumerate(batch.requests):
            if not finishing[i]:
                chunk = hidden_states[offsets[i] : offsets[i + 1]].clone()
                self.partial_hidden.setdefault(state.request_id, []).append(chunk)
        if not finished:
            return [], None
        hidden, metadata = self._pooling_inputs(batch, finishing, hidden_states)
        for state in finished:  # now, not at release: with async scheduling that is a step later
            self.free(state.request_id)
        return finished, self.hooks.process_output(output=self._pool(hidden, metadata), batch=batch)

    def _pool(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        """Each task's pooler on its own requests; one result per request, in packing order."""
        tasks = [params.task for params in metadata.pooling_params]
        if len(set(tasks)) == 1:  # the common case: the whole step is one task
            return self._pool_task(tasks[0], hidden, metadata)
        results: list[Any] = [None] * len(tasks)
        for task in dict.fromkeys(tasks):
            members = [i for i, t in enumerate(tasks) if t == task]
            rows, subset = _select(metadata, members)
            output = self._pool_task(task, hidden.index_select(0, rows), subset)
            for i, result in zip(members, output, strict=True):  # a tensor iterates over its rows
                results[i] = result
        return results

    def _pool_task(self, task: PoolingTask, hidden: torch.Tensor, metadata: PoolingMetadata) -> PoolerOutput:
        """``task``'s pooler on all of ``metadata``'s requests, its output checked
        (:func:`_check_output`); an exception it raises notes which pooler it was."""
        pooler = self.poolers[task]
        try:
            output = self.hooks.pool(pooler=pooler, hidden_states=hidden, metadata=metadata)
        except Exception as exc:
            exc.add_note(f"raised while pooling task {task!r} with {_class_name(pooler)}")
            raise
        _check_output(task, pooler, output, len(metadata.pooling_params), _rank(task, self.model_config))
        return output

    def forward(self, batch: InputBatch, finishing: list[bool]) -> torch.Tensor:
        """The backbone's last hidden states of the scheduled tokens, ``[num_tokens, hidden_size]``.

        On the packed path the requests run sorted by LoRA adapter, then length (prefill chunks
        last), so requests of equal length sit side by side and attend in one call
        (:class:`PackedLayout`); the rows are put back in packing order after the backbone.
        """
        extra = self.hooks.prepare_inputs(batch=batch, model_config=self.model_config)
        if not self.packed:
            return self._forward_padded(batch, extra)
        caches = [
            None if state.num_computed_tokens == 0 and done
            else (self.kv_caches.setdefault(state.request_id, KVCache()), not done)
            for state, done in zip(batch.requests, finishing, strict=True)
        ]
        # A LoRA adapter's requests side by side make its rows one slice of every layer's input.
        adapters = [state.request.params.lora_id or 0 for state in batch.requests]
        order = sorted(range(batch.num_reqs),
                       key=lambda i: (caches[i] is not None, adapters[i], batch.num_scheduled_tokens[i]))
        layout = PackedLayout.build([batch.num_scheduled_tokens[i] for i in order], caches=[caches[i] for i in order],
                                    native=self.native_attention, rows=self._rows_read(batch, caches, finishing))
        inputs = {"input_ids": batch.input_ids, "position_ids": self._position_ids(batch), **extra}
        if order == list(range(batch.num_reqs)):
            return self._forward_packed(inputs, layout, batch.num_tokens)
        tokens, inverse = _token_order(batch, order)
        inputs = {key: value.index_select(0, tokens) for key, value in inputs.items()}
        return self._forward_packed(inputs, layout, batch.num_tokens).index_select(0, inverse)

    def _position_ids(self, batch: InputBatch) -> torch.Tensor:
        """``[num_tokens]`` position ids: each token's index in its prompt, after the padding index
        for the RoBERTa families, which number only the tokens that are not the pad id (a pad id
        takes the padding index itself), as transformers' ``create_position_ids_from_input_ids``:
        a pad token written in a text or sent as an id must not shift the tokens after it."""
        positions, pad = batch.positions + self.position_offset, self.position_pad_id
        if pad is None:
            return positions
        pads = batch.input_ids == pad
        if not bool(pads.any()):
            return positions
        counted = (~pads).long()
        total = torch.cumsum(counted, 0)  # counted tokens up to each, over the whole step
        starts = batch.query_start_loc[:-1]
        before = [sum(token != pad for token in state.request.prompt_token_ids[:state.num_computed_tokens])
                  for state in batch.requests]  # an earlier chunk's tokens that count
        shift = total[starts] - counted[starts] - torch.tensor(before, device=total.device)
        counts = total - torch.repeat_interleave(shift, torch.tensor(batch.num_scheduled_tokens, device=total.device))
        return pad + counts * counted

    def _rows_read(self, batch: InputBatch, caches: Sequence[object], finishing: Sequence[bool]) -> str:
        """``"first"`` or ``"last"`` where every task's pooler in this step reads only that row of
        each request; else ``"all"``. A first row is read only where every request runs whole in
        the step (an earlier chunk's rows are kept for the pooler as they are); a last row, that of
        a request's last chunk, where some request finishes in the step (else no row is read)."""
        if not self.rows_layer:
            return "all"
        reads = {self.poolers[state.request.params.task].reads_rows for state in batch.requests}
        if len(reads) != 1:
            return "all"
        (rows,) = reads
        if rows == "first" and any(cache is not None for cache in caches):
            return "all"
        return rows if rows != "last" or any(finishing) else "all"

    def _forward_packed(self, inputs: dict[str, torch.Tensor], layout: PackedLayout, num_tokens: int) -> torch.Tensor:
        """One forward over ``inputs`` (``[num_tokens]`` each, in ``layout``'s order): ``[num_tokens, hidden_size]``."""
        if self.bucket_tokens:
            # Padding rows belong to no request: attention leaves them zero and they are dropped.
            padding = bucket_num_tokens(num_tokens) - num_tokens
            inputs = {key: F.pad(value, (0, 0) * (value.dim() - 1) + (0, padding)) for key, value in inputs.items()}
        # An all-ones mask: transformers then builds each layer's mask rule from the model's own
        # mask functions, without re-deriving sequence boundaries from the packed positions.
        mask = torch.ones_like(inputs["input_ids"]).unsqueeze(0)
        outputs = self.backbone(
            use_cache=False, attention_mask=mask, **{LAYOUT_KWARG: layout},
            **{key: value.unsqueeze(0) for key, value in inputs.items()},
        )
        return outputs[0][0, :num_tokens]

    def _forward_padded(self, batch: InputBatch, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """One right-padded, masked forward per length group, as transformers runs a padded batch.

        Positions are left to the model (every prompt here starts at 0: no chunked prefill).
        """
        hidden = None
        for group in _padded_groups(batch.num_scheduled_tokens, batch.device):
            inputs = {key: value.index_select(0, group.gather).view(group.count, group.length, *value.shape[1:])
                      for key, value in {"input_ids": batch.input_ids, **extra}.items()}
            states = self.backbone(attention_mask=group.mask, **inputs)[0]
            rows = states.reshape(group.count * group.length, -1).index_select(0, group.valid)
            if hidden is None:
                hidden = rows.new_empty(batch.num_tokens, rows.shape[-1])
            hidden.index_copy_(0, group.dest, rows)
        assert hidden is not None
        return hidden

    def free(self, request_id: str) -> None:
        """Drop a request's cached keys, values and hidden states (finished or aborted)."""
        self.kv_caches.pop(request_id, None)
        self.partial_hidden.pop(request_id, None)

    def _pooling_inputs(
        self, batch: InputBatch, finishing: list[bool], hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, PoolingMetadata]:
        """The whole-prompt hidden states of the finished requests, packed, and their metadata."""
        finished = [state for state, done in zip(batch.requests, finishing, strict=True) if done]
        metadata_args = {
            "request_ids": tuple(state.request_id for state in finished),
            "pooling_params": tuple(state.request.params for state in finished),
            "prompt_lens": torch.tensor([state.num_tokens for state in finished], dtype=torch.int64),
        }
        if all(finishing) and all(state.num_computed_tokens == 0 for state in finished):
            # The common case: every request ran whole in this step.
            return hidden_states, PoolingMetadata(
                **metadata_args, query_start_loc=batch.query_start_loc, prompt_token_ids=batch.input_ids
            )
        offsets = batch.query_start_loc_cpu.tolist()
        rows = [
            torch.cat([*self.partial_hidden.get(state.request_id, ()), hidden_states[offsets[i] : offsets[i + 1]]])
            for i, state in enumerate(batch.requests) if finishing[i]
        ]
        starts = torch.zeros(len(finished) + 1, dtype=torch.int64)
        torch.cumsum(metadata_args["prompt_lens"], 0, out=starts[1:])
        token_ids = torch.tensor([t for state in finished for t in state.request.prompt_token_ids], dtype=torch.int64)
        return torch.cat(rows), PoolingMetadata(
            **metadata_args, query_start_loc=starts.to(batch.device), prompt_token_ids=token_ids.to(batch.device)
        )


def _token_order(batch: InputBatch, order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat token indices that pack the requests in ``order``, and those that undo it.

    :returns: ``(tokens, inverse)``, ``[num_tokens]`` int64 each on the batch's device:
        ``packed.index_select(0, tokens)`` is in ``order`` and ``.index_select(0, inverse)`` of
        that is ``packed`` again.
    """
    lengths = torch.tensor(batch.num_scheduled_tokens, dtype=torch.int64)[order]
    starts = torch.zeros_like(lengths)
    torch.cumsum(lengths[:-1], 0, out=starts[1:])
    positions = torch.arange(batch.num_tokens)
    # Each token moves by its request's new start minus its old one.
    tokens = positions + torch.repeat_interleave(batch.query_start_loc_cpu[order] - starts, lengths)
    inverse = torch.empty_like(tokens)
    inverse[tokens] = positions
    return tokens.to(batch.device, non_blocking=True), inverse.to(batch.device, non_blocking=True)


@frozen(eq=False)
class _PaddedGroup:
    """Requests run as one right-padded batch: ``count`` rows of ``length`` tokens."""

    count: int
    length: int
    gather: torch.Tensor  # [count * length] flat token index of each padded slot (pads -> 0)
    valid: torch.Tensor  # [num_real] padded slots that hold real tokens
    dest: torch.Tensor  # [num_real] flat token index of each of those slots
    mask: torch.Tensor  # [count, length] int64, 1 where a token is real


def _padded_groups(lengths: Sequence[int], device: torch.device) -> list[_PaddedGroup]:
    """Requests sorted by length, a group closed when padding it to its longest member would
    exceed :data:`MAX_PADDING_RATIO` times its real tokens; ``lengths[i]`` tokens are request ``i``'s."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    groups, members = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        candidate = members + [i]
        if members and lengths[i] * len(candidate) > MAX_PADDING_RATIO * sum(lengths[j] for j in candidate):
            groups.append(_padded_group(members, lengths, starts, device))
            candidate = [i]
        members = candidate
    groups.append(_padded_group(members, lengths, starts, device))
    return groups


def _padded_group(members: list[int], lengths: Sequence[int], starts: list[int], device: torch.device) -> _PaddedGroup:
    """Requests ``members`` as one batch padded to the longest; request ``i``'s tokens start at ``starts[i]``."""
    longest = max(lengths[i] for i in members)
    gather, valid, dest = [], [], []
    for row, i in enumerate(members):
        tokens = list(range(starts[i], starts[i] + lengths[i]))
        gather.extend(tokens + [0] * (longest - lengths[i]))
        valid.extend(range(row * longest, row * longest + lengths[i]))
        dest.extend(tokens)
    real = torch.tensor([lengths[i] for i in members])
    mask = (torch.arange(longest)[None, :] < real[:, None]).long()

    def to_device(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    return _PaddedGroup(len(members), longest, to_device(gather), to_device(valid), to_device(dest), to_device(mask))


def _select(metadata: PoolingMetadata, members: list[int]) -> tuple[torch.Tensor, PoolingMetadata]:
    """The hidden-state rows of requests ``members`` (packing order kept) and their own metadata."""
    lengths = metadata.prompt_lens.tolist()
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    device = metadata.query_start_loc.device
    rows = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in members]).to(device)
    prompt_lens = metadata.prompt_lens[members]
    offsets = torch.zeros(len(members) + 1, dtype=torch.int64)
    torch.cumsum(prompt_lens, 0, out=offsets[1:])
    return rows, PoolingMetadata(
        request_ids=tuple(metadata.request_ids[i] for i in members),
        pooling_params=tuple(metadata.pooling_params[i] for i in members),
        prompt_lens=prompt_lens, query_start_loc=offsets.to(device),
        prompt_token_ids=metadata.prompt_token_ids.index_select(0, rows),
    )


_RANKS = {"embed": 1, "classify": 1, "token_embed": 2, "token_classify": 2}
"""The rank of one request's result of the built-in tasks that have one tensor per request
(``token_classify`` on BGE-M3's token weights: 1, :func:`_rank`)."""


def _rank(task: PoolingTask, model_config: ModelConfig) -> int | None:
    if task == "token_classify" and model_config.token_classify_weights:
        return 1
    return _RANKS.get(task)


def _check_output(task: PoolingTask, pooler: Pooler, output: PoolerOutput, count: int, rank: int | None) -> None:
    """A pooler's output must hold one result per request (a tensor: one row each), of ``rank``
    (:func:`_rank`) where the task has one.

    :raises PoolerOutputError: naming the task, the pooler's class, and what it returned.
    """
    if not isinstance(output, torch.Tensor | list | tuple):
        raise PoolerOutputError(f"{_who(task, pooler)} returned {type(output).__name__}, not a tensor or a list "
                                "(PoolerOutput)")
    results = (output.shape[0] if output.dim() else 0) if isinstance(output, torch.Tensor) else len(output)
    if results != count:
        raise PoolerOutputError(f"{_who(task, pooler)} returned {results} result{'s' * (results != 1)} for {count} "
                                f"request{'s' * (count != 1)}; a pooler returns one result per request (PoolerOutput)")
    if rank is None:
        return
    tensor = isinstance(output, torch.Tensor)
    ranks = {output.dim() - 1} if tensor else {r.dim() if isinstance(r, torch.Tensor) else -1 for r in output}
    if ranks != {rank}:
        shapes = f"a tensor of shape {list(output.shape)}" if tensor else "results of shapes " + ", ".join(
            str(list(r.shape)) if isinstance(r, torch.Tensor) else type(r).__name__ for r in output[:3])
        raise PoolerOutputError(f"{_who(task, pooler)} returned {shapes}; each request's {task} result is a tensor "
                                f"of {rank} dimension{'s' * (rank > 1)}")


def _who(task: PoolingTask, pooler: Pooler) -> str:
    return f"the pooler of task {task!r} ({_class_name(pooler)})"


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
