"""Seconds for the host CPU to compute one routed expert (the host expert path, specter/experts/host.py) by rows and
torch threads, at a real shape, against the time the same expert takes to cross the link: what a placement weighs.

    python benchmarks/host_expert.py [SHAPE] [ROWS] [THREADS] [REPEATS] [WARMUP] [FLUSH_MB] [PARALLEL]
    python benchmarks/host_expert.py mixtral-8x7b 1,4,16 1,8,16 20 3
    python benchmarks/host_expert.py 1024x3584 1,16 1        # hidden x expert width, for a small CPU

SHAPE is a name of specter.bench.synthetic.SHAPES (hidden and expert width of the real model) or HIDDENxWIDTH; ROWS
and THREADS comma lists. The expert runs on the host thread as the engine runs it: bf16 weights from pinned memory
when CUDA is present (else plain), blocks of 16 rows, its own torch thread count. Per thread count, every row count is
warmed up (WARMUP calls of every variant, default 3), then the REPEATS (default 20) are interleaved: each repeat times
every (rows, variant) once, so drift and the first configuration's start-up fall on all of them alike. (The first
version warmed each configuration with one call and took the median of 3 in order: on the H200 its first row count
measured 10.5 ms at 1 row against 7.8 ms at 16, the same work; here the first configuration measured is the slow one
whichever it is.)

Cold: before each timed call the host thread reads FLUSH_MB of scratch (default twice the last-level cache that
sysfs reports, 64 MiB to 1 GiB; 0: no flush), so every variant reads its weights from memory, as the engine's host
path does (it cycles through every host expert of every layer), not from a cache that the previous call filled:
an expert that fits in the cache otherwise favours whichever variant read the same bytes last.

Variants, all on the same host thread and rows:
- host: `HostExperts.compute`, what the engine runs (block padding, the weighting); `host_s` is the median round trip
  through the event loop (submit to result, what a verify waits), `host_inside_s` the median on the host thread;
  its expert function is the families' `swiglu` (specter.model.weights: the F.linear chain, the device path's form);
- plain: the same F.linear chain on the rows as given (no padding, no weighting, no event loop; one row takes
  oneDNN's M = 1 path);
- native, host-native: specter.experts.native's kernel (the path this machine takes for the shape: AMX, AVX512-BF16
  or AVX2) on the rows as given, and the host path running it as the engine does with tuning.host.kernel native
  (unpadded rows, the weighting); native-PATH: the kernel on each other path this machine has (`other_paths_s`:
  what a CPU without AMX or AVX512-BF16 would run, timed on this one);
- left: the chain with the weights as GEMM's left operand (W13 @ X^T, then W2 @ A^T), which oneDNN can read as they
  lie where F.linear may reformat them on each call; not what the engine runs (on the GPU machine's host it cost
  about twice F.linear, on the 2-core dev Xeon 8 % less: docs/BENCHMARKS.md, "Host expert path");
- packed: the F.linear chain on the padded block with oneDNN-prepacked weights (torch.ops.mkldnn._reorder_linear_weight):
  the kernel without the per-call reformat; not what the engine runs (it needs a second copy of the weights);
  `packed_equal` says whether its output equals the host path's bit for bit;
- pageable (CUDA only): the plain chain on a pageable copy of the pinned weights.

With PARALLEL=1 (the seventh argument), then, per thread count T, the parallel mode: T distinct experts at once, each on its own thread with one torch thread
(the host path's `compute` on a block), against the same T experts one after another on one thread with T torch
threads (what the host path does now). A single-threaded expert's result does not depend on what runs beside it, so
an engine could spread a round's host experts over the cores without its tokens depending on the round; this measures
whether that is faster than one team of T threads per expert (`parallel_s`, `sequential_s`: per expert, medians;
`parallel_equal`: the two give the same bits). One team per expert waits at its barrier for any member that another
process preempts; one-thread experts do not wait for each other. And `split_s`: the same T experts one after another,
each split over the T one-thread workers by output rows in two phases (gate/up, then down; `split_expert`), which
keeps every core busy when a layer has fewer host experts than threads (`split_max_abs_diff` against one call).
Then, with the native kernel, one layer's 16 host experts through `compute_layer` on one thread with T torch threads:
a kernel call per expert (`native_each_s`) against one call for the layer (`native_layer_s`, what the engine runs:
the thread team started once for all of them), per expert, and whether their bits are equal (`layer_equal`).

Prints one line per (threads, rows) and a JSON line at the end.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from specter.bench.synthetic import SHAPES, shape_config
from specter.config import LINK_PRESETS
from specter.experts import native
from specter.experts.host import HostExperts, HostInputs, one_thread, own_thread_count
from specter.experts.pool import ExpertPool
from specter.kernel import Kernel, run
from specter.model.weights import swiglu, unpack_expert
from specter.placement import Placement

BUCKET = 16


def default_flush_bytes() -> int:
    """Twice the last-level cache sysfs reports for cpu0 (64 MiB when unknown), at most 1 GiB."""
    sizes = []
    for index in range(8):
        try:
            text = open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read().strip()
        except OSError:
            break
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return min(1 << 30, max(64 << 20, 2 * max(sizes, default=32 << 20)))


class HostMemory:
    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


def left_operand(rows: torch.Tensor, packed: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    """The SwiGLU chain with the weights as GEMM's left operand (variant `left`)."""
    w13, w2 = unpack_expert(packed, hidden, inter)
    gate_up = w13 @ rows.t().contiguous()  # [2I, B]
    return (w2 @ (F.silu(gate_up[:inter]) * gate_up[inter:])).t().contiguous()


