"""The verify pass's expert provider: routed experts from the device cache, hot first, misses overlapped.

At each MoE layer it awaits the target router's choice (one small D2H copy), computes the experts that
are already resident, and loads the misses on demand through the cache's rolling window of slots, so a
miss's copy overlaps the compute of the hits. Experts the placement puts on the host path are computed by the
host CPU meanwhile (`specter.experts.host`: their rows go down with the routing's copy, their outputs come back
before the sum). Outputs are summed in expert-id order (exact mode).
Two forwards use it: the eager exact forward (`OffloadedExperts.run`) and the segmented static step
(`verify_segmented`), whose numerics are the resident GraphedTarget's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence

import torch

from backends.base import Event
from specter.config import VerifyTuning
from specter.experts.cache import ExpertCache
from specter.experts.host import HostExperts, HostInputs, host_routes
from specter.kernel import HostJob, Kernel
from specter.log import get_logger
from specter.model.segmented import SegmentedStep
from specter.model.transformer import ExpertMLP, RoutingTable, combine_in_expert_order
from specter.placement import preloaded

log = get_logger(__name__)
Tensor = torch.Tensor


async def to_host(kernel: Kernel, tensor: Tensor, *, poll_s: float = 0.0) -> list:
    """Await point: a small device tensor copied to the host without blocking the event loop."""
    return await host_values(kernel, copy_to_host(kernel, tensor), poll_s=poll_s)


def copy_to_host(kernel: Kernel, tensor: Tensor) -> Tensor | tuple[tuple, Tensor, Event]:
    """Enqueue `to_host`'s copy on the compute stream now (a CPU tensor is returned as it is); `host_values` awaits
    it. Between the two the caller may enqueue more work: the copy does not wait for it."""
    if tensor.device.type == "cpu":
        return tensor
    backend = kernel.backend
    assert backend is not None, "a CUDA tensor needs a kernel bound to a backend"
    key = (tuple(tensor.shape), tensor.dtype)
    free = _PINNED_FREE.setdefault(key, [])
    if _PINNED_ABANDONED:
        _recycle_abandoned()
    host = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return key, host, backend.copy_d2h(host, tensor, backend.compute_stream)


async def host_values(kernel: Kernel, pending: Tensor | tuple[tuple, Tensor, Event], *, poll_s: float = 0.0) -> list:
    """The values of a `copy_to_host`, once its copy has landed."""
    if isinstance(pending, Tensor):
        return pending.tolist()
    key, host, event = pending
    try:
        await kernel.wait(event, spin_s=50e-6, poll_s=poll_s)
    except BaseException:  # cancelled: the copy may still be writing into the buffer; reuse it only once it landed
        abandon(pending)
        raise
    values = host.tolist()
    _PINNED_FREE.setdefault(key, []).append(host)
    return values


async def routing_values(kernel: Kernel, pending: Tensor | tuple[tuple, Tensor, Event], record: VerifyRecord,
                         poll_s: float) -> list:
    """A MoE layer's router ids from their `copy_to_host`, the await timed into `record.routing_wait_s`."""
    asked = time.perf_counter()
    chosen = await host_values(kernel, pending, poll_s=poll_s)
    record.routing_wait_s += time.perf_counter() - asked
    return chosen


def abandon(pending: Tensor | tuple[tuple, Tensor, Event]) -> None:
    """A `copy_to_host` whose values are not wanted: its buffer is reused once the copy has landed."""
    if not isinstance(pending, Tensor):
        _PINNED_ABANDONED.append(pending)


_PINNED_FREE: dict[tuple, list[Tensor]] = {}
"""Pinned host buffers for `to_host`, by (shape, dtype), reused: a fresh pinned tensor per call costs the caching
host allocator's bookkeeping and an event on its free (the verify reads its router's ids once per MoE layer).
A buffer is out of the list while a call uses it, so concurrent calls never share one."""
_PINNED_ABANDONED: list[tuple[tuple, Tensor, Event]] = []
"""Buffers of cancelled `to_host` calls with their copies' events: kept alive until the copy landed (a raw copy
is unknown to torch's host allocator), then back to `_PINNED_FREE`."""


def _recycle_abandoned() -> None:
    keep = []
    for key, host, event in _PINNED_ABANDONED:
        if event.query():
            _PINNED_FREE.setdefault(key, []).append(host)
        else:
            keep.append((key, host, event))
    _PINNED_ABANDONED[:] = keep


