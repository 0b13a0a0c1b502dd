"""What a placement weighs, measured once when the engine loads (`Calibration`): one routed expert's seconds on the
host path (one block of `row_bucket` rows), the link's bytes per second, and the per-layer expert use of a routing
profile.

Cheap on purpose: a warm-up and three timed layer jobs of the host path (top_k experts each), then as many of one
expert each (a job's fixed part: `split_job_cost`), on a host thread set up as the host expert path's, and on CUDA a warm-up and three pinned copies of at most 64 MiB of one expert (at a Mixtral
shape about 8 x 8 ms of host compute and 4 x 3 ms of copies at 25 GB/s). Skipped entirely for `off` (the builder asks
for it only with a placement plug-in).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from specter.errors import ConfigError
from specter.experts.host import HOST_PATH_VERSION, ExpertFunction, HostExperts, HostInputs, JobFunction, host_thread
from specter.experts.pool import ExpertPool
from specter.kernel import Kernel
from specter.log import get_logger
from specter.paths import json_value
from specter.placement import SEQUENCE_TOKENS, Placement, PlacementState, RouteSequence
from specter.trace import TraceHeader, TraceRound, read_trace, use_counts

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
    """Seconds of one expert on the host path by row count (the engine measures one block of `row_bucket` rows:
    `time_host_expert`)."""
    link_bytes_per_s: float | None
    """Measured pinned H2D bandwidth (CUDA); None on the CPU."""
    route_counts: list[list[float]] | None
    """Per layer and expert, the rounds of the profile whose verify used it (None: no profile)."""
    route_sequence: RouteSequence | None = None
    """The profile's rounds in order, up to `SEQUENCE_TOKENS` committed tokens (None: no profile)."""
    host_kernel: str | None = None
    """The name of the host kernel `host_expert_s` is for: the fastest of those timed (None: the host not timed)."""
    host_job_s: float | None = None
    """A host job's fixed seconds beyond its experts' (`PlacementState.host_job_s`; None: not measured, `host_expert_s`
    then a job's share of it, as with the parallel path's one-expert jobs)."""

    def apply(self, state: PlacementState) -> PlacementState:
        """`state` with these costs. An emulated link or one the transfer engine has measured already (the state's own
        figure) wins over the load-time probe: it is the link the copies will see."""
        return dataclasses.replace(state, host_expert_s=dict(self.host_expert_s),
                                   link_bytes_per_s=state.link_bytes_per_s or self.link_bytes_per_s,
                                   route_counts=self.route_counts, route_sequence=self.route_sequence,
                                   host_kernel=self.host_kernel, host_job_s=self.host_job_s)


@dataclasses.dataclass(frozen=True)
class HostKernel:
    """One way to compute a routed expert on the host: a name, the function (rows [n, D], the packed expert -> [n, D])
    and whether it computes each row on its own at any row count (then the host path runs it on the rows as they
    are; otherwise on zero-padded blocks of exactly `row_bucket` rows, which makes torch's kernels row-invariant)."""

    name: str
    mlp: ExpertFunction
    row_invariant: bool = False
    job: JobFunction | None = None
    """The same kernel on a layer's whole job in one call (`HostExperts.job`), where it has one."""


HOST_KERNELS = ("auto", "torch", "native")
"""EngineConfig.tuning.host.kernel: the fastest of those available as the calibration times them, or one of them."""


def host_kernels(choice: str, mlp: ExpertFunction, hidden_size: int, intermediate: int, dtype: torch.dtype,
                 own_expert: bool = False) -> list[HostKernel]:
    """The host kernels the calibration times for `choice` (HOST_KERNELS): torch's, the family's `mlp` on blocks;
    and the native one (`specter.experts.native`: the families' SwiGLU in bf16 on an x86 CPU with AVX2 and FMA
    at least, and a C compiler), unless the model brings an expert of its own (`own_expert`). 'native' where it is unavailable is
    refused."""
    from specter.experts import native

    kernels = [HostKernel("torch", mlp)] if choice in ("auto", "torch") else []
    if choice in ("auto", "native"):
        reason = ("the model computes its experts its own way" if own_expert else
                  f"it computes bfloat16 experts, not {str(dtype).removeprefix('torch.')}" if dtype != torch.bfloat16
                  else native.unavailable())
        if reason is None:
            kernels.append(HostKernel("native", functools.partial(native.native_swiglu, hidden=hidden_size,
                                                                  inter=intermediate), row_invariant=True,
                                      job=functools.partial(native.native_layer_job, hidden_size=hidden_size,
                                                             inter=intermediate)))
        elif choice == "native":
            raise ConfigError(f"tuning.host.kernel native: unavailable here ({reason}); use auto or torch")
    return kernels