def prepacked(packed: torch.Tensor, hidden: int, inter: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The SwiGLU chain on oneDNN-prepacked copies of the expert's weights (None where this torch lacks the ops)."""
    try:
        w13, w2 = unpack_expert(packed, hidden, inter)
        p13, p2 = (torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BUCKET) for w in (w13, w2))
        linear = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")  # noqa: E731
        check = torch.zeros(BUCKET, hidden, dtype=packed.dtype)
        linear(check, p13)
    except (AttributeError, RuntimeError):
        return None

    def mlp(rows: torch.Tensor) -> torch.Tensor:
        gate_up = linear(rows, p13)
        return linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], p2)

    return mlp


def parse_shape(shape: str) -> tuple[int, int]:
    if shape in SHAPES:
        config = shape_config(shape)
        return config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    hidden, _, inter = shape.partition("x")
    assert hidden.isdigit() and inter.isdigit(), f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}, or HIDDENxWIDTH"
    return int(hidden), int(inter)


async def time_expert(shape: str, rows_list: list[int], threads_list: list[int], repeats: int, warmup: int = 3,
                      flush_bytes: int | None = None) -> list[dict]:
    hidden, inter = parse_shape(shape)
    flush_bytes = default_flush_bytes() if flush_bytes is None else flush_bytes
    scratch = torch.ones(flush_bytes // 8, dtype=torch.int64) if flush_bytes else None
    flush = (lambda: scratch.max()) if scratch is not None else (lambda: None)  # a read: it leaves no dirty lines behind
    pool = ExpertPool(HostMemory(), 1, 1, 3 * hidden * inter, torch.bfloat16)
    pool.write(0, 0, (torch.randn(3 * hidden * inter) * 0.02).to(torch.bfloat16))
    expert_bytes, weights = pool.expert_bytes, pool.host(0, 0)
    mlp = functools.partial(swiglu, hidden=hidden, inter=inter)
    packed_mlp = prepacked(weights, hidden, inter)
    pageable = weights.clone() if weights.is_pinned() else None
    links = {name: expert_bytes / (gbps * 1e9) for name, gbps in LINK_PRESETS.items()}
    kernel, results = Kernel(), []
    try:
        for threads in threads_list:
            host = HostExperts(pool, Placement.of([[0]], 1, 1), row_bucket=BUCKET,
                               mlp=mlp, threads=threads)
            # the host path with the native kernel, as the engine runs it (unpadded rows), called on `host`'s thread
            host_native = HostExperts(pool, Placement.device_only(1, 1), row_bucket=BUCKET, row_invariant=True,
                                      mlp=functools.partial(native.native_swiglu, hidden=hidden, inter=inter))
            try:
                cases = {}
                for rows in rows_list:
                    x = (torch.randn(rows, hidden) * 0.1).to(torch.bfloat16)
                    w = torch.rand(rows, 1).to(torch.bfloat16)
                    block = F.pad(x, (0, 0, 0, -rows % BUCKET))[:BUCKET] if rows <= BUCKET else None
                    variants = {"host": lambda x=x, w=w: host.compute(0, 0, x, w),
                                "plain": lambda x=x: mlp(x, weights),
                                "left": lambda x=x: left_operand(x, weights, hidden, inter)}
                    if native.load() is not None:
                        variants["native"] = lambda x=x: native.native_swiglu(x, weights, hidden, inter)
                        variants["host-native"] = lambda x=x, w=w: host_native.compute(0, 0, x, w)
                        for path in other_paths(hidden, inter):
                            variants[f"native-{path.name.lower()}"] = lambda x=x, path=path: native.native_swiglu(
                                x, weights, hidden, inter, path)
                    if packed_mlp is not None and block is not None:
                        variants["packed"] = lambda block=block, w=w, rows=rows: packed_mlp(block)[:rows] * w
                    if pageable is not None:
                        variants["pageable"] = lambda x=x: mlp(x, pageable)
                    cases[rows] = variants
                    for work in variants.values():  # warm-up, per configuration
                        for _ in range(warmup):
                            await kernel.wait_host(kernel.submit_host(host.thread, work))
                inside = {(rows, name): [] for rows, variants in cases.items() for name in variants}
                round_trip = {rows: [] for rows in cases}
                for _ in range(repeats):  # interleaved: every (rows, variant) once per repeat
                    for rows, variants in cases.items():
                        for name, work in variants.items():
                            await kernel.wait_host(kernel.submit_host(host.thread, flush))
                            started = time.perf_counter()
                            job = kernel.submit_host(host.thread, work)
                            await kernel.wait_host(job)
                            if name == "host":
                                round_trip[rows].append(time.perf_counter() - started)
                            inside[rows, name].append(job.seconds)
                for rows, variants in cases.items():
                    median = {name: statistics.median(inside[rows, name]) for name in variants}
                    on_host = await kernel.wait_host(kernel.submit_host(host.thread, variants["host"]))
                    equal = {}  # variant -> whether its output is the host path's, bit for bit
                    if "packed" in variants:
                        other = await kernel.wait_host(kernel.submit_host(host.thread, variants["packed"]))
                        equal["packed"] = bool(torch.equal(on_host, other))
                    result = {"shape": shape, "hidden": hidden, "width": inter, "threads": threads, "rows": rows,
                              "repeats": repeats, "flush_bytes": flush_bytes, "host_s": statistics.median(round_trip[rows]),
                              "host_min_s": min(round_trip[rows]), "host_inside_s": median["host"],
                              "plain_s": median["plain"], "left_s": median["left"], "native_s": median.get("native"),
                              "host_native_s": median.get("host-native"), "packed_s": median.get("packed"), "packed_equal": equal.get("packed"),
                              "pageable_s": median.get("pageable"), "expert_bytes": expert_bytes, "copy_s": links,
                              "native_path": native.path_for(hidden, inter).name if native.load() is not None else None,
                              "other_paths_s": {name[7:]: median[name] for name in variants if name.startswith("native-")}}
                    results.append(result)
                    ms = lambda seconds: "-" if seconds is None else f"{seconds * 1e3:.2f}"  # noqa: E731
                    print(f"{shape} threads={threads:>3} rows={rows:>3}: host {ms(result['host_s']):>7} ms (min "
                          f"{ms(result['host_min_s'])}, on its thread {ms(result['host_inside_s'])}); plain "
                          f"{ms(result['plain_s'])}, left {ms(result['left_s'])}, native {ms(result['native_s'])} (host path "
                          f"{ms(result['host_native_s'])}), packed {ms(result['packed_s'])} (equal: {equal.get('packed')}), "
                          f"pageable "
                          f"{ms(result['pageable_s'])}; copy " + ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in links.items())
                          + (f"; native on {result['native_path']}, other paths: " + ", ".join(
                              f"{name} {ms(s)}" for name, s in result["other_paths_s"].items()) if result["native_path"] else ""),
                          flush=True)
            finally:
                host.close()
    finally:
        kernel.close()
    return results