@dataclasses.dataclass
class VerifyRecord:
    """What one forward's MoE layers used: layer -> experts in the order they were computed, and stall."""

    used: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    first_row: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> experts the first verified row chose
    hits: int = 0  # resident, or its prefetch already issued, when the router chose it (waits show in stall_s)
    misses: int = 0  # loaded on demand
    host_used: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # layer -> host-path experts computed
    host_computed: int = 0  # host-path expert computations, one per (layer, expert) per forward (a chunk each)
    host_s: float = 0.0  # host seconds those computations took (on the host thread)
    host_hidden_s: float = 0.0
    """Of host_s, the seconds that ran beside the device path: per layer with host work, the host job's seconds less
    the time the forward then waited for it after its device path was done (`finish_host`). host_s when the host
    always finished first, 0 when the two paths ran one after the other. The device path's end is where the loop had
    launched its last expert: after its last landing with a host-paced emulated link and on the CPU, where the loop
    waits for each copy itself; after its last copy was issued when misses are ordered on the device (CUDA without
    emulation: the device may still be copying and computing then, so this counts too much)."""
    stall_s: float = 0.0
    routing_wait_s: float = 0.0
    """Seconds the verify awaited each MoE layer's routing read: the device's work up to the router that the host had
    not overlapped yet, the ids' copy and the wake-up. With speculation off, the part of a token where the host waits
    for the device layer by layer. The verify task's time to resume, so it also holds what the loop ran meanwhile
    (deferred bookkeeping, with k > 0 the draft-ahead)."""
    host_wait_s: float = 0.0
    """Seconds the verify awaited host jobs once their layer's device path was launched (`finish_host`): the host
    path's time that the device path did not cover, and the job's hand-offs (the same caveat as routing_wait_s)."""
    device_waits: list[tuple[Event, Event]] = dataclasses.field(default_factory=list)
    """Timed (before, after) events around each device-side wait of the compute stream for a copy: the stall
    of a verify whose misses are ordered on the device (`settle` adds them to stall_s)."""

    def settle(self) -> None:
        """Add the device-side waits to stall_s. Call once the forward's output has been awaited (every event
        has completed then); a pair not completed yet stays for a later call.

        Every mark is recorded on the compute stream in order (compute_hot_first), so when the last one has
        completed all have: one query then, instead of two per pair (each a CUDA call at a round's end, where
        the GPU waits for the host)."""
        if self.device_waits and self.device_waits[-1][1].query():
            self.stall_s += sum(max(0.0, after.elapsed_since(before)) for before, after in self.device_waits)
            self.device_waits = []
            return
        pending = []
        for before, after in self.device_waits:
            if before.query() and after.query():
                self.stall_s += max(0.0, after.elapsed_since(before))
            else:
                pending.append((before, after))
        self.device_waits = pending


ComputeExpert = Callable[[int, Tensor], None]
"""compute(expert, packed_weights): launch one expert's compute reading the slot's weights."""
RoutedHook = Callable[[int, Tensor, list[int]], None]


async def compute_hot_first(cache: ExpertCache, kernel: Kernel, cache_layer: int, needed: Sequence[int],
                            compute: ComputeExpert, record: VerifyRecord, *, counted: Sequence[int] = (),
                            on_device: bool = False, started: Collection[int] = ()) -> list[int]:
    """Run `compute` for each needed expert as it becomes ready (resident first, then as copies land).

    Each expert's slot is marked used with an event recorded after its compute, so the slot is not
    overwritten before the compute read it. Adds hits, misses and stall to `record` (experts in `counted`
    were already counted by an earlier chunk of the same forward) and returns the experts in compute order.

    on_device: `compute` runs on the backend's compute stream (CUDA), so a miss is computed as soon as its
    copy is issued, behind a device-side wait for it (`ExpertCache.iter_issued`): no host wake-up per miss,
    and the stall is measured on the device (`VerifyRecord.settle`). Ignored while a host-paced link
    emulation holds copies back on the host (the device would not see that delay).
    """
    hot = {e for e in needed if cache.lookup(cache_layer, e) is not None}
    mapped = set(cache.lru_order(cache_layer))  # resident or with a (prefetch) copy already in flight
    backend = kernel.backend
    order: list[int] = []
    if on_device and not cache.transfer.host_paced:
        stream = backend.compute_stream
        async with contextlib.aclosing(cache.iter_issued(cache_layer, needed)) as experts:
            used, used_timed = None, False  # the last expert's use mark: where the stream is when the host asks for the next
            while True:
                # The wait for a miss is timed from there: if the host has to wait (for a landing to free a slot),
                # the compute stream runs dry meanwhile, and that idle time is part of the stall. One event is both
                # the slot's last use and that mark (nothing is enqueued on this stream in between). The resident
                # experts come first and never wait: their marks are untimed, except the last one's.
                try:
                    expert, slot, ready = await anext(experts)
                except StopAsyncIteration:
                    break
                if ready is not None:
                    before = used if used_timed else backend.record_event(stream, timed=True)
                    backend.stream_wait(stream, ready)
                    record.device_waits.append((before, backend.record_event(stream, timed=True)))
                compute(expert, cache.slot_weights(slot))
                order.append(expert)
                used_timed = len(order) >= len(hot)
                used = backend.record_event(stream, timed=used_timed)
                cache.mark_used(cache_layer, expert, used)
    else:
        waited = time.perf_counter()
        async for expert, slot in cache.iter_ready(cache_layer, needed):
            if expert not in hot:
                record.stall_s += time.perf_counter() - waited
            compute(expert, cache.slot_weights(slot))
            cache.mark_used(cache_layer, expert, backend.record_event(backend.compute_stream))
            order.append(expert)
            waited = time.perf_counter()
    already = set(counted)
    new = [e for e in needed if e not in already]
    prefetched = sum(1 for e in new if e in mapped and e not in started)
    record.hits += prefetched
    record.misses += len(new) - prefetched
    return order


