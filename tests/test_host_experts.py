"""The host expert path (specter/experts/host.py) and the kernel's host jobs: the device path's output for every
family, row invariance, the host thread's own torch thread count, and cancellation."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.config import EngineConfig
from specter.engine import Runtime
from specter.experts.host import HostExperts, HostInputs, host_routes, host_thread, per_thread_counts
from specter.experts.pool import ExpertPool
from specter.kernel import HostThread, HostThreadSetupError, Kernel
from specter.model.weights import swiglu
from specter.placement import Placement
from tests.hf_models import FAMILIES
from tests.test_speculative import checkpoint

DEVICE = os.environ.get("SPECTER_TEST_DEVICE", "cpu")
EXTRA = ("phimoe-longrope", "deepseek-v2")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("host"))


class HostMemory:
    """A backend stand-in for ExpertPool: plain host tensors."""

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)


def random_pool(layers: int = 1, experts: int = 2, hidden: int = 256, inter: int = 384, dtype=torch.bfloat16) -> ExpertPool:
    pool = ExpertPool(HostMemory(), layers, experts, 3 * hidden * inter, dtype)
    generator = torch.Generator().manual_seed(0)
    for layer in range(layers):
        for expert in range(experts):
            pool.write(layer, expert, (torch.randn(3 * hidden * inter, generator=generator) * 0.05).to(dtype))
    return pool


@pytest.mark.parametrize("family", FAMILIES + EXTRA)
def test_host_expert_equals_the_device_path(root, family):
    """Every family's routed expert on the host, from the pool's bytes, against the same expert computed by the device
    path (the expert's weights in a device slot, Transformer.expert_mlp, times the routing weight): bf16 tolerance."""

    async def go():
        config = EngineConfig(device=DEVICE, dtype="bfloat16", max_context=64, residents=3, cpu_threads=1)
        async with await Runtime.load(checkpoint(family, root), config) as runtime:
            pool, model = runtime.cache.pool, runtime.model
            every = Placement.of([range(pool.num_experts)] * pool.num_layers, pool.num_layers, pool.num_experts)
            host = HostExperts(pool, every, row_bucket=config.row_bucket, mlp=model.expert_mlp, threads=1,
                               device=model.device)
            try:
                generator = torch.Generator().manual_seed(1)
                for layer in range(pool.num_layers):
                    for expert in range(pool.num_experts):
                        rows = torch.randn(5, runtime.spec.hidden_size, generator=generator).to(torch.bfloat16)
                        weights = torch.rand(5, 1, generator=generator).to(torch.bfloat16)
                        on_host = host.compute(layer, expert, rows, weights)
                        packed = pool.host(layer, expert).to(model.device)
                        on_device = model.expert_mlp(rows.to(model.device), packed) * weights.to(model.device)
                        assert on_host.dtype == on_device.dtype == torch.bfloat16 and on_host.device.type == "cpu"
                        torch.testing.assert_close(on_host.float(), on_device.float().cpu(), rtol=1.6e-2, atol=1e-3)
                        reference = swiglu(rows.float(), pool.host(layer, expert).float(), runtime.spec.hidden_size,
                                           runtime.spec.expert_intermediate) * weights.float()
                        torch.testing.assert_close(on_host.float(), reference, rtol=5e-2, atol=5e-3)
            finally:
                host.close()

    asyncio.run(go())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), row=st.data(), scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_a_rows_host_output_does_not_depend_on_the_rows_around_it(rows, row, scale):
    """Row invariance (exact mode's contract, on the host): row r of a batch equals row r computed alone, and alone at
    another place in its block, bit for bit, whatever the other rows hold."""
    hidden, inter = 256, 384
    pool = _POOL()
    host = HostExperts(pool, Placement.device_only(1, 2), row_bucket=16, mlp=functools.partial(swiglu, hidden=hidden, inter=inter),
                       threads=1)
    generator = torch.Generator().manual_seed(rows)
    batch = (torch.randn(rows, hidden, generator=generator) * scale).to(torch.bfloat16)
    weights = torch.rand(rows, 1, generator=generator).to(torch.bfloat16)
    r = row.draw(st.integers(0, rows - 1))
    together = host.compute(0, 1, batch, weights)[r]
    alone = host.compute(0, 1, batch[r : r + 1], weights[r : r + 1])[0]
    neighbours = torch.cat([torch.full((3, hidden), 7.0, dtype=torch.bfloat16), batch[r : r + 1]])
    elsewhere = host.compute(0, 1, neighbours, torch.cat([torch.ones(3, 1, dtype=torch.bfloat16), weights[r : r + 1]]))[3]
    assert torch.equal(together, alone) and torch.equal(alone, elsewhere)