def other_paths(hidden: int, inter: int) -> list[native.CodePath]:
    """The native kernel's paths this machine has for the shape besides the one it takes (`path_for`): what the
    same kernel costs on a CPU without AMX or AVX512-BF16, timed here."""
    if native.load() is None:
        return []
    return [path for path in native.shape_paths(hidden, inter) if path != native.path_for(hidden, inter)]


def interleaved(runs: dict[str, Callable[[], object]], repeats: int, scratch: torch.Tensor | None,
                per: int) -> tuple[dict[str, object], dict[str, float]]:
    """Each of `runs` once (the warm-up; its outputs are returned for comparing bits), then `repeats` rounds that time
    each once in turn, cold (`scratch` read before each call): the median seconds of each, over `per` items."""
    outputs = {name: work() for name, work in runs.items()}
    timed: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, work in runs.items():
            if scratch is not None:
                scratch.max()
            started = time.perf_counter()
            work()
            timed[name].append((time.perf_counter() - started) / per)
    return outputs, {name: statistics.median(seconds) for name, seconds in timed.items()}


def time_parallel(shape: str, rows: int, threads_list: list[int], repeats: int, flush_bytes: int | None = None) -> list[dict]:
    """Per T in `threads_list`: T distinct experts on T one-thread workers at once, against the same T one after
    another on one T-thread worker (the host path's `compute` on `rows` rows), cold, per expert (module docstring)."""

    hidden, inter = parse_shape(shape)
    flush_bytes = default_flush_bytes() if flush_bytes is None else flush_bytes
    scratch = torch.ones(flush_bytes // 8, dtype=torch.int64) if flush_bytes else None
    experts = max(threads_list)
    pool = ExpertPool(HostMemory(), 1, experts, 3 * hidden * inter, torch.bfloat16)
    for expert in range(experts):
        pool.write(0, expert, (torch.randn(3 * hidden * inter) * 0.02).to(torch.bfloat16))
    host = HostExperts(pool, Placement.of([list(range(experts))], 1, experts), row_bucket=BUCKET,
                       mlp=functools.partial(swiglu, hidden=hidden, inter=inter), threads=1)
    x, w = (torch.randn(rows, hidden) * 0.1).to(torch.bfloat16), torch.rand(rows, 1).to(torch.bfloat16)
    results = []
    try:
        for threads in threads_list:
            ids = list(range(threads))
            one = lambda expert: host.compute(0, expert, x, w)  # noqa: E731
            with ThreadPoolExecutor(threads, initializer=one_thread) as workers, \
                    ThreadPoolExecutor(1, initializer=lambda threads=threads: (torch.get_num_threads(),
                                                                               torch.set_num_threads(threads))) as team:
                split = lambda expert, workers=workers, threads=threads: split_expert(  # noqa: E731
                    pool.host(0, expert), x, w, hidden, inter, threads, workers)
                runs = {"parallel": lambda: list(workers.map(one, ids)),
                        "sequential": lambda: team.submit(lambda: [one(expert) for expert in ids]).result(),
                        "split": lambda: [split(expert) for expert in ids]}
                outputs, medians = interleaved(runs, repeats, scratch, threads)
            equal = all(torch.equal(a, b) for a, b in zip(outputs["parallel"], outputs["sequential"]))
            split_error = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs["split"], outputs["sequential"]))
            result = {"shape": shape, "rows": rows, "threads": threads, "parallel_s": medians["parallel"],
                      "sequential_s": medians["sequential"], "parallel_equal": equal,
                      "split_s": medians["split"], "split_max_abs_diff": split_error}
            results.append(result)
            print(f"{shape} rows={rows:>3}: {threads} experts on {threads} one-thread workers {result['parallel_s'] * 1e3:.2f} ms "
                  f"per expert, one after another with {threads} threads {result['sequential_s'] * 1e3:.2f} ms (equal: {equal}), "
                  f"each split over {threads} one-thread workers {result['split_s'] * 1e3:.2f} ms (max diff {split_error:.2g})",
                  flush=True)
    finally:
        host.close()
    return results