def host_inputs(host: HostExperts | None, kernel: Kernel, cache_layer: int, hidden: Tensor, weights: Tensor,
                pending: Tensor | tuple[tuple, Tensor, Event]) -> HostInputs | None:
    """The layer's rows and routing weights on their way to the host (enqueued behind the routing's copy `pending`),
    when the placement puts any of the layer's experts on the host path; None otherwise (and nothing enqueued)."""
    if host is None or not host.placement.host_experts(cache_layer):
        return None
    try:
        return host.copy_inputs(kernel, hidden, weights)
    except BaseException:
        abandon(pending)
        raise


def start_host(host: HostExperts | None, kernel: Kernel, cache_layer: int, chosen: Sequence[Sequence[int]],
               experts: Sequence[int], inputs: HostInputs | None, *, dense: bool) -> HostJob | None:
    """Queue the host-path experts among `experts` (the routing's choice) on the host thread; None when there are none."""
    if inputs is None:
        return None
    hosted = [e for e in experts if host.placement.is_host(cache_layer, e)]
    if not hosted:
        return None
    return host.start(kernel, cache_layer, host_routes(chosen, hosted), inputs, dense=dense)


async def finish_host(kernel: Kernel, job: HostJob | None, layer: int, record: VerifyRecord,
                      device_done: float) -> dict[int, Tensor]:
    """The host-path experts' outputs (expert -> host tensor), counted into `record`; {} without a job. Await it only
    once the layer's device path is launched (`device_done`, its perf_counter time: for `VerifyRecord.host_hidden_s`),
    so that the host computes while the device computes and the link copies."""
    if job is None:
        return {}
    outputs = await kernel.wait_host(job)
    waited = time.perf_counter() - device_done
    record.host_wait_s += waited
    record.host_used[layer] = record.host_used.get(layer, []) + sorted(outputs)
    record.host_computed += len(outputs)
    record.host_s += job.seconds
    record.host_hidden_s += max(0.0, job.seconds - waited)
    return outputs


