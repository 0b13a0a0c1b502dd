"""The host expert path: routed experts the placement puts on the host, computed by the CPU from the pool's pinned
bytes (never copied to the device), on one dedicated thread the event loop awaits as it awaits a GPU event (and,
with `tuning.host.parallel_experts`, on one-thread workers that thread hands a layer's experts to).

Shape legend: T rows of the forward (R for the segmented step), D hidden, A active experts per row, n rows that
chose one expert, B the row bucket.
"""

# What holds here (tests/test_host_experts.py checks each):
#  1. One expert's output on a row does not depend on the other rows: the expert runs on blocks of exactly B rows
#     (zero padding), as the exact device path does, with a thread count fixed when the engine loads.
#  2. The output has the device path's form: `mlp(rows) * weight` per routed row, in the pool's dtype, for the
#     caller to sum in expert-id order with the device path's outputs.
#  3. Every job runs on one thread, `specter-host-experts`, in submission order, with its own torch intra-op thread
#     count (`EngineConfig.cpu_threads`, by default the cores less one: `default_threads`): under torch's OpenMP backend the count is per calling thread, so the loop
#     thread keeps `EngineConfig.threads` (1 on CUDA). Under another backend it would be process-wide: then the host
#     path keeps the loop thread's count and says so in a warning.
#     With `parallel` (EngineConfig.tuning.host.parallel_experts) that thread only hands a layer's experts out, each to
#     one of `threads` workers with one torch thread, and gathers them in expert-id order: a one-thread expert's bits
#     do not depend on what runs beside it, so neither on the round nor on the other experts.
#  4. Inputs come down and outputs go back through torch's pinned host allocator (CUDA): it keeps a buffer until the
#     copies that read or write it have completed, so a job cancelled or dropped at any point frees nothing early.

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.nn.functional as F

from backends.base import Event
from specter.errors import ConfigError
from specter.experts.pool import ExpertPool
from specter.kernel import HostJob, HostThread, Kernel
from specter.log import get_logger
from specter.placement import Placement

log = get_logger(__name__)
Tensor = torch.Tensor
ExpertFunction = Callable[[Tensor, Tensor], Tensor]
"""mlp(rows [B, D], packed expert) -> [B, D]: the family's routed expert as the host computes it, on one block
(Transformer.expert_mlp) or on the rows as they are (a row-invariant kernel, specter.experts.native)."""
JobFunction = Callable[..., None]
"""(hidden [T, D], weights [T, A], rows, slots, counts, addresses, out, dense) -> None: a row-invariant kernel's whole
layer job in one call (specter.experts.native.native_layer_job): expert j (its packed weights at host address
`addresses[j]`) on `counts[j]` of the rows, their indices and top-A slots listed expert after expert, each output row
as `ExpertFunction` gives it times its routing weight as `HostExperts.compute` weights it, written to `out`
([sum counts, D], or with `dense` [experts x T, D], each expert's rows in place in its block, the others zero)."""
HOST_PATH_VERSION = 4
"""Bumped when a host job's own work changes what it costs, or what the stored figures mean: the calibration's stored
figures (`costs.cost_key`) of an earlier version are measured anew. The figure per expert is what one more expert adds
to a job, beside the job's fixed part."""
Routes = Mapping[int, tuple[list[int], list[int]]]
"""expert -> (rows that chose it, ascending; the top-A slot of each): which rows a host expert computes."""


def host_routes(chosen: Sequence[Sequence[int]], experts: Iterable[int]) -> dict[int, tuple[list[int], list[int]]]:
    """`Routes` of `experts` from the host copy of the router's ids [T, A] (rows ascending, as `RoutingTable`'s)."""
    wanted = set(experts)
    routes: dict[int, tuple[list[int], list[int]]] = {e: ([], []) for e in sorted(wanted)}
    for row, picks in enumerate(chosen):
        for slot, expert in enumerate(picks):
            if expert in wanted:
                routes[expert][0].append(row)
                routes[expert][1].append(slot)
    return routes


def default_threads(cores: int | None = None) -> int:
    """EngineConfig.cpu_threads=None: every core of the host but one (at least one thread), `cores` defaulting to
    os.cpu_count(). The core left is the event loop's: it issues the device's compute and the copies (and paces an
    emulated link) while the host path computes, and an OpenMP team on every core leaves it none, so either it waits
    for a time slice or it preempts one of the team's threads and the whole team waits at its barrier for that one.
    A reasoned default, not an A/B's: with a team on every core, a hybrid run's host and copy paths added up per
    layer instead of overlapping (tests/test_placement_auto.py fits such a run)."""
    cores = cores if cores is not None else os.cpu_count()
    return max(1, (cores or 1) - 1)