_POOL = functools.cache(random_pool)


def test_host_routes_lists_each_experts_rows_ascending():
    routes = host_routes([[3, 1], [1, 0], [2, 3]], [3, 1, 5])
    assert routes == {1: ([0, 1], [1, 0]), 3: ([0, 2], [0, 1]), 5: ([], [])}


def test_a_layer_runs_on_the_host_thread_with_its_own_thread_count():
    """compute_layer through the host thread: expert outputs in the rows' order (or dense, in place), on the thread
    `specter-host-experts` with cpu_threads torch threads, while the loop thread keeps its own count."""
    hidden, inter = 256, 384
    pool = _POOL()
    seen = {}

    def mlp(rows, packed):
        seen["thread"], seen["threads"] = threading.current_thread().name, torch.get_num_threads()
        return swiglu(rows, packed, hidden, inter)

    async def go():
        kernel = Kernel()
        host = HostExperts(pool, Placement.of([[0, 1]], 1, 2), row_bucket=16, mlp=mlp, threads=2)
        try:
            before = torch.get_num_threads()
            x = torch.randn(4, hidden).to(torch.bfloat16)
            w = torch.rand(4, 2).to(torch.bfloat16)
            routes = host_routes([[0, 1], [1, 0], [0, 1], [1, 0]], [0, 1])
            outputs = await kernel.wait_host(host.start(kernel, 0, routes, HostInputs(x, w)))
            dense = await kernel.wait_host(host.start(kernel, 0, routes, HostInputs(x, w), dense=True))
            assert torch.get_num_threads() == before  # the loop thread's count is untouched
            return x, w, outputs, dense
        finally:
            host.close()
            kernel.close()

    x, w, outputs, dense = asyncio.run(go())
    assert seen["thread"] == "specter-host-experts"
    if per_thread_counts():
        assert seen["threads"] == 2
    alone = HostExperts(pool, Placement.device_only(1, 2), 16, functools.partial(swiglu, hidden=hidden, inter=inter), 1)
    expected = alone.compute(0, 1, x[[0, 1, 2, 3]], w[[0, 1, 2, 3], [1, 0, 1, 0]][:, None])
    assert torch.equal(outputs[1], expected)
    assert torch.equal(dense[1], expected) and dense[0].shape == (4, hidden)


def test_a_cancelled_host_wait_leaves_no_work_behind():
    """A task cancelled while its host job runs: the running job finishes (its result dropped), the queued ones are
    skipped, the thread goes idle, and the next job works."""
    ran = []

    async def go():
        kernel = Kernel()
        thread = HostThread("specter-host-test")
        try:
            release = threading.Event()

            def slow():
                release.wait(5)
                ran.append("slow")
                return 1

            first = kernel.submit_host(thread, slow)
            queued = kernel.submit_host(thread, lambda: ran.append("queued"))
            waiter = asyncio.create_task(kernel.wait_host(first))
            await asyncio.sleep(0.05)
            waiter.cancel()
            queued.cancel()  # its caller left too
            with pytest.raises(asyncio.CancelledError):
                await waiter
            release.set()
            deadline = time.monotonic() + 5
            while not thread.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert thread.idle and ran == ["slow"]
            assert await kernel.wait_host(kernel.submit_host(thread, lambda: 42)) == 42
            with pytest.raises(ZeroDivisionError):
                await kernel.wait_host(kernel.submit_host(thread, lambda: 1 / 0))
        finally:
            thread.stop()
            kernel.close()
        assert not thread.thread.is_alive()

    asyncio.run(go())