def time_layer(shape: str, rows: int, threads_list: list[int], repeats: int, flush_bytes: int | None = None,
               experts: int = 16) -> list[dict]:
    """Per T in `threads_list`: one layer's `experts` host experts, each on `rows` rows, through the host path's
    `compute_layer` with the native kernel on one thread with T torch threads: one kernel call per expert, against one
    call for the layer's whole job (`HostExperts.job`, `native.native_layer_job`: the engine's path), cold, per expert; and whether their bits are equal."""
    if native.unavailable() is not None:
        print(f"{shape}: no layer timing: native kernel {native.unavailable()}", flush=True)
        return []
    hidden, inter = parse_shape(shape)
    flush_bytes = default_flush_bytes() if flush_bytes is None else flush_bytes
    scratch = torch.ones(flush_bytes // 8, dtype=torch.int64) if flush_bytes else None
    pool = ExpertPool(HostMemory(), 1, experts, 3 * hidden * inter, torch.bfloat16)
    for expert in range(experts):
        pool.write(0, expert, (torch.randn(3 * hidden * inter) * 0.02).to(torch.bfloat16))
    placement = Placement.of([list(range(experts))], 1, experts)
    mlp = functools.partial(native.native_swiglu, hidden=hidden, inter=inter)
    job = functools.partial(native.native_layer_job, hidden_size=hidden, inter=inter)
    paths = {"each": HostExperts(pool, placement, BUCKET, mlp, threads=1, row_invariant=True),
             "layer": HostExperts(pool, placement, BUCKET, mlp, threads=1, row_invariant=True, job=job)}
    routes = {expert: (list(range(rows)), [0] * rows) for expert in range(experts)}
    inputs = HostInputs((torch.randn(rows, hidden) * 0.1).to(torch.bfloat16), torch.rand(rows, 1).to(torch.bfloat16))
    results = []
    try:
        for threads in threads_list:
            with ThreadPoolExecutor(1, initializer=lambda threads=threads: own_thread_count(threads)) as team:
                work = {name: (lambda host=host: team.submit(host.compute_layer, 0, routes, inputs).result())
                        for name, host in paths.items()}
                outputs, medians = interleaved(work, repeats, scratch, experts)
            equal = all(torch.equal(outputs["each"][e], outputs["layer"][e]) for e in range(experts))
            result = {"shape": shape, "rows": rows, "threads": threads, "experts": experts,
                      "native_each_s": medians["each"], "native_layer_s": medians["layer"],
                      "layer_equal": equal}
            results.append(result)
            print(f"{shape} rows={rows:>3}: a layer of {experts} host experts, native, {threads} threads: one call per "
                  f"expert {result['native_each_s'] * 1e3:.2f} ms per expert, one call for the layer "
                  f"{result['native_layer_s'] * 1e3:.2f} ms (equal: {equal})", flush=True)
    finally:
        for host in paths.values():
            host.close()
    return results


def split_expert(packed: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, hidden: int, inter: int, parts: int,
                 workers) -> torch.Tensor:
    """One expert on `rows` (padded to a block) split over `parts` one-thread workers in two phases: each takes a
    slice of the gate/up rows (W13 @ X^T, then SiLU(gate) * up on its slice), then a slice of the down rows
    (W2 @ A^T): every output element is one single-threaded product over the full K, so for a fixed `parts` the
    result does not depend on the round; how its bits compare with one call is printed (max diff)."""
    w13, w2 = unpack_expert(packed, hidden, inter)
    count = rows.shape[0]
    block = F.pad(rows, (0, 0, 0, -count % BUCKET)).t().contiguous()  # [D, B]
    cuts = lambda size: [(size * c // parts, size * (c + 1) // parts) for c in range(parts)]  # noqa: E731

    def gate_up(bounds: tuple[int, int]) -> torch.Tensor:
        lo, hi = bounds
        return F.silu(w13[lo:hi] @ block) * (w13[inter + lo : inter + hi] @ block)

    act = torch.cat(list(workers.map(gate_up, cuts(inter))))  # [I, B]
    out = torch.cat(list(workers.map(lambda bounds: w2[bounds[0] : bounds[1]] @ act, cuts(hidden))))  # [D, B]
    return out.t()[:count] * weights


if __name__ == "__main__":
    shape = sys.argv[1] if len(sys.argv) > 1 else "mixtral-8x7b"
    parse_shape(shape)
    rows = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16").split(",")]
    threads = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else str(torch.get_num_threads())).split(",")]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    flush = int(sys.argv[6]) << 20 if len(sys.argv) > 6 and sys.argv[6] != "-" else None  # "-": the default
    parallel = len(sys.argv) > 7 and sys.argv[7] == "1"
    timed = run(time_expert(shape, rows, threads, repeats, warmup, flush))
    if parallel:
        timed += time_parallel(shape, max(rows), threads, repeats, flush)
        timed += time_layer(shape, max(rows), threads, repeats, flush)
    print(json.dumps(timed))