def per_thread_counts() -> bool:
    """Whether torch's intra-op thread count is a per-thread setting here (its OpenMP backend)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def own_thread_count(threads: int) -> None:
    """This thread's own torch thread count (OpenMP backend). Reading the count first pins this thread's own: a thread
    that has not used torch's threading yet takes the count last set by any thread at its first op."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def one_thread() -> None:
    """A host worker's setup: one torch thread."""
    own_thread_count(1)


def host_thread(device: torch.device, threads: int, name: str = "specter-host-experts") -> HostThread:
    """A thread set up as the host expert path's (the path's own, and the calibration's that times it at load)."""
    # The index is resolved here, on the caller's thread: `torch.device("cuda")` names no index (set_device refuses it),
    # and a new thread's current device is 0, not necessarily the engine's.
    index = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else None

    def setup() -> None:
        """On the new thread, once: its CUDA device (pinned allocations) and its own torch thread count."""
        if index is not None:
            torch.cuda.set_device(index)
        if per_thread_counts():
            own_thread_count(threads)
        else:
            log.warning("host.threads_shared", threads=torch.get_num_threads(), asked=threads,
                        hint="torch's parallel backend is not OpenMP: its thread count is process-wide, so host experts "
                             "run with the loop thread's")

    return HostThread(name, setup=setup)


@dataclasses.dataclass
class HostInputs:
    """One MoE layer's rows on the host for its host experts: hidden [T, D] and routing weights [T, A], landed when
    `ready` (None: already on the host) has completed."""

    hidden: Tensor
    weights: Tensor
    ready: Event | None = None