class OffloadedExperts:
    """ExpertProvider over an ExpertCache; `layer_index` maps model layers to the cache's compact MoE layers."""

    def __init__(self, cache: ExpertCache, kernel: Kernel, layer_index: dict[int, int],
                 on_routed: RoutedHook | None = None, on_device: bool | None = None,
                 tuning: VerifyTuning | None = None, host: HostExperts | None = None) -> None:
        self.cache = cache
        self.host = host if host is not None and host.placement.active else None
        """The host expert path, when the placement puts any expert on it (None: every expert from the cache)."""
        self.tuning = tuning or VerifyTuning()  # EngineConfig.tuning.verify; read at run time
        self.kernel = kernel
        self.layer_index = layer_index
        self.on_routed = on_routed  # e.g. gate-prefetch: sees each layer's hidden rows and chosen experts
        self.record = VerifyRecord()
        self.predicted: Mapping[int, Sequence[int]] | None = None
        """Cache layer -> experts the coming verify will likely need, likeliest first (the engine sets it from the
        round's prefetch plan; None: no prediction), for the lead (`VerifyTuning.lead_misses`)."""
        # Misses ordered on the device (compute_hot_first's on_device): on CUDA, where the forward's compute
        # runs on the backend's compute stream; elsewhere the host computes and must see each landing.
        backend = kernel.backend
        self.on_device = (backend is not None and backend.name == "cuda") if on_device is None else on_device

    def start_record(self) -> VerifyRecord:
        self.record = VerifyRecord()
        return self.record

    async def run(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor, mlp: ExpertMLP) -> Tensor:
        cache_layer = self.layer_index[layer]
        poll_s = self.tuning.routing_poll_s if self.on_device else 0.0
        pending = copy_to_host(self.kernel, ids)  # the router's choice
        inputs = host_inputs(self.host, self.kernel, cache_layer, x, weights, pending)  # behind it, when the layer has any
        chosen = await routing_values(self.kernel, pending, self.record, poll_s)  # await point: the router's choice
        table = RoutingTable(chosen, x.device)
        self.record.first_row.setdefault(layer, len(set(chosen[0])))
        if self.on_routed is not None:
            self.on_routed(layer, x, table.experts)
        needed = self.cache.device_path(cache_layer, table.experts)
        parts: dict[int, tuple[Tensor, Tensor]] = {}

        def compute(expert: int, packed: Tensor) -> None:
            parts[expert] = table.weighted_output(expert, x, weights, mlp, packed)

        job = start_host(self.host, self.kernel, cache_layer, chosen, table.experts, inputs, dense=False)
        try:  # the host computes its experts while the device computes (and loads) the others
            order = await compute_hot_first(self.cache, self.kernel, cache_layer, needed, compute, self.record,
                                            on_device=self.on_device)
            hosted = await finish_host(self.kernel, job, layer, self.record, time.perf_counter())  # the host's outputs
        except BaseException:
            if job is not None:
                job.cancel()
            raise
        for expert, values in hosted.items():  # back to the device (non-blocking from pinned memory on CUDA)
            parts[expert] = (table.rows(expert)[0], values.to(x.device, non_blocking=True))
        self.record.used[layer] = order
        return combine_in_expert_order(x.shape[0], x.shape[1], parts, x)

    @contextlib.asynccontextmanager
    async def prompt_placement(self, rows: int) -> AsyncIterator[None]:
        """Run a prompt's forward of `rows` rows inside: under the placement policy's prompt placement (its decode host
        experts that a long prompt copies instead), then decoding's placement again, with those experts out of the
        cache and the layer's preloaded residents they evicted prefetched back (not awaited). A prompt's forward is
        the same in a speculative and a k = 0 run, and its placement a function of `rows` and the calibration, so the
        contract holds (docs/ARCHITECTURE.md). Without a prompt placement: nothing changes."""
        host = self.host
        if host is None or host.prompt is None:
            yield
            return
        await self.cache.drop_host_path()  # what a cancelled prompt may have left
        decode, prompt = host.decode, host.prompt(rows)
        if prompt == decode:
            yield
            return
        host.placement = prompt
        self.cache.place(prompt.host)
        try:
            yield
        finally:
            host.placement = decode
            self.cache.place(decode.host)
        dropped = await self.cache.drop_host_path(preloaded(decode, self.cache.layer_slots))
        log.debug("prompt.placed", rows=rows, host_experts=prompt.total, decode_host_experts=decode.total, dropped=dropped)

    def close(self) -> None:
        """Stop the host expert path's thread (the runtime's close)."""
        if self.host is not None:
            self.host.close()

    async def verify_static(self, step: SegmentedStep, block_tokens: Tensor, start: int) -> Tensor:
        """The verify forward through the segmented static step (see `verify_segmented`), into this record."""
        return await verify_segmented(step, block_tokens, start, self.cache, self.kernel, self.layer_index, self.record,
                                      on_routed=self.on_routed, on_device=self.on_device, predicted=self.predicted,
                                      tuning=self.tuning, host=self.host)