async def calibrate(kernel: Kernel, pool: ExpertPool, kernels: Sequence[HostKernel], state: PlacementState,
                    hidden_size: int, device: torch.device, profile: Path | None = None, parallel: bool = False,
                    store: CostStore | None = None, fresh: bool = False) -> Calibration:
    """Every cost a placement policy reads that `state` lacks, measured now (the pool written, before the first
    request): the host path on one block of `state.row_bucket` rows with `state.host_threads` threads
    (`time_host_expert`, unless `kernels` is empty), the link unless the state has its figure (an emulated link), the
    profile's use counts and its rounds in order. `kernels`: the host kernels to choose from (`host_kernels`), each
    timed and the fastest taken (`Calibration.host_kernel`).
    `parallel` (EngineConfig.tuning.host.parallel_experts): each host expert runs on one thread, so one expert is
    timed alone on one thread. The cost model adds a layer's host experts up, as if they ran one after another: what a
    lone host expert costs, and an upper bound where several of a layer's run at once on the workers (it errs toward
    the device).

    With a `store`, the host and link figures (and the kernel) measured before on this machine for the same expert
    shape, dtype, block, threads and kernels are taken instead (unless `fresh`), and what is measured now is stored:
    the placement, and with it the text, then does not move with the timing noise of each load."""
    started = time.perf_counter()
    rows = state.row_bucket
    per_job = experts_per_job(state.top_k, parallel)
    key = cost_key(pool.expert_bytes, pool.dtype, hidden_size, rows, state.host_threads, per_job, parallel, device,
                   [candidate.name for candidate in kernels])
    previous, stored = stored_costs(store, key, kernels, fresh)
    host: dict[int, float] = {}
    chosen = job_s = None
    if kernels:
        if "host_expert_s" in stored:
            # a job's fixed part is measured wherever jobs hold several experts; the store keeps positive figures only
            chosen, host = stored["host_kernel"], {rows: stored["host_expert_s"]}
            job_s = stored.get("host_job_s", 0.0) if per_job > 1 else None
        else:
            timed = await time_host_kernels(kernel, pool, kernels, hidden_size, rows, state.host_threads, device, per_job,
                                            parallel)
            chosen = min(timed, key=timed.__getitem__)
            per_expert = timed[chosen]
            if per_job > 1:  # a job of one expert beside the jobs of per_job: the job's fixed part and each expert's
                candidate = next(candidate for candidate in kernels if candidate.name == chosen)
                single = await time_host_expert(kernel, pool, candidate.mlp, hidden_size, rows, state.host_threads, device,
                                                per_job=1, parallel=parallel, row_invariant=candidate.row_invariant,
                                                job=candidate.job,
                                                first_job=first_unread(pool.num_layers, pool.num_experts, per_job,
                                                                       len(kernels) * (REPEATS + 1)))
                per_expert, job_s = split_job_cost(per_expert, per_job, single)
            host = {rows: per_expert}
            log.info("placement.host_kernels", ms={name: round(seconds * 1e3, 3) for name, seconds in timed.items()},
                     chosen=chosen)
    link = None
    if state.link_bytes_per_s is None:
        link = stored.get("link_bytes_per_s") or time_link(pool.host(0, 0), device)
    if store is not None:
        store.update(key, previous, host_expert_s=host.get(rows), link_bytes_per_s=link, host_kernel=chosen,
                     host_job_s=job_s or None)  # the store keeps positive figures: 0 is its absence, not a change
    counts, sequence = routing_profile(profile, state.num_layers, state.num_experts) if profile is not None else (None, None)
    log.info("placement.calibrated", host_expert_ms=round(host[rows] * 1e3, 3) if host else None, host_kernel=chosen,
             link_gbps=round((state.link_bytes_per_s or link or 0) / 1e9, 2) or None, profile=str(profile) if profile else None,
             host_job_ms=None if job_s is None else round(job_s * 1e3, 3),
             stored=sorted(name for name in ("host_expert_s", "host_job_s", "link_bytes_per_s") if name in stored),
             seconds=round(time.perf_counter() - started, 3))
    return Calibration(host, link, counts, sequence, chosen, job_s)


