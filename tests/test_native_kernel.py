"""The native host kernel (specter/experts/native.py) and the calibration's choice between it and torch's
(tuning.host.kernel): its values against a float32 reference, each row on its own (any rows beside it, any count,
any thread count), the host path on unpadded rows, which kernels are offered, the choice stored, and speculation
exact with it."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.config import DraftConfig, EngineConfig, GenerationConfig, TuningConfig
from specter.errors import ConfigError
from specter.experts import costs, native
from specter.experts.host import HostExperts, HostInputs, host_routes
from specter.experts.pool import ExpertPool
from specter.kernel import Kernel
from specter.model.checkpoint import Checkpoint
from specter.model.weights import swiglu
from specter.placement import Placement, PlacementState
from tests.test_hybrid import run
from tests.test_speculative import DEVICE, checkpoint

needs_native = pytest.mark.skipif(native.unavailable() is not None, reason=f"native kernel: {native.unavailable()}")


shape_paths = native.shape_paths  # the kernel's paths this machine can run a shape on


class Memory:
    def alloc_host(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)


def expert(hidden: int, inter: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(3 * hidden * inter, generator=generator) * 0.05).to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize("hidden, inter", [(64, 96), (256, 384), (100, 70), (33, 17)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 19])
def test_native_matches_a_float_reference(hidden, inter, rows):
    """bf16 weights and rows, float32 sums, one rounding of the activation and one of the output: within bf16's
    rounding of a float32 reference, and no farther from it than torch's bf16 chain (which rounds more often), on
    every path this machine has for the shape (AMX, AVX512-BF16 with its masked tail, AVX2 with its padded one)."""
    packed = expert(hidden, inter, seed=rows)
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(hidden)) * 2).to(torch.bfloat16)
    reference = swiglu(x.float(), packed.float(), hidden, inter)
    torch_error = (swiglu(x, packed, hidden, inter).float() - reference).abs().max()
    assert native.path_for(hidden, inter) in shape_paths(hidden, inter)
    for path in shape_paths(hidden, inter):
        got = native.native_swiglu(x, packed, hidden, inter, path)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, hidden)
        torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=1e-2 * float(reference.abs().max()))
        assert (got.float() - reference).abs().max() <= 1.5 * torch_error + 1e-6, path


@needs_native
def test_a_shape_takes_the_fastest_path_the_machine_has(monkeypatch):
    """AMX for widths that are multiples of 32 where Linux granted its tiles, else AVX512-BF16 where the CPU has it,
    else AVX2; a path the machine lacks, or AMX for other widths, is refused."""
    path = native.CodePath
    for usable, expected in (([path.AVX2, path.AVX512_BF16, path.AMX], (path.AMX, path.AVX512_BF16)),
                             ([path.AVX2, path.AVX512_BF16], (path.AVX512_BF16, path.AVX512_BF16)),
                             ([path.AVX2], (path.AVX2, path.AVX2))):
        monkeypatch.setattr(native, "paths", lambda usable=usable: usable)
        assert (native.path_for(64, 96), native.path_for(64, 70)) == expected
    monkeypatch.undo()
    with pytest.raises(ValueError, match="multiples of 32"):
        native.native_swiglu(torch.zeros(1, 33, dtype=torch.bfloat16), expert(33, 17), 33, 17, native.CodePath.AMX)


@pytest.mark.skipif(not {"avx2", "fma"} <= native._cpu_flags(), reason="the CPU has no AVX2 with FMA")
def test_a_build_for_a_cpu_without_avx512_holds_the_avx2_path_only_and_computes_its_bits(tmp_path):
    """Compiled for Haswell (AVX2 and FMA, no AVX512: the desktop CPUs the AVX512 code would not build for), the
    kernel builds, holds the AVX2 path alone, and gives the bits this machine's own build gives on that path."""
    kernel, why = native.build("haswell", tmp_path / "haswell.so")
    if kernel is None and "no C compiler" in (why or ""):
        pytest.skip(why)
    assert kernel is not None, why
    assert kernel.usable == [native.CodePath.AVX2] and kernel.paths() == 1
    if native.unavailable() is not None:
        return
    hidden, inter = 100, 70
    rows = (torch.randn(7, hidden, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    packed = expert(hidden, inter)
    got = torch.empty(rows.shape[0], hidden, dtype=torch.bfloat16)
    native._call(kernel, [(0, rows, packed)], hidden, inter, native.CodePath.AVX2, got)
    assert torch.equal(got, native.native_swiglu(rows, packed, hidden, inter, native.CodePath.AVX2))


@needs_native
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 24), data=st.data(), scale=st.sampled_from([0.1, 1.0, 30.0]), threads=st.sampled_from([1, 2, 3]))
def test_a_rows_native_output_does_not_depend_on_the_rows_around_it_or_the_threads(rows, data, scale, threads):
    """Row invariance at any count (why the host path runs it unpadded): row r of a batch equals row r alone and row r
    among other rows, bit for bit, at any torch thread count of the calling thread."""
    hidden, inter = 96, 160
    packed = expert(hidden, inter)
    x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)) * scale).to(torch.bfloat16)
    r = data.draw(st.integers(0, rows - 1))
    path = data.draw(st.sampled_from(shape_paths(hidden, inter)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = native.native_swiglu(x, packed, hidden, inter, path)[r]
        torch.set_num_threads(1)
        alone = native.native_swiglu(x[r : r + 1], packed, hidden, inter, path)[0]
    finally:
        torch.set_num_threads(before)
    others = torch.cat([torch.full((5, hidden), 3.0, dtype=torch.bfloat16), x[r : r + 1]])
    elsewhere = native.native_swiglu(others, packed, hidden, inter, path)[5]
    assert torch.equal(together, alone) and torch.equal(alone, elsewhere)
    # past CHUNK rows (a long prompt) the kernel runs in chunks: the same bits
    long = torch.cat([torch.zeros(native.CHUNK + 3, hidden, dtype=torch.bfloat16), x[r : r + 1]])
    assert torch.equal(native.native_swiglu(long, packed, hidden, inter, path)[-1], alone)


@needs_native
def test_the_host_path_runs_a_row_invariant_kernel_on_the_rows_as_they_are():
    """With `row_invariant` the host path calls the kernel on the n rows it has (no zero block of row_bucket rows)
    and weights them; torch's kernel still gets whole blocks."""
    hidden, inter = 64, 96
    pool = ExpertPool(Memory(), 1, 1, 3 * hidden * inter, torch.bfloat16)
    pool.write(0, 0, expert(hidden, inter))
    seen = []

    def spy(rows, packed):
        seen.append(rows.shape[0])
        return native.native_swiglu(rows, packed, hidden, inter)

    rows = torch.randn(5, hidden).to(torch.bfloat16)
    weights = torch.rand(5, 1).to(torch.bfloat16)
    host = HostExperts(pool, Placement.device_only(1, 1), 16, spy, threads=1, row_invariant=True)
    blocked = HostExperts(pool, Placement.device_only(1, 1), 16, spy, threads=1)
    try:
        out = host.compute(0, 0, rows, weights)
        assert seen == [5]
        assert torch.equal(out, native.native_swiglu(rows, pool.host(0, 0), hidden, inter) * weights)
        assert torch.equal(blocked.compute(0, 0, rows, weights), out)  # the same bits: each row on its own
        assert seen == [5, 16]
    finally:
        host.close()
        blocked.close()


@needs_native
@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(1, 90), min_size=1, max_size=7), shape=st.sampled_from([(64, 96), (33, 17)]),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000), data=st.data())
def test_several_experts_in_one_call_give_each_row_the_bits_of_its_own_call(counts, shape, threads, seed, data):
    """`native_swiglu_many`: experts of one shape on rows of their own, in calls of at most CALL_ROWS rows of jobs of at
    most CHUNK: each output equals the expert's own `native_swiglu` call bit for bit (AMX and AVX512-BF16 widths;
    AVX2 at both), whatever the other experts, their rows or the threads."""
    hidden, inter = shape
    path = data.draw(st.sampled_from(shape_paths(hidden, inter)))
    generator = torch.Generator().manual_seed(seed)
    jobs = [((torch.randn(count, hidden, generator=generator) * 2).to(torch.bfloat16), expert(hidden, inter, seed + i))
            for i, count in enumerate(counts)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = native.native_swiglu_many(jobs, hidden, inter, path)
        torch.set_num_threads(1)
        alone = [native.native_swiglu(rows, packed, hidden, inter, path) for rows, packed in jobs]
    finally:
        torch.set_num_threads(before)
    assert [out.shape for out in together] == [(count, hidden) for count in counts]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    # an expert with no rows among them gets an empty output and moves nothing else
    empty = torch.empty(0, hidden, dtype=torch.bfloat16)
    with_empty = native.native_swiglu_many([(empty, jobs[0][1])] + jobs, hidden, inter, path)
    assert with_empty[0].shape == (0, hidden) and all(torch.equal(a, b) for a, b in zip(with_empty[1:], alone))


@needs_native
@settings(max_examples=25, deadline=None)
@given(t_rows=st.integers(1, 120), top=st.integers(1, 3), shape=st.sampled_from([(64, 96), (33, 17)]),
       threads=st.sampled_from([1, 2, 3]), dense=st.booleans(), bf16_weights=st.booleans(), seed=st.integers(0, 1000),
       data=st.data())
def test_a_layer_job_in_one_call_gives_each_row_the_bits_of_the_per_expert_path(t_rows, top, shape, threads, dense,
                                                                                  bf16_weights, seed, data):
    """`native_layer_job`, the host path's whole layer job in one call (gather, experts, weighting, placing): every
    expert's rows equal `native_swiglu` on those rows times their routing weights as torch weights them (bf16 times
    bf16), bit for bit; dense, each expert's rows in place and every other row zero. Up to 120 rows and top-3 of 5
    experts: jobs past CHUNK rows and calls past CALL_ROWS, on each path this machine has, at 1 to 3 threads."""
    hidden, inter = shape
    path = data.draw(st.sampled_from(shape_paths(hidden, inter)))
    experts_n = 5
    generator = torch.Generator().manual_seed(seed)
    chosen = [torch.randperm(experts_n, generator=generator)[:top].tolist() for _ in range(t_rows)]
    taken = data.draw(st.lists(st.integers(0, experts_n - 1), min_size=1, max_size=experts_n, unique=True))
    routes = host_routes(chosen, taken)
    x = (torch.randn(t_rows, hidden, generator=generator) * 2).to(torch.bfloat16)
    weights = torch.rand(t_rows, top, generator=generator)
    if bf16_weights:
        weights = weights.to(torch.bfloat16)
    packed = {e: expert(hidden, inter, seed + e) for e in range(experts_n)}
    experts = sorted(routes)
    counts = [len(routes[e][0]) for e in experts]
    rows = [r for e in experts for r in routes[e][0]]
    slots = [slot for e in experts for slot in routes[e][1]]
    out = torch.full((len(experts) * t_rows if dense else len(rows), hidden), float("nan"), dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        native.native_layer_job(x, weights, rows, slots, counts, [packed[e].data_ptr() for e in experts], out, dense,
                                hidden, inter, path)
    finally:
        torch.set_num_threads(before)
    start = 0
    for position, e in enumerate(experts):
        index = torch.tensor(routes[e][0], dtype=torch.long)
        want = native.native_swiglu(x[index], packed[e], hidden, inter, path) * weights[
            index, torch.tensor(routes[e][1], dtype=torch.long)].to(torch.bfloat16)[:, None]
        if dense:
            block = out[position * t_rows : (position + 1) * t_rows]
            assert torch.equal(block[index], want)
            others = [r for r in range(t_rows) if r not in set(routes[e][0])]
            assert torch.equal(block[others], torch.zeros(len(others), hidden, dtype=torch.bfloat16))
        else:
            assert torch.equal(out[start : start + counts[position]], want)
        start += counts[position]


def test_a_layer_job_asks_for_more_scratch_and_keeps_it(monkeypatch):
    """The kernel reports the scratch a job needs rather than overrunning the caller's; the thread keeps what it grew
    for its later jobs, and a smaller job allocates nothing."""
    if native.unavailable() is not None:
        pytest.skip(f"native kernel: {native.unavailable()}")
    hidden, inter = 64, 96
    packed = expert(hidden, inter)
    x = torch.randn(40, hidden).to(torch.bfloat16)
    weights = torch.rand(40, 1)
    native._SCRATCH.__dict__.pop("bytes", None)

    def one(t_rows):
        out = torch.empty(t_rows, hidden, dtype=torch.bfloat16)
        native.native_layer_job(x[:t_rows], weights[:t_rows], list(range(t_rows)), [0] * t_rows, [t_rows],
                                [packed.data_ptr()], out, False, hidden, inter)
        return out

    one(40)
    grown = native._SCRATCH.bytes
    assert grown.numel() >= 40 * (hidden * 2 + 2 * inter * 4 + inter * 2 + hidden * 4)
    small = one(3)
    assert native._SCRATCH.bytes is grown  # kept, not reallocated
    assert torch.equal(small, native.native_swiglu(x[:3], packed, hidden, inter) * weights[:3].to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("rows, slots, counts", [([0, 4], [0, 0], [2]), ([-1, 1], [0, 0], [2]), ([0, 1], [0, 2], [2]),
                                                 ([0, 1], [-1, 0], [2]), ([0, 1], [0, 0], [3, -1])])
def test_a_layer_job_refuses_indices_out_of_range(rows, slots, counts):
    """The C side indexes the hidden rows and the routing weights with `rows` and `slots` unchecked: one out of range
    is refused before the call (the output left as it was), not read or written past the buffers."""
    hidden, inter = 64, 96
    packed = expert(hidden, inter)
    x = torch.randn(4, hidden).to(torch.bfloat16)
    out = torch.full((2, hidden), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="row indices must lie in 0..3, top-k slots in 0..1"):
        native.native_layer_job(x, torch.rand(4, 2), rows, slots, counts, [packed.data_ptr()] * len(counts), out, False,
                                hidden, inter)
    assert torch.equal(out, torch.full((2, hidden), 7.0, dtype=torch.bfloat16))
    ok = torch.empty(2, hidden, dtype=torch.bfloat16)
    native.native_layer_job(x, torch.rand(4, 2), [0, 3], [0, 1], [2], [packed.data_ptr()], ok, False, hidden, inter)


@needs_native
def test_the_host_path_sends_a_layers_experts_to_the_kernel_in_one_call():
    """With the kernel's `job`, `compute_layer` makes one call for the layer's experts (the thread team started once),
    one expert alone too, and its outputs, weighted, equal the per-expert path's bit for bit, as rows (views of one
    buffer) and dense (each expert's rows in place, the others zero)."""
    hidden, inter, experts = 64, 96, 4
    pool = ExpertPool(Memory(), 1, experts, 3 * hidden * inter, torch.bfloat16)
    for e in range(experts):
        pool.write(0, e, expert(hidden, inter, seed=e))
    calls = []

    def job(hidden_rows, weights, rows, slots, counts, addresses, out, dense):
        calls.append(len(counts))
        native.native_layer_job(hidden_rows, weights, rows, slots, counts, addresses, out, dense, hidden, inter)

    mlp = functools.partial(native.native_swiglu, hidden=hidden, inter=inter)
    chosen = [[0, 2], [1, 2], [3, 0], [2, 1], [0, 1]]
    routes = host_routes(chosen, range(experts))
    inputs = HostInputs(torch.randn(len(chosen), hidden).to(torch.bfloat16), torch.rand(len(chosen), 2).to(torch.bfloat16))
    batched = HostExperts(pool, Placement.device_only(1, experts), 16, mlp, threads=1, row_invariant=True, job=job)
    single = HostExperts(pool, Placement.device_only(1, experts), 16, mlp, threads=1, row_invariant=True)
    try:
        together = batched.compute_layer(0, routes, inputs)
        assert calls == [experts]
        apart = single.compute_layer(0, routes, inputs)
        assert sorted(together) == sorted(apart) == list(range(experts))
        assert all(torch.equal(together[e], apart[e]) for e in range(experts))
        dense = batched.compute_layer(0, {2: routes[2]}, inputs, dense=True)
        assert calls == [experts, 1] and torch.equal(dense[2][routes[2][0]], apart[2])
        dense = batched.compute_layer(0, routes, inputs, dense=True)
        assert calls == [experts, 1, experts] and sorted(dense) == list(range(experts))
        for e in range(experts):
            rows = routes[e][0]
            others = [r for r in range(len(chosen)) if r not in rows]
            assert dense[e].shape == (len(chosen), hidden) and torch.equal(dense[e][rows], apart[e])
            assert not dense[e][others].any()
    finally:
        batched.close()
        single.close()


def test_which_kernels_the_calibration_chooses_from(monkeypatch):
    """auto: torch's and, for the families' SwiGLU in bf16 where it builds, the native one; torch: torch's only;
    native: the native one only, refused (ConfigError saying why) where it cannot run."""
    mlp = lambda rows, packed: rows  # noqa: E731
    names = lambda kernels: [kernel.name for kernel in kernels]  # noqa: E731
    monkeypatch.setattr(native, "unavailable", lambda: None)
    assert names(costs.host_kernels("auto", mlp, 8, 4, torch.bfloat16)) == ["torch", "native"]
    [torch_kernel, native_kernel] = costs.host_kernels("auto", mlp, 8, 4, torch.bfloat16)
    assert torch_kernel.mlp is mlp and not torch_kernel.row_invariant and native_kernel.row_invariant
    assert names(costs.host_kernels("torch", mlp, 8, 4, torch.bfloat16)) == ["torch"]
    assert names(costs.host_kernels("native", mlp, 8, 4, torch.bfloat16)) == ["native"]
    assert names(costs.host_kernels("auto", mlp, 8, 4, torch.float32)) == ["torch"]
    assert names(costs.host_kernels("auto", mlp, 8, 4, torch.bfloat16, own_expert=True)) == ["torch"]
    with pytest.raises(ConfigError, match="native: unavailable here .*float32"):
        costs.host_kernels("native", mlp, 8, 4, torch.float32)
    monkeypatch.setattr(native, "unavailable", lambda: "the CPU has neither AVX512-BF16 nor AVX2 with FMA")
    assert names(costs.host_kernels("auto", mlp, 8, 4, torch.bfloat16)) == ["torch"]
    with pytest.raises(ConfigError, match="AVX512-BF16"):
        costs.host_kernels("native", mlp, 8, 4, torch.bfloat16)
    with pytest.raises(ConfigError, match="host.kernel"):
        TuningConfig().with_overrides(["host.kernel=fast"])


def test_the_calibration_takes_the_faster_kernel_and_stores_it(monkeypatch, placement_costs):
    """Each kernel is timed on experts the others did not read; the faster is the calibration's and the state's
    `host_kernel`, stored with its time, and a second calibration takes both without timing."""
    calls = []

    async def time_host_expert(kernel, pool, mlp, hidden_size, row_bucket, threads, device, per_job=1,
                               repeats=costs.REPEATS, parallel=False, row_invariant=False, first_job=0, job=None):
        calls.append(first_job)
        return 1e-3 if row_invariant else 3e-3

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    kernels = [costs.HostKernel("torch", lambda rows, packed: rows),
               costs.HostKernel("native", lambda rows, packed: rows, row_invariant=True)]
    pool = ExpertPool(Memory(), 2, 8, 24, torch.bfloat16)
    for layer in range(2):
        for index in range(8):
            pool.write(layer, index, torch.zeros(24, dtype=torch.bfloat16))
    state = PlacementState(num_layers=2, num_experts=8, top_k=2, slots_per_layer=2, initial_residents=((), ()),
                           expert_bytes=pool.expert_bytes, row_bucket=16, host_threads=1)

    async def calibrate():
        with Kernel() as kernel:
            return await costs.calibrate(kernel, pool, kernels, state, 4, torch.device("cpu"), store=placement_costs)

    first = asyncio.run(calibrate())
    # then the chosen kernel on jobs of one expert, past those the jobs of two read (the pool holds 16: it wraps)
    singles = costs.first_unread(2, 8, 2, 2 * (costs.REPEATS + 1))
    assert calls == [0, costs.REPEATS + 1, singles] and first.host_kernel == "native" and first.host_expert_s == {16: 1e-3}
    assert first.host_job_s == 0.0  # a job of one cost what each of a job of two did: no fixed part
    assert first.apply(state).host_kernel == "native"
    second = asyncio.run(calibrate())
    assert calls == [0, costs.REPEATS + 1, singles]
    assert (second.host_kernel, second.host_expert_s, second.host_job_s) == ("native", {16: 1e-3}, 0.0)


@needs_native
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_stays_exact_with_the_native_host_kernel(tmp_path, temperature):
    """A bf16 engine whose non-resident experts all run on the host with the native kernel: speculative output equals
    the same engine's k = 0 output, greedy and seeded sampling, and the host computed experts."""
    path = checkpoint("qwen2_moe", str(tmp_path))
    residents = Checkpoint(path).spec.top_k
    generation = GenerationConfig(max_new_tokens=10, temperature=temperature, top_p=0.9 if temperature else None, seed=5)
    forced = TuningConfig().with_overrides(["host.kernel=native"])
    common = dict(device=DEVICE, dtype="bfloat16", max_context=96, residents=residents, cpu_experts="all", cpu_threads=2,
                  tuning=forced)
    plain, placement = run(path, EngineConfig(**common, draft=DraftConfig(k=0)), [3, 1, 4, 1, 5], generation)
    speculative, _ = run(path, EngineConfig(**common, draft=DraftConfig(k=4, quant="int8")), [3, 1, 4, 1, 5], generation)
    assert placement.total > 0 and plain.stats.host_computed_experts > 0
    assert speculative.tokens == plain.tokens


def test_a_forced_native_kernel_that_cannot_run_is_refused_before_the_experts_load(tmp_path, monkeypatch):
    """tuning.host.kernel native on a float32 engine, or where the kernel cannot be built: a ConfigError naming why,
    raised before the first expert is read."""
    from specter.engine import Runtime
    from specter.model import weights

    def refuse(*args, **kwargs):
        raise AssertionError("an expert was read")

    monkeypatch.setattr(weights, "iter_experts", refuse)
    monkeypatch.setattr("specter.build.iter_experts", refuse)
    path = checkpoint("mixtral", str(tmp_path))
    forced = TuningConfig().with_overrides(["host.kernel=native"])

    async def load(config):
        async with await Runtime.load(path, config):
            pass

    common = dict(device="cpu", max_context=64, residents=2, cpu_experts="all", tuning=forced)
    with pytest.raises(ConfigError, match="native: unavailable here .*float32"):
        asyncio.run(load(EngineConfig(**common, dtype="float32")))
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (gcc or cc) on PATH")
    with pytest.raises(ConfigError, match="no C compiler"):
        asyncio.run(load(EngineConfig(**common, dtype="bfloat16")))


def test_recalibrating_keeps_what_it_does_not_measure(placement_costs, monkeypatch):
    """--recalibrate measures the host anew; a figure it does not measure now (a real link's rate, under an emulated
    link) stays in the store."""
    calls = []

    async def time_host_expert(*args, per_job=1, **kwargs):
        calls.append(per_job)
        return 4e-3 if per_job > 1 else 6e-3  # jobs of two: 8 ms; of one: 6 ms (2 an expert + 4 a job)

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    pool = ExpertPool(Memory(), 1, 8, 24, torch.bfloat16)
    state = PlacementState(num_layers=1, num_experts=8, top_k=2, slots_per_layer=2, initial_residents=((),),
                           expert_bytes=pool.expert_bytes, row_bucket=16, host_threads=1, link_bytes_per_s=2e9)
    kernels = [costs.HostKernel("torch", lambda rows, packed: rows)]
    key = costs.cost_key(pool.expert_bytes, pool.dtype, 4, 16, 1, 2, False, torch.device("cpu"), ["torch"])
    placement_costs.put(key, {"host_expert_s": 1e-3, "host_kernel": "torch", "link_bytes_per_s": 7e9})

    async def calibrate(fresh):
        with Kernel() as kernel:
            return await costs.calibrate(kernel, pool, kernels, state, 4, torch.device("cpu"), store=placement_costs,
                                         fresh=fresh)

    assert asyncio.run(calibrate(False)).host_expert_s == {16: 1e-3} and calls == []
    fresh = asyncio.run(calibrate(True))
    assert calls == [2, 1] and fresh.host_expert_s[16] == pytest.approx(2e-3) and fresh.host_job_s == pytest.approx(4e-3)
    entry = placement_costs.get(key)
    assert entry["link_bytes_per_s"] == 7e9 and (entry["host_expert_s"], entry["host_job_s"]) == pytest.approx((2e-3, 4e-3))


@pytest.mark.parametrize("row_invariant, rows", [(False, 1), (True, 16)])
def test_a_kernel_is_timed_at_a_blocks_cost(monkeypatch, row_invariant, rows):
    """torch's kernel gets one row (the host path pads it to a block of row_bucket); a row-invariant kernel runs the
    rows it is given, so it is timed on row_bucket rows: both figures are one block's cost, as the cost model reads
    them."""
    seen = []
    real = HostExperts.compute

    def spy(self, layer, expert, x, weights):
        seen.append(x.shape[0])
        return real(self, layer, expert, x, weights)

    monkeypatch.setattr(HostExperts, "compute", spy)
    pool = ExpertPool(Memory(), 1, 8, 3 * 4 * 6, torch.float32)
    for index in range(8):
        pool.write(0, index, torch.randn(3 * 4 * 6))

    async def timed():
        with Kernel() as kernel:
            return await costs.time_host_expert(kernel, pool, lambda x, packed: x * 2, 4, 16, 1, torch.device("cpu"),
                                                per_job=2, row_invariant=row_invariant)

    assert asyncio.run(timed()) > 0
    assert seen and set(seen) == {rows}