async def verify_segmented(step: SegmentedStep, block_tokens: Tensor, start: int, cache: ExpertCache, kernel: Kernel,
                           layer_index: dict[int, int], record: VerifyRecord, *, on_routed: RoutedHook | None = None,
                           on_device: bool = False, predicted: Mapping[int, Sequence[int]] | None = None,
                           tuning: VerifyTuning | None = None, host: HostExperts | None = None) -> Tensor:
    """Float32 logits [n, V] of n device tokens at positions start.., in R-row chunks, writing their KV.

    Per MoE layer: the pre-MoE segment (a graph replay on CUDA), one D2H copy of the router ids, the
    routed experts hot first from the cache, their sum in expert-id order, then the next segment. The
    logits are bit-identical to the resident GraphedTarget's with the same R and MoE kernel. `predicted` (cache
    layer -> likely experts; used when the block fits in one chunk) lets the verify compute each layer's predicted residents and start its predicted
    misses while the routing is on its way to the host (`tuning.lead_misses`): an expert's staged output is the
    same whether or not a row chose it. `tuning.routing_poll_s`: how long each routing read polls on CUDA. `host`: the
    host expert path, which computes the placement's host-path experts beside the cache's and stages their outputs.
    """
    tuning = tuning or VerifyTuning()
    assert block_tokens.shape[0] >= 1, "nothing to verify: pass at least one token"
    if step.backend is None:  # a step built by hand (tests); the builder's has the cache's backend already
        step.backend = cache.backend
    assert step.backend is cache.backend, "the segmented step writes through another backend than its cache's"
    parts = []
    # A verify of more rows than the step's runs in chunks; the prediction covers the whole block, so a lead in one
    # chunk would compute (and may evict) experts only a later chunk's rows choose: none then.
    lead = predicted if block_tokens.shape[0] <= step.rows else None
    for first in range(0, block_tokens.shape[0], step.rows):
        count = step.load(block_tokens[first : first + step.rows], start + first)
        for index, layer in enumerate(step.moe_layers):
            step.run_segment(index)
            likely = lead.get(layer_index[layer]) if lead else None
            await _routed_experts(step, layer, count, cache, kernel, layer_index[layer], record, on_routed, on_device,
                                  tuning, likely, host)
        step.run_segment(len(step.moe_layers))
        parts.append(step.logits[:count].clone())  # the static output is overwritten by the next chunk
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _lead(cache: ExpertCache, kernel: Kernel, cache_layer: int, likely: Sequence[int], compute: ComputeExpert,
          misses: int) -> tuple[list[int], list[int]]:
    """`ExpertCache.lead` for a layer whose segment is enqueued: the experts computed early and the loads started."""
    if misses <= 0:
        return [], []
    backend = kernel.backend

    def launch(expert: int, slot: int) -> Event:
        compute(expert, cache.slot_weights(slot))
        return backend.record_event(backend.compute_stream)

    return cache.lead(cache_layer, likely, misses, launch)


async def _routed_experts(step: SegmentedStep, layer: int, count: int, cache: ExpertCache, kernel: Kernel, cache_layer: int,
                          record: VerifyRecord, on_routed: RoutedHook | None, on_device: bool, tuning: VerifyTuning,
                          likely: Sequence[int] | None = None, host: HostExperts | None = None) -> None:
    """One MoE layer's routed experts for the step's current chunk of `count` real rows, into step.routed. `likely`:
    the experts the round's plan predicts, for `_lead` while the router's choice is on its way to the host. Host-path
    experts run on `host` beside the cache's, on every row of the step that chose them (padding rows repeat the last
    real row, so they stay equal to it), and are staged before the next segment sums."""
    def compute(expert: int, packed: Tensor) -> None:
        step.expert_output(expert, packed)  # staged by expert id; the next segment sums them

    pending = copy_to_host(kernel, step.ids)  # the router's choice, [R, A] in one D2H copy, ahead of the lead's compute
    inputs = host_inputs(host, kernel, cache_layer, step.normed, step.weights, pending)  # behind it, when the layer has any
    try:
        computed, started = _lead(cache, kernel, cache_layer, likely, compute, tuning.lead_misses) if likely else ([], [])
    except BaseException:
        abandon(pending)
        raise
    chosen = await routing_values(kernel, pending, record, tuning.routing_poll_s if on_device else 0.0)  # await point
    routed = sorted({expert for row in chosen[:count] for expert in row})  # padding rows repeat the last real row
    needed = cache.device_path(cache_layer, routed)
    record.first_row.setdefault(layer, len(set(chosen[0])))
    if on_routed is not None:
        on_routed(layer, step.normed[:count], routed)
    counted = record.used.get(layer, [])
    early = [e for e in computed if e in needed]  # resident when chosen: hits, computed before the routing was read
    rest = [e for e in needed if e not in computed]
    job = start_host(host, kernel, cache_layer, chosen, routed, inputs, dense=True)
    try:  # the host computes its experts while the device computes (and loads) the others
        order = await compute_hot_first(cache, kernel, cache_layer, rest, compute, record, counted=counted, on_device=on_device,
                                        started=started)
        hosted = await finish_host(kernel, job, layer, record, time.perf_counter())  # await point: the host's outputs
    except BaseException:
        if job is not None:
            job.cancel()
        raise
    for expert, output in hosted.items():
        step.stage_output(expert, output)
    record.hits += sum(1 for e in early if e not in counted)
    record.used[layer] = counted + [e for e in early + order if e not in counted]