async def time_host_kernels(kernel: Kernel, pool: ExpertPool, kernels: Sequence[HostKernel], hidden_size: int,
                            row_bucket: int, threads: int, device: torch.device, per_job: int,
                            parallel: bool = False) -> dict[str, float]:
    """Each host kernel's `time_host_expert`, in order, each on experts the ones before it did not read (cold for
    each: the pool needs (REPEATS + 1) x per_job x len(kernels) experts for that, else the later ones read some again)."""
    timed = {}
    for index, candidate in enumerate(kernels):
        timed[candidate.name] = await time_host_expert(kernel, pool, candidate.mlp, hidden_size, row_bucket, threads, device,
                                                       per_job=per_job, parallel=parallel,
                                                       row_invariant=candidate.row_invariant, first_job=index * (REPEATS + 1),
                                                       job=candidate.job)
    return timed


def stored_costs(store: CostStore | None, key: str, kernels: Sequence[HostKernel], fresh: bool) -> tuple[dict, dict]:
    """(the entry stored for `key`, the figures of it to take): none with `fresh` (the entry is still merged with what
    is measured now, so a figure not measured now, such as a real link's rate under an emulated one, stays), and a host
    figure only with its kernel, one of `kernels`. What `calibrate` and `specter info` read the store by."""
    previous = store.get(key) if store is not None else {}
    usable = {} if fresh else dict(previous)
    if usable.get("host_kernel") not in {candidate.name for candidate in kernels}:
        usable.pop("host_expert_s", None)
    if "host_expert_s" not in usable:
        usable.pop("host_kernel", None)
        usable.pop("host_job_s", None)
    return previous, usable