class HostExperts:
    """The host expert path of one engine: the placement, the pool it reads, the expert function it runs (the host
    kernel the calibration chose: the family's `expert_mlp`, or the native one with `row_invariant`), its thread and
    its block size."""

    def __init__(self, pool: ExpertPool, placement: Placement, row_bucket: int, mlp: ExpertFunction,
                 threads: int | None = None, device: torch.device | None = None,
                 prompt: Callable[[int], Placement] | None = None, parallel: bool = False,
                 row_invariant: bool = False, job: JobFunction | None = None) -> None:
        assert placement.num_layers == pool.num_layers and placement.num_experts == pool.num_experts, (
            f"a placement of {placement.num_layers} x {placement.num_experts} for a pool of {pool.num_layers} x {pool.num_experts}")
        self.pool, self.placement, self.row_bucket, self.mlp = pool, placement, row_bucket, mlp
        self.row_invariant = row_invariant
        """`mlp` computes each row on its own at any row count (the native kernel): it runs on the rows as they are,
        not on zero-padded blocks of `row_bucket` rows."""
        self.job = job if row_invariant and not parallel else None
        """The kernel's call for a layer's whole job (None: torch gathers and weights, one kernel call per expert). It
        starts the kernel's thread team once for all the experts instead of once per expert, which a small expert's
        time is mostly made of, and makes no torch call but the output's; each row keeps its bits (`JobFunction`).
        Not with `parallel`, whose workers run one expert each."""
        self.decode = placement
        """The engine's placement; `placement` differs from it only during a prompt that has its own."""
        self.prompt = prompt
        """rows -> the placement of a prompt of that many rows (the policy's `place_prefill`); None: `decode`."""
        self.threads = threads or default_threads()
        self.device = device or torch.device("cpu")
        self.pinned = self.device.type == "cuda"  # outputs go back with a non-blocking copy from pinned memory
        if parallel and not per_thread_counts():
            raise ConfigError("tuning.host.parallel_experts needs torch's OpenMP backend (a per-thread thread count): "
                              "under this one a worker's count of 1 would be the whole process's; leave it off")
        self.parallel = parallel
        # With `parallel`, the host thread hands a layer's experts to one-thread workers (invariant 3); its own count
        # is then 1 too, as it only gathers.
        self.thread = host_thread(self.device, 1 if parallel else self.threads) if placement.active else None
        self.workers = (ThreadPoolExecutor(self.threads, thread_name_prefix="specter-host-worker", initializer=one_thread)
                        if parallel and placement.active else None)
        """With `parallel`: the one-thread workers (threads start at the first submit). None once closed: a job that
        outlives `close` computes its experts on the host thread, one thread, the same bits."""

    # ---- one expert, on the calling thread --------------------------------------------------------------
    def compute(self, layer: int, expert: int, rows: Tensor, weights: Tensor) -> Tensor:
        """Expert `expert` of MoE layer `layer` on host rows [n, D], times their routing weights [n, 1]: [n, D]."""
        packed = self.pool.host(layer, expert)
        count, bucket = rows.shape[0], self.row_bucket
        rows = rows.to(self.pool.dtype)
        if self.row_invariant:
            return self.mlp(rows, packed) * weights.to(self.pool.dtype)
        padded = -(-count // bucket) * bucket
        if padded != count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        blocks = [self.mlp(rows[start : start + bucket], packed) for start in range(0, padded, bucket)]
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return out[:count] * weights.to(self.pool.dtype)

    def compute_layer(self, layer: int, routes: Routes, inputs: HostInputs, dense: bool = False) -> dict[int, Tensor]:
        """Every expert of `routes` on its rows, in ascending expert id: expert -> [n, D] in its rows' order, or with
        `dense` -> [T, D] with its rows in place (other rows zero). Waits for `inputs.ready` first (blocking)."""
        if inputs.ready is not None:
            inputs.ready.wait()
        hidden, weights = inputs.hidden, inputs.weights
        experts = sorted(routes)
        if self.job is not None and experts:
            return self._together(layer, experts, routes, hidden, weights, dense)
        outputs = {}
        indices = {expert: torch.tensor(routes[expert][0], dtype=torch.long) for expert in experts}

        def routed(expert: int) -> tuple[Tensor, Tensor]:
            """The rows that chose `expert` and their routing weights [n, 1]."""
            index, slots = indices[expert], torch.tensor(routes[expert][1], dtype=torch.long)
            return hidden[index], weights[index, slots][:, None]

        def one(expert: int) -> Tensor:
            return self.compute(layer, expert, *routed(expert))

        workers = self.workers
        if workers is not None and len(experts) > 1:
            futures = {expert: workers.submit(one, expert) for expert in experts}
            wait(futures.values())  # every one ends before the job does, failed or not: none outlives it
            computed = {expert: future.result() for expert, future in futures.items()}
        else:
            computed = {}
        for expert in experts:
            index = indices[expert]
            values = computed[expert] if expert in computed else one(expert)
            if dense:
                out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=values.dtype, pin_memory=self.pinned)
                out[index] = values
            else:
                out = values.pin_memory() if self.pinned else values
            outputs[expert] = out
        return outputs

    def _together(self, layer: int, experts: list[int], routes: Routes, hidden: Tensor, weights: Tensor,
                  dense: bool) -> dict[int, Tensor]:
        """`compute_layer` with the kernel's `job`: the layer's experts gathered, computed, weighted and placed in one
        call into one output buffer (pinned where the results go back to a device), whose views the experts' outputs
        are. Each row keeps the bits `compute` gives it: the kernel is row-invariant and weights as torch does."""
        total_rows, width = hidden.shape[0], hidden.shape[1]
        counts = [len(routes[expert][0]) for expert in experts]
        rows = [row for expert in experts for row in routes[expert][0]]
        slots = [slot for expert in experts for slot in routes[expert][1]]
        addresses = [self.pool.host_address(layer, expert) for expert in experts]
        out = torch.empty(len(experts) * total_rows if dense else len(rows), width, dtype=self.pool.dtype,
                          pin_memory=self.pinned)
        self.job(hidden, weights, rows, slots, counts, addresses, out, dense)
        if dense:  # expert j's rows in place in block j of [experts, T, D], the other rows zero
            return dict(zip(experts, out.view(len(experts), total_rows, width).unbind(0), strict=True))
        return dict(zip(experts, out.split(counts), strict=True))

    # ---- a layer's host experts, on the host thread ------------------------------------------------------
    def copy_inputs(self, kernel: Kernel, hidden: Tensor, weights: Tensor) -> HostInputs:
        """The layer's hidden rows and routing weights on the host. From a device: one D2H copy each into pinned
        memory, enqueued on the compute stream now (behind the router's ids' copy), no wait; from the CPU: as they are."""
        if hidden.device.type == "cpu":
            return HostInputs(hidden, weights)
        backend = kernel.backend
        host_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        host_weights = torch.empty(weights.shape, dtype=weights.dtype, pin_memory=True)
        with torch.cuda.stream(backend.compute_stream):  # torch's copies: its host allocator keeps the buffers until done
            host_hidden.copy_(hidden, non_blocking=True)
            host_weights.copy_(weights, non_blocking=True)
        return HostInputs(host_hidden, host_weights, backend.record_event(backend.compute_stream))

    def start(self, kernel: Kernel, layer: int, routes: Routes, inputs: HostInputs,
              dense: bool = False) -> HostJob[dict[int, Tensor]]:
        """Queue `compute_layer` on the host thread; `Kernel.wait_host` awaits it (cancel it if nobody will)."""
        assert self.thread is not None, "no expert takes the host path: nothing to start"
        return kernel.submit_host(self.thread, lambda: self.compute_layer(layer, routes, inputs, dense))

    @property
    def idle(self) -> bool:
        """No host work queued or running."""
        return self.thread is None or self.thread.idle

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        if self.workers is not None:
            # The host thread has finished its jobs (or is stuck past stop's timeout): nothing left to wait for here.
            self.workers.shutdown(wait=False, cancel_futures=True)
            self.workers = None