def test_a_host_thread_whose_setup_fails_fails_its_jobs_instead_of_hanging():
    """A setup that raises (on CUDA: a device the thread cannot select) reaches every task that awaits a job of that
    thread as the setup's error; none waits forever, and the thread still stops."""

    def setup():
        raise RuntimeError("no such device")

    async def go():
        kernel = Kernel()
        thread = HostThread("specter-host-test", setup=setup)
        try:
            errors = []
            for _ in range(2):
                with pytest.raises(HostThreadSetupError, match="no such device") as raised:
                    await asyncio.wait_for(kernel.wait_host(kernel.submit_host(thread, lambda: 42)), 10)
                errors.append(raised.value)
            assert errors[0] is not errors[1]  # one instance raised per job would pile up every raiser's frames
        finally:
            thread.stop()
            kernel.close()
        assert not thread.thread.is_alive()

    asyncio.run(go())


def test_the_host_thread_selects_the_callers_cuda_device_by_index(monkeypatch):
    """`torch.device("cuda")` names no index, which torch.cuda.set_device refuses: the host thread selects the index
    current on the thread that made it (an explicit index as given)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: chosen.append(index))

    async def go(device):
        kernel = Kernel()
        thread = host_thread(device, 1, name="specter-host-test")
        try:
            assert await asyncio.wait_for(kernel.wait_host(kernel.submit_host(thread, lambda: 7)), 10) == 7
        finally:
            thread.stop()
            kernel.close()

    asyncio.run(go(torch.device("cuda")))
    asyncio.run(go(torch.device("cuda", 1)))
    asyncio.run(go(torch.device("cpu")))
    assert chosen == [3, 1]


def test_parallel_experts_run_on_one_thread_workers_and_give_the_sequential_bits():
    """tuning.host.parallel_experts: a layer's experts go to one-thread workers at once and come back in expert-id
    order, each the same bits as on the host thread alone with one torch thread; a lone expert stays on the host
    thread, also with one thread, so its bits are the workers'."""
    hidden, inter = 256, 384
    pool = random_pool(experts=4)
    seen = []

    def mlp(rows, packed):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return swiglu(rows, packed, hidden, inter)

    x = torch.randn(5, hidden).to(torch.bfloat16)
    w = torch.rand(5, 2).to(torch.bfloat16)
    routes = host_routes([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]], [0, 1, 2, 3])
    lone = host_routes([[0, 1], [0, 2]], [0])

    async def go(parallel: bool, threads: int):
        kernel = Kernel()
        host = HostExperts(pool, Placement.of([[0, 1, 2, 3]], 1, 4), row_bucket=16, mlp=mlp, threads=threads,
                           parallel=parallel)
        try:
            many = await kernel.wait_host(host.start(kernel, 0, routes, HostInputs(x, w)))
            one = await kernel.wait_host(host.start(kernel, 0, lone, HostInputs(x[:2], w[:2])))
            return many, one
        finally:
            host.close()
            kernel.close()

    sequential = asyncio.run(go(False, 1))
    seen.clear()
    parallel = asyncio.run(go(True, 3))
    assert list(parallel[0]) == [0, 1, 2, 3] == sorted(routes)
    assert all(torch.equal(parallel[0][e], sequential[0][e]) for e in routes)
    assert torch.equal(parallel[1][0], sequential[1][0])
    workers = {name for name, _ in seen[:-1]}
    assert workers and all(name.startswith("specter-host-worker") for name in workers), seen  # not the host thread
    assert seen[-1][0] == "specter-host-experts"  # the lone expert, on the host thread
    if per_thread_counts():
        assert all(threads == 1 for _, threads in seen)