def cost_key(expert_bytes: int, dtype: torch.dtype, hidden_size: int, row_bucket: int, threads: int, per_job: int,
             parallel: bool, device: torch.device, kernels: Sequence[str] = ("torch",)) -> str:
    """What a stored host and link figure was measured for: this machine (its CPU, cores, torch, the device), one
    expert's bytes, dtype and width, the block, the host threads, how the calibration's jobs ran, the host kernels it
    chose from and the host path's own version (`host.HOST_PATH_VERSION`: its work around the kernel is timed too)."""
    fields = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "host_path": HOST_PATH_VERSION,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
              "expert_bytes": expert_bytes, "dtype": str(dtype).removeprefix("torch."), "hidden": hidden_size,
              "rows": row_bucket, "threads": threads, "per_job": per_job, "parallel": parallel, "kernels": list(kernels)}
    if "native" in kernels:  # a changed kernel is another kernel: its stored time and choice must not carry over
        from specter.experts import native

        fields["native"] = native.digest()
    return json.dumps(fields, sort_keys=True)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CostStore:
    """The placement costs measured on this machine (EngineConfig.recalibrate says when to measure them anew), one
    JSON file of entries by `cost_key`. A file that cannot be read or written costs only the measurement: a warning,
    and the engine measures as if there were none."""

    VERSION = 1

    def __init__(self, path: Path) -> None:
        self.path = path

    def _entries(self) -> dict[str, dict]:
        try:
            data = json_value(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            log.warning("placement.costs_unreadable", path=str(self.path), error=str(error),
                        hint="measuring anew; the file is replaced by the next measurement")
            return {}
        if not isinstance(data, dict) or data.get("version") != self.VERSION or not isinstance(data.get("entries"), dict):
            return {}
        return data["entries"]

    def get(self, key: str) -> dict:
        """The entry stored for `key` (its positive figures only), or {}."""
        entry = self._entries().get(key)
        if not isinstance(entry, dict):
            return {}
        return {name: value for name, value in entry.items()
                if (name in ("measured_at", "host_kernel") and isinstance(value, str))
                or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)}

    def update(self, key: str, stored: dict, **figures: float | str | None) -> None:
        """Store the `figures` for `key` beside the entry read before (`stored`) where one is new (None: not measured)."""
        measured = {name: value for name, value in figures.items() if value is not None}
        if any(stored.get(name) != value for name, value in measured.items()):
            self.put(key, {name: value for name, value in (stored | measured).items() if name != "measured_at"})

    def put(self, key: str, entry: dict) -> None:
        entries = self._entries()
        entries[key] = dict(entry, measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            scratch.write_text(json.dumps({"version": self.VERSION, "entries": entries}, indent=1))
            os.replace(scratch, self.path)  # atomic: a reader sees the old file or the new one, never half of one
        except OSError as error:
            log.warning("placement.costs_not_stored", path=str(self.path), error=str(error),
                        hint="the next load measures again")


def default_cost_store() -> CostStore:
    """The store under the cache directory (SPECTER_CACHE, default ~/.cache/specter)."""
    from specter.builtin import cache_dir

    return CostStore(cache_dir() / "placement-costs.json")


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


def experts_per_job(top_k: int, parallel: bool) -> int:
    """The experts one calibration job routes its row to: a row's top_k, computed one after another on the host
    thread; with the parallel host path one, alone on one thread as each worker runs it (`calibrate`)."""
    return 1 if parallel else top_k


def split_job_cost(per_expert: float, per_job: int, single: float) -> tuple[float, float]:
    """(seconds each expert of a job adds, the job's fixed seconds) from a job of `per_job` experts (`per_expert` each)
    and a job of one (`single`), on the line through the two: a job of m experts then costs fixed + m x the first. Where
    the two make no such line (the lone expert costs no more than the job's share of each, or at least the whole job:
    timing noise), (per_expert, 0.0): the job's share, no fixed part. Each expert adds at least a quarter of the job's
    share: with two experts a job, the lone job's noise moves the line's slope twice as much, and a near-zero slope
    would price every further host expert as free."""
    if single <= per_expert or single >= per_job * per_expert:
        return per_expert, 0.0
    slope = max((per_job * per_expert - single) / (per_job - 1), per_expert / 4)
    return slope, single - slope


def first_unread(num_layers: int, num_experts: int, per_job: int, jobs: int) -> int:
    """The first one-expert group (`cold_groups` with per_job 1) past every expert the first `jobs` groups of
    `per_job` read, so that jobs of one expert timed after them read experts from memory too."""
    if not jobs:
        return 0
    per_job = max(1, min(per_job, num_experts))
    per_layer = num_experts // per_job
    layer, group = divmod((jobs - 1) % (num_layers * per_layer), per_layer)
    return layer * num_experts + (group + 1) * per_job


def cold_groups(num_layers: int, num_experts: int, per_job: int, jobs: int) -> list[tuple[int, list[int]]]:
    """`jobs` groups of `per_job` experts of one layer, no expert in two groups while the pool has enough of them: in
    the order the pool is written at load (layer 0 first, the longest since it was written), then again from the
    start."""
    per_job = max(1, min(per_job, num_experts))
    per_layer = num_experts // per_job
    groups = []
    for job in range(jobs):
        layer, group = divmod(job % (num_layers * per_layer), per_layer)
        groups.append((layer, list(range(group * per_job, (group + 1) * per_job))))
    return groups


async def time_host_expert(kernel: Kernel, pool: ExpertPool, mlp: ExpertFunction, hidden_size: int, row_bucket: int,
                           threads: int, device: torch.device, per_job: int = 1, repeats: int = REPEATS,
                           parallel: bool = False, row_invariant: bool = False, first_job: int = 0,
                           job: JobFunction | None = None) -> float:
    """Median seconds of one routed expert on the host path as decoding runs it, over `repeats` timed jobs after one
    warm-up job: a job is `HostExperts.compute_layer` with one row routed to `per_job` experts of one layer (each on a
    block of `row_bucket` rows, in one call of the kernel where it has one (`job`), weighted, on CUDA put in pinned
    memory), on a thread set up as the host path's with
    `threads` torch threads, and its seconds over its experts count. `first_job`: the jobs start that many groups
    into `cold_groups`' order (another kernel timed before read the first ones). A `row_invariant` kernel (run on the
    rows as they are, not on blocks) gets `row_bucket` rows, so that its figure too is one block's cost.

    Each job reads experts no other job read (`cold_groups`): decoding cycles through every host expert of every layer,
    so it reads each one's weights from memory, while one expert timed again and again is read from the last-level
    cache wherever it fits there (a 17 MB expert fits a server's), faster than decoding ever reads it.
    Timing the path's own call (not the bare expert function) counts its per-expert work too (gather, padding,
    weighting, the pinned output): the figure is what the bench reports as ms per host expert (host seconds over host
    experts computed) for a host running alone. With `parallel` the thread has one torch thread, as each expert of the
    parallel host path has (`calibrate` then times one expert per job)."""
    host = HostExperts(pool, Placement.device_only(pool.num_layers, pool.num_experts), row_bucket, mlp, threads, device,
                       row_invariant=row_invariant, job=job)
    # One row padded to a block costs torch's kernel a block; a row-invariant kernel runs the rows it is given, so it
    # is timed on a block's worth: the figure is a block's cost either way, as the cost model reads it.
    count = row_bucket if row_invariant else 1
    rows = (torch.randn(count, hidden_size) * 0.1).to(pool.dtype)

    def job(layer: int, experts: list[int]) -> Callable[[], float]:
        weights = torch.full((count, len(experts)), 1.0 / len(experts))
        routes = {expert: (list(range(count)), [slot] * count) for slot, expert in enumerate(experts)}
        inputs = HostInputs(rows, weights)

        def run() -> float:
            started = time.perf_counter()
            host.compute_layer(layer, routes, inputs)
            return (time.perf_counter() - started) / len(experts)

        return run

    groups = cold_groups(pool.num_layers, pool.num_experts, per_job, first_job + repeats + 1)[first_job:]
    jobs = [job(layer, experts) for layer, experts in groups]
    thread = host_thread(device, 1 if parallel else threads, name="specter-host-calibration")
    try:
        return await kernel.wait_host(kernel.submit_host(thread, lambda: timed_once(jobs)))
    finally:
        thread.stop()
        host.close()


def timed_once(jobs: list[Callable[[], float]]) -> float:
    """The median of what `jobs[1:]` return, each run once after `jobs[0]` (the warm-up, not counted)."""
    jobs[0]()
    return statistics.median(run() for run in jobs[1:])


def route_profile(path: Path, num_layers: int, num_experts: int) -> list[list[float]] | None:
    """Per MoE layer and expert, how many rounds of the routing trace at `path` used it (its verify's `used`): the
    relative use the cost model scales to top_k per token. A trace of another shape is refused."""
    return routing_profile(path, num_layers, num_experts)[0]


def checked_trace(path: Path, num_layers: int, num_experts: int) -> tuple[TraceHeader, list[TraceRound]]:
    """The header and rounds of the routing trace at `path`, refused (a TraceError or ConfigError naming it) where it
    is not a trace or is one of another shape than `num_layers` MoE layers x `num_experts`. The load checks it so
    whatever the placement (`build_runtime`, through `routing_profile`): with `off`, which places nothing from it, a
    gzip file or another model's trace is still the user's mistake, and it is refused as `info --placement-profile`,
    the bench and a placing load refuse it, before any weight is read."""
    header, rounds = read_trace(path)
    if (header.num_layers, header.num_experts) != (num_layers, num_experts):
        raise ConfigError(f"placement_profile {path}: a trace of {header.num_layers} MoE layers x {header.num_experts} "
                          f"experts ({header.model}) for a model of {num_layers} x {num_experts}; record one of this "
                          "model with `specter generate --trace PATH`")
    return header, rounds


def routing_profile(path: Path, num_layers: int, num_experts: int) -> tuple[list[list[float]] | None, RouteSequence | None]:
    """The routing trace at `path` as the cost model reads it: its use counts (`route_profile`) and its rounds in order
    up to `SEQUENCE_TOKENS` committed tokens (`RouteSequence`: the locality counts cannot carry); (None, None) for a
    trace without rounds. A trace of another shape is refused. The file is parsed once while it is unchanged: a load
    checks it before any weight and its calibration reads it again, the bench once more before it loads and for each
    host-thread count (a 36 MB trace takes 3 s to parse); what is kept is the counts and the bounded sequence."""
    try:
        stat = os.stat(path)
        identity = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    except OSError:  # read_trace names the problem (missing, a directory, unreadable)
        return _read_profile(Path(path), num_layers, num_experts)
    counts, sequence = _profile_of(identity, Path(path), num_layers, num_experts)
    return (None if counts is None else [list(row) for row in counts]), sequence


@functools.lru_cache(maxsize=2)
def _profile_of(identity: tuple, path: Path, num_layers: int, num_experts: int) -> tuple[tuple | None, RouteSequence | None]:
    """`_read_profile` of one version of a file (`identity`: its real path, inode, size, modification and change
    times: a rewrite that keeps its size and mtime, `cp -p`, still moves the change time), counts frozen: every caller
    gets its own lists (a policy may change what it is given)."""
    counts, sequence = _read_profile(path, num_layers, num_experts)
    return (None if counts is None else tuple(tuple(row) for row in counts)), sequence


def _read_profile(path: Path, num_layers: int, num_experts: int) -> tuple[list[list[float]] | None, RouteSequence | None]:
    header, rounds = checked_trace(path, num_layers, num_experts)
    if not rounds:
        log.warning("placement.empty_profile", path=str(path), hint="the trace has no rounds: routing assumed uniform")
        return None, None
    return use_counts(rounds, num_layers, num_experts), RouteSequence.of_rounds(
        rounds, num_layers, SEQUENCE_TOKENS, recorded_prefetch=header.recorded_prefetch)


def reference_expert(hidden_size: int, intermediate: int) -> ExpertFunction:
    """The families' routed expert (`swiglu`, what Transformer.expert_mlp runs on one block, on the host path too),
    for timing without a model at hand (`specter info`)."""
    from specter.model.weights import swiglu

    return functools.partial(swiglu, hidden=hidden_size, inter=intermediate)
