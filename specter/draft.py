"""The draft: the target's own non-expert tensors plus quantized routed experts, all on the device.

It proposes k tokens from x0 and, as a side effect, counts its routers' choices per (layer, expert) in a
device tensor: the prediction of which experts the target's verify pass will need. A draft step has no
host synchronisation: expert ids stay on the device and the fused MoE reads them there. On CUDA a whole
draft step is one CUDA-graph replay (specter.model.graphed): k steps are k replays, the sampled token
feeding the next step's input buffer on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import torch

from specter.config import DraftConfig, KernelTuning, MoETiles
from specter.errors import ConfigError
from specter.log import get_logger
from specter.model.graphed import GraphedStep, StaticStep, static_step_supported
from specter.model.kv import KVCache
from specter.model.registry import transformer_for
from specter.model.transformer import ExpertMLP, Transformer
from specter.model.weights import unpack_expert
from specter.quant import QuantizedExperts, fused_moe, quantize_experts
from specter.quant.groupwise import default_scale_dtype, empty_experts, packed_bytes_per_row
from specter.sampling import SamplingParams, sample

log = get_logger(__name__)

BITS = {"int4": 4, "int8": 8, "int3": 3, "int2": 2, "gptq4": 4}

Tensor = torch.Tensor


def draft_group(k: int, group: int) -> int:
    """The configured group when it divides k, else one group per row (tiny test models have small k)."""
    return group if group != -1 and k % group == 0 else -1


def draft_expert_bytes(hidden: int, inter: int, quant: str, group: int, scale_bytes: int) -> int:
    """Bytes one quantized expert takes on the device: packed codes plus group scales, with the group both of its
    projections are quantized with (`layer_group`)."""
    bits, common = BITS[quant], layer_group(hidden, inter, group)
    groups13 = 1 if common == -1 else hidden // common
    groups2 = 1 if common == -1 else inter // common
    codes = 2 * inter * packed_bytes_per_row(hidden, bits) + hidden * packed_bytes_per_row(inter, bits)
    return codes + (2 * inter * groups13 + hidden * groups2) * scale_bytes


class DraftExperts:
    """ExpertProvider of the draft: fused quantized MoE per layer, and route counters [L, E] on the device."""

    def __init__(self, layers: dict[int, QuantizedExperts], num_layers: int, num_experts: int, device: torch.device, *,
                 tiles: MoETiles | None = None) -> None:
        self.layers = layers
        self.tiles = tiles or MoETiles()  # EngineConfig.tuning.kernels.moe: the fused MoE's tiles
        self.route_counts = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)  # [L, E]
        self.row_sync = torch.zeros(num_layers, dtype=torch.int32, device=device)  # rowfused.Select's counters, kept 0

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.layers.values())

    async def run(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor, mlp: ExpertMLP) -> Tensor:
        return self.moe(layer, x, ids, weights)

    def moe(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """Run the fused quantized MoE, which counts the routes into route_counts[layer] (on the device: graph-safe;
        in the kernels on the Triton path, no launch of its own); a StaticMoE."""
        return fused_moe(x, ids, weights, self.layers[layer], self.tiles, counts=self.route_counts[layer])

    __call__ = moe  # a StaticMoE itself, so the static step finds row_experts on it

    def row_experts(self, layer: int) -> tuple[QuantizedExperts, Tensor, Tensor]:
        """(the layer's quantized experts, its route counter [E], its int32 [1] counter for rowfused.Select) for the
        one-row kernels (Transformer.row_feed_forward, which checks that rowfused takes them with its tiles)."""
        return self.layers[layer], self.route_counts[layer], self.row_sync[layer : layer + 1]


def quantize_layers(experts: Iterable[tuple[int, int, Tensor]], spec_hidden: int, spec_inter: int, num_experts: int,
                    config: DraftConfig, device: torch.device, *, layers: Sequence[int], dtype: torch.dtype) -> dict[int, QuantizedExperts]:
    """Quantize every layer's experts (streamed as packed flats of `dtype`, one layer at a time) onto the device.

    Every layer of `layers` gets its packed tensors before the first expert arrives: allocated on a reserve emptied of
    cached blocks, each long-lived tensor has a segment of its own, and the stream's temporaries (a layer's flats
    and their float copies, a widened load's) take segments that `empty_cache` gives back whole afterwards. Carved
    from those temporaries' cached blocks instead, the draft had pinned about 1 GiB of the reserve beyond the plan
    on the 32-layer full-depth shapes."""
    assert config.quant != "gptq4", "gptq4 drafts are built by Runtime.calibrate_draft, after loading"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bits, group = BITS[config.quant], layer_group(spec_hidden, spec_inter, config.group_size)
    out = {layer: empty_experts(num_experts, spec_inter, spec_hidden, bits, group, default_scale_dtype(dtype), device)
           for layer in layers}
    pending: dict[int, list[Tensor]] = {}
    for layer, expert, flat in experts:
        if layer not in out:
            raise ConfigError(f"the draft's expert stream gave layer {layer}, which is not one of its MoE layers {list(out)}")
        pending.setdefault(layer, [None] * num_experts)[expert] = flat  # type: ignore[list-item]
        if all(t is not None for t in pending[layer]):
            _quantize_layer(pending.pop(layer), spec_hidden, spec_inter, bits, group, out[layer], device)
    assert not pending, f"layers {sorted(pending)} are missing experts"
    return out


def layer_group(hidden: int, inter: int, group_size: int) -> int:
    """The group both of a layer's projections are quantized with: the configured one where it divides both the
    hidden and the intermediate size, else one group per row."""
    group = draft_group(hidden, group_size)
    return group if draft_group(inter, group_size) == group else -1


def _quantize_layer(flats: list[Tensor], hidden: int, inter: int, bits: int, group: int, out: QuantizedExperts,
                    device: torch.device) -> None:
    w13, w2 = zip(*(unpack_expert(flat.to(device), hidden, inter) for flat in flats))
    gate_up = torch.stack(w13)  # [E, 2I, D]
    down = torch.stack(w2)  # [E, D, I]
    quantize_experts(gate_up[:, :inter], gate_up[:, inter:], down, bits, group, out=out)


class Draft:
    """Proposes k tokens with the quantized draft, reading and extending the target's KV cache.

    The draft writes its k tokens' KV into the target's static cache beyond the committed length: that
    region is scratch (the verify overwrites it, and `crop` discards the rest), so no second cache exists.

    static: run each step as the one-row static step (graphed on CUDA); None means "on CUDA, when the
    model's class declares the static step" (graphed.static_step_supported; the runtime decides in specter.steps).
    The eager forward is used otherwise. kernels: the draft forward's KernelTuning, by default the target's
    (EngineConfig.tuning.kernels); benchmarks time a draft built with other kernel fields or tiles.
    """

    def __init__(self, target: Transformer, experts: DraftExperts, *, static: bool | None = None,
                 kernels: KernelTuning | None = None) -> None:
        spec = target.spec
        # The same tensors dict: every non-expert tensor is the target's own (storage-identical).
        self.model = transformer_for(spec)(spec, target.w, exact=False, row_bucket=target.bucket, max_context=target.max_context,
                                           kernels=kernels or target.kernels)
        self.experts = experts
        supported = static_step_supported(self.model)
        if static and not supported:
            raise ConfigError(f"the static draft step does not support model family '{spec.family}'; use static=None or False")
        self.static = (target.device.type == "cuda" and supported) if static is None else static
        self._graphed: GraphedStep | None = None

    @property
    def route_counts(self) -> Tensor:
        return self.experts.route_counts

    async def propose(self, x0: Tensor, start: int, k: int, kv: KVCache, params: SamplingParams,
                      after_step: Callable[[int], Awaitable[None]] | None = None,
                      keep_logits: bool = False, prefix: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Draft tokens d1..dk [k] (device) from x0 [1] at position `start`, and their logits [k, V] if kept.

        after_step(steps_done) runs after each step (the engine plans and prefetches there).
        prefix [c] (device, c <= k): d1..dc already proposed by `extend` during the last verify; their KV and
        routes are in place (the counters are not reset), drafting resumes at step c + 1 and after_step(c)
        runs once before it. Not with keep_logits (their logits were not kept).
        """
        done = 0 if prefix is None else prefix.shape[0]
        assert done <= k and not (done and keep_logits), f"a prefix of {done} for k = {k} (logits kept: {keep_logits})"
        if not done:
            self.route_counts.zero_()
        elif after_step is not None:
            await after_step(done)
        if self.static:
            return await self._propose_static(x0, start, k, kv, params, after_step, keep_logits, prefix)
        token = x0 if prefix is None else prefix[-1:]
        drafted, kept = ([] if prefix is None else [prefix]), []
        for step in range(done, k):
            logits, token = await self._eager_step(token, start + step, kv, params)
            drafted.append(token)
            if keep_logits:
                kept.append(logits)
            if after_step is not None:
                await after_step(step + 1)
        return _joined(drafted, x0), (torch.cat(kept) if keep_logits else None)

    async def _propose_static(self, x0: Tensor, start: int, k: int, kv: KVCache, params: SamplingParams,
                              after_step: Callable[[int], Awaitable[None]] | None, keep_logits: bool,
                              prefix: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The same proposal as k one-row static steps (graph replays on CUDA); the token never leaves the device."""
        step = self._static_step(kv)
        done = 0 if prefix is None else prefix.shape[0]
        drafted, kept = ([] if prefix is None else [prefix]), []
        if done < k:
            step.load(x0 if prefix is None else prefix[-1:], start + done)
        for steps_done in range(done + 1, k + 1):
            logits, token = step.run(params)  # static outputs: [1, V], [1] sampled for position start + steps_done
            drafted.append(token.clone())
            if keep_logits:
                kept.append(logits.clone())
            if steps_done < k:
                step.advance(token)
            if after_step is not None:
                await after_step(steps_done)
        return _joined(drafted, x0), (torch.cat(kept) if keep_logits else None)

    async def extend(self, token: Tensor, position: int, out: Tensor, counts_out: Tensor, kv: KVCache, params: SamplingParams,
                     stream: Any = None, after: Any = None, backend: Any = None) -> Any:
        """Draft out.shape[0] steps from `token` [1] at `position`, writing the proposals for position + 1.. into
        `out` (device) and the KV of positions position.. (scratch beyond the verify's block), with fresh route
        counters; counts_out[i] gets the counters after step i + 1, so a round that takes over only the first
        c steps can restore the routes of exactly those. This is the draft-ahead of DraftConfig.overlap, run
        beside a verify.

        On CUDA (the static step) every step is enqueued at once on `stream`, after the event `after`; the
        call returns the event that marks their end (the caller makes its stream wait on it). Without a stream
        the steps run here (the eager draft yields at its await points, so a verify beside it goes on) and the
        call returns None.
        """
        steps = out.shape[0]
        if self.static:
            step = self._static_step(kv)
            if stream is not None:
                backend.stream_wait(stream, after)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                # no await inside: a stream context must not leak into the verify's task
                self.route_counts.zero_()
                step.load(token, position)
                for index in range(steps):
                    _logits, sampled = step.run(params)
                    out[index : index + 1].copy_(sampled)
                    counts_out[index].copy_(self.route_counts)
                    if index + 1 < steps:
                        step.advance(sampled)
            return backend.record_event(stream) if stream is not None else None
        self.route_counts.zero_()
        for index in range(steps):
            _logits, token = await self._eager_step(token, position + index, kv, params)
            out[index : index + 1].copy_(token)
            counts_out[index].copy_(self.route_counts)
        return None

    async def _eager_step(self, token: Tensor, position: int, kv: KVCache, params: SamplingParams) -> tuple[Tensor, Tensor]:
        """One eager draft step: `token` [1] at `position` -> logits [1, V] and the token sampled for position + 1
        ([1] on the device: no sync between steps)."""
        logits = self.model.logits(await self.model.forward(token, position, kv, self.experts))
        return logits, sample(logits, torch.full((1,), position + 1, dtype=torch.long, device=logits.device), params)

    def capture(self, kv: KVCache, params: SamplingParams | None = None) -> None:
        """Capture the graphed step for `kv` now (start-up, while the KV is empty), so decoding allocates nothing."""
        if self.static:
            self._static_step(kv).prepare(params)

    def _static_step(self, kv: KVCache) -> GraphedStep:
        """One graphed one-row step per KV cache (its graphs bake in the cache's storage)."""
        if self._graphed is None or self._graphed.kv is not kv:
            step = StaticStep(self.model, self.experts, rows=1)
            self._graphed = GraphedStep(step, kv, preserve=(self.experts.route_counts,))
        return self._graphed


def _joined(drafted: list[Tensor], like: Tensor) -> Tensor:
    """The proposals [k] as one new device tensor (empty for k = 0); never a view of a prefix buffer."""
    if not drafted:
        return torch.empty(0, dtype=torch.long, device=like.device)
    return torch.cat(drafted)