def test_with_parallel_experts_the_calibration_times_one_expert_on_one_thread(monkeypatch):
    """Each expert of the parallel host path runs on one thread, so the load times one expert per job on a thread of
    one torch thread (the cost model adds a layer's host experts up: exact for a lone one, an upper bound otherwise)."""
    from specter.experts import costs
    from specter.placement import PlacementState

    hidden, inter = 256, 384
    pool = random_pool(experts=(costs.REPEATS + 1) * 2)
    seen, asked = [], []

    def mlp(rows, packed):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return swiglu(rows, packed, hidden, inter)

    real = costs.time_host_expert

    async def spy(*args, **kwargs):
        asked.append((kwargs["per_job"], kwargs["parallel"]))
        return await real(*args, **kwargs)

    monkeypatch.setattr(costs, "time_host_expert", spy)
    state = PlacementState(num_layers=1, num_experts=pool.num_experts, top_k=2, slots_per_layer=1,
                           initial_residents=((),), expert_bytes=pool.expert_bytes, row_bucket=16, host_threads=2,
                           link_bytes_per_s=1e9)

    async def go(parallel):
        with Kernel() as kernel:
            return await costs.calibrate(kernel, pool, [costs.HostKernel("torch", mlp)], state, hidden, torch.device("cpu"), parallel=parallel)

    assert asyncio.run(go(True)).host_expert_s[16] > 0 and asked == [(1, True)]
    assert {name for name, _ in seen} == {"specter-host-calibration"}
    if per_thread_counts():
        assert {threads for _, threads in seen} == {1}
    asyncio.run(go(False))
    assert asked[1:] == [(2, False), (1, False)]  # top_k a job, then jobs of one (the job's fixed part)


def test_a_runtime_refuses_to_retune_its_host_path(root):
    """tuning.host is fixed when the host path's threads start: `retune` refuses a change instead of recording one the
    path would not follow."""
    from specter.config import TuningConfig
    from specter.errors import ConfigError

    path = checkpoint("mixtral", root)

    async def go():
        config = EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_experts="all", cpu_threads=1)
        async with await Runtime.load(path, config) as runtime:
            runtime.retune(TuningConfig().with_overrides(["cache.lead_relay=false"]))  # a run-time knob: taken
            with pytest.raises(ConfigError, match="tuning.host is fixed"):
                runtime.retune(TuningConfig().with_overrides(["host.parallel_experts=true"]))

    asyncio.run(go())


def test_the_host_and_the_device_path_run_one_expert_function(tiny):
    """The host path runs the family's `expert_mlp` (the engine hands it to HostExperts): on one block of `row_bucket`
    rows it is `swiglu`, bit for bit, and so is what `info` and the calibration time without a model at hand
    (`costs.reference_expert`). The host path's output is that block's, weighted."""
    from specter.build import load_resident
    from specter.experts.costs import reference_expert

    config = EngineConfig(device="cpu", dtype="bfloat16", max_context=32)
    loaded = load_resident(tiny, config)
    model, spec = loaded.model, loaded.spec
    rows = (torch.randn(config.row_bucket, spec.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5).to(torch.bfloat16)
    packed = loaded.experts.expert(spec.moe_layers[0], 1)
    expected = swiglu(rows, packed, spec.hidden_size, spec.expert_intermediate)
    assert torch.equal(model.expert_mlp(rows, packed), expected)
    assert torch.equal(reference_expert(spec.hidden_size, spec.expert_intermediate)(rows, packed), expected)
    assert not torch.equal(swiglu(rows, packed.flip(0), spec.hidden_size, spec.expert_intermediate), expected)