"""What a placement weighs, measured once when the engine loads (`Calibration`): one routed expert's seconds on the
host at `row_bucket` rows, the link's bytes per second, and the per-layer expert use of a routing profile.

Cheap on purpose: a warm-up and three timed runs of one expert on a host thread set up as the host expert path's, and
on CUDA a warm-up and three pinned copies of at most 64 MiB of one expert (at a Mixtral shape about 4 x 5 ms of host
compute, issue 29's figure, and 4 x 3 ms of copies at 25 GB/s: not yet timed on the H200). Skipped entirely for
`off` (the builder asks for it only with a placement plug-in).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from specter.errors import ConfigError
from specter.experts.host import ExpertFunction, host_thread
from specter.experts.pool import ExpertPool
from specter.kernel import Kernel
from specter.log import get_logger
from specter.placement import PlacementState
from specter.trace import read_trace, use_counts

log = get_logger(__name__)
Tensor = torch.Tensor
REPEATS = 3
LINK_PROBE_BYTES = 64 << 20
"""The link is timed on at most this many bytes of one expert: past the copy's ramp (a few MiB on PCIe), and small
enough to borrow as scratch beside a full memory plan."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The costs the builder measured for the placement policy (None or empty: not measured here)."""

    host_expert_s: Mapping[int, float]
    """Seconds of one expert on the host by row count (the engine measures `row_bucket` rows: one block)."""
    link_bytes_per_s: float | None
    """Measured pinned H2D bandwidth (CUDA); None on the CPU."""
    route_counts: list[list[float]] | None
    """Per layer and expert, the rounds of the profile whose verify used it (None: no profile)."""

    def apply(self, state: PlacementState) -> PlacementState:
        """`state` with these costs. An emulated link or one the transfer engine has measured already (the state's own
        figure) wins over the load-time probe: it is the link the copies will see."""
        return dataclasses.replace(state, host_expert_s=dict(self.host_expert_s),
                                   link_bytes_per_s=state.link_bytes_per_s or self.link_bytes_per_s,
                                   route_counts=self.route_counts)


async def calibrate(kernel: Kernel, pool: ExpertPool, mlp: ExpertFunction | None, state: PlacementState, hidden_size: int,
                    device: torch.device, profile: Path | None = None) -> Calibration:
    """Every cost a placement policy reads that `state` lacks, measured now (the pool written, before the first
    request): the host at `state.row_bucket` rows with `state.host_threads` threads (unless there is no `mlp`), the
    link unless the state has its figure (an emulated link), the profile's use counts."""
    started = time.perf_counter()
    rows = state.row_bucket
    expert = pool.host(0, 0)  # MoE layer 0's expert 0: every expert of a layer has the same shape
    host = {} if mlp is None else {rows: await time_host_block(kernel, expert, mlp, hidden_size, rows, state.host_threads, device)}
    link = time_link(expert, device) if state.link_bytes_per_s is None else None
    counts = route_profile(profile, state.num_layers, state.num_experts) if profile is not None else None
    log.info("placement.calibrated", host_expert_ms=round(host[rows] * 1e3, 3) if host else None,
             link_gbps=round((state.link_bytes_per_s or link or 0) / 1e9, 2) or None, profile=str(profile) if profile else None,
             seconds=round(time.perf_counter() - started, 3))
    return Calibration(host, link, counts)


def median_seconds(work: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall seconds of `work` over `repeats` runs after one warm-up run (on the calling thread)."""
    work()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def time_link(source: Tensor, device: torch.device, repeats: int = REPEATS) -> float | None:
    """Bytes per second of a pinned host-to-device copy of (at most `LINK_PROBE_BYTES` of) `source`, one expert's
    pinned bytes; None off CUDA."""
    if device.type != "cuda":
        return None
    source = source.view(torch.uint8)[:LINK_PROBE_BYTES]
    scratch = torch.empty(source.numel(), dtype=torch.uint8, device=device)

    def copy() -> None:
        scratch.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)  # await point (load time only): the copy's end

    torch.cuda.synchronize(device)
    seconds = median_seconds(copy, repeats)
    del scratch
    return source.numel() / seconds if seconds > 0 else None


async def time_host_block(kernel: Kernel, packed: Tensor, mlp: ExpertFunction, hidden_size: int, rows: int, threads: int,
                          device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds of expert `packed` on `rows` rows, on a host thread with `threads` torch threads (the host
    expert path's set-up), after one warm-up run."""
    block = (torch.randn(rows, hidden_size) * 0.1).to(packed.dtype)
    thread = host_thread(device, threads, name="specter-host-calibration")
    try:
        return await kernel.wait_host(kernel.submit_host(thread, lambda: median_seconds(lambda: mlp(block, packed), repeats)))
    finally:
        thread.stop()


def route_profile(path: Path, num_layers: int, num_experts: int) -> list[list[float]] | None:
    """Per MoE layer and expert, how many rounds of the routing trace at `path` used it (its verify's `used`): the
    relative use the cost model scales to top_k per token. A trace of another shape is refused."""
    header, rounds = read_trace(path)
    if (header.num_layers, header.num_experts) != (num_layers, num_experts):
        raise ConfigError(f"placement_profile {path}: a trace of {header.num_layers} MoE layers x {header.num_experts} "
                          f"experts ({header.model}) for a model of {num_layers} x {num_experts}; record one of this "
                          "model with `specter generate --trace PATH`")
    if not rounds:
        log.warning("placement.empty_profile", path=str(path), hint="the trace has no rounds: routing assumed uniform")
        return None
    return use_counts(rounds, num_layers, num_experts)


def reference_expert(hidden_size: int, intermediate: int) -> ExpertFunction:
    """The families' routed expert (Transformer.expert_mlp: SwiGLU over the packed [gate; up] and down) on one block,
    for timing without a model at hand (`specter info`; benchmarks/host_expert.py has the same)."""
    from specter.model.weights import unpack_expert

    def mlp(rows: Tensor, packed: Tensor) -> Tensor:
        w13, w2 = unpack_expert(packed, hidden_size, intermediate)
        gate_up = torch.nn.functional.linear(rows, w13)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:], w2)

    return mlp

