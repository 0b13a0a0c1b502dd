"""The transfer engine, expert cache and kernel on CUDA (skipped without a GPU): same properties as on cpu."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from specter.experts import ExpertCache, ExpertPool, LinkEmulation, TransferEngine
from specter.kernel import Kernel, run
from specter.experts.slots import lru_victims  # the default chooser: the least recently used unprotected residents

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MiB = 1 << 20
LAYERS, EXPERTS, SLOTS, NUMEL = 2, 8, 3, 4 * MiB // 2  # 4 MiB bf16 experts


@pytest.fixture
def cuda():
    from backends.cuda import CUDABackend

    backend = CUDABackend()
    kernel = Kernel(backend)
    yield backend, kernel
    kernel.close()
    backend.close()


def test_urgent_lands_before_queued_prefetches_on_cuda(cuda):
    backend, kernel = cuda
    engine = TransferEngine(backend, kernel, chunk_bytes=4 * MiB)
    sources = [backend.alloc_host(16 * MiB, torch.uint8).fill_(index) for index in range(7)]
    targets = [backend.alloc_device((16 * MiB,), torch.uint8) for _ in range(7)]
    order: list[str] = []

    async def main() -> None:
        for index in range(6):
            engine.submit(targets[index], sources[index], after_copy=lambda i=index: order.append(f"p{i}"))
        await asyncio.sleep(0)
        urgent = engine.submit(targets[6], sources[6], urgent=True, after_copy=lambda: order.append("u"))
        await urgent.landed()
        await engine.drain()
        await engine.aclose()

    run(main())
    assert order.index("u") <= 1, order
    assert engine.stats.bytes_copied == 7 * 16 * MiB
    assert all(bool((target == index).all()) for index, target in enumerate(targets))


def test_cache_readers_never_see_overwritten_or_unlanded_slots_on_cuda(cuda):
    backend, _ = cuda
    kernel = Kernel(backend)
    pool = ExpertPool(backend, LAYERS, EXPERTS, NUMEL, torch.bfloat16)
    pool.load((l, e, torch.full((NUMEL,), float(l * 16 + e), dtype=torch.bfloat16)) for l in range(LAYERS) for e in range(EXPERTS))
    engine = TransferEngine(backend, kernel, chunk_bytes=MiB)
    cache = ExpertCache(backend, kernel, engine, pool, SLOTS, lru_victims)
    bad_reads = torch.zeros((), dtype=torch.int32, device=backend.device)
    generator = torch.Generator().manual_seed(0)

    def read(layer: int, expert: int, slot: int) -> None:
        with torch.cuda.stream(backend.compute_stream):
            torch.cuda._sleep(200_000)  # a slow reader: an early overwrite would show below
            bad_reads.add_((cache.slot_weights(slot) != float(layer * 16 + expert)).any().int())
        cache.mark_used(layer, expert, backend.record_event(backend.compute_stream))

    async def main() -> None:
        for _ in range(60):
            layer = int(torch.randint(LAYERS, (1,), generator=generator))
            experts = torch.randperm(EXPERTS, generator=generator)[: int(torch.randint(1, 6, (1,), generator=generator))].tolist()
            cache.prefetch(layer, torch.randperm(EXPERTS, generator=generator)[:2].tolist())
            async for expert, slot in cache.iter_ready(layer, experts):
                read(layer, expert, slot)
            assert all(len(cache.lru_order(l)) <= SLOTS for l in range(LAYERS))
        await cache.aclose()
        await engine.aclose()

    run(main())
    backend.synchronize()
    kernel.close()
    assert int(bad_reads) == 0
    total = cache.stats.total()
    assert total.bytes_loaded == engine.stats.bytes_copied == (total.misses + total.prefetched) * pool.expert_bytes
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            slot = cache.lookup(layer, expert)
            assert int(cache.slot_table[layer, expert]) == (-1 if slot is None else slot)


def test_cancelled_reader_leaves_nothing_pinned_on_cuda(cuda):
    backend, kernel = cuda
    pool = ExpertPool(backend, 1, 4, NUMEL, torch.bfloat16)
    pool.load((0, e, torch.full((NUMEL,), float(e), dtype=torch.bfloat16)) for e in range(4))
    engine = TransferEngine(backend, kernel, chunk_bytes=MiB, link=LinkEmulation(2.0))
    cache = ExpertCache(backend, kernel, engine, pool, 3, lru_victims)

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(cache.ensure(0, [0, 1, 2]))
        await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cache.pinned_experts(0) == []
        await cache.aclose()
        await engine.aclose()

    run(main())
    assert cache.lru_order(0) == [0, 1, 2]
    assert all(bool((cache.slot_weights(cache.lookup(0, e)) == float(e)).all()) for e in range(3))


@pytest.mark.parametrize("mode", ["host", "device"])
@pytest.mark.parametrize("gbps", [12.0, 25.0])
def test_link_emulation_is_within_10_percent_on_cuda(cuda, mode, gbps):
    backend, kernel = cuda
    engine = TransferEngine(backend, kernel, chunk_bytes=16 * MiB, link=LinkEmulation(gbps, mode))
    source = backend.alloc_host(256 * MiB, torch.uint8)
    target = backend.alloc_device((256 * MiB,), torch.uint8)

    async def main() -> float:
        await engine.submit(target, source).landed()  # warm-up and raw-bandwidth estimate
        started = time.perf_counter()
        for _ in range(4):
            engine.submit(target, source)
        await engine.drain()
        elapsed = time.perf_counter() - started
        await engine.aclose()
        return 4 * 256 * MiB / elapsed / 1e9

    assert run(main()) == pytest.approx(gbps, rel=0.10)


def test_no_waiter_threads_left_on_cuda(cuda):
    backend, kernel = cuda

    async def main() -> None:
        with torch.cuda.stream(backend.compute_stream):
            torch.cuda._sleep(1_000_000)
        await kernel.wait(backend.record_event(backend.compute_stream))

    run(main())
    kernel.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("specter-waiter")]


@pytest.mark.parametrize("static_verify", [False, True])
def test_an_offloaded_speculative_run_measures_the_copy_stream_busy_fraction(tiny, static_verify):
    """On a slow emulated link the verify stalls; the copy stream must be busy for part (<= all) of those windows."""
    from specter.config import DraftConfig, EngineConfig, GenerationConfig
    from specter.engine import Runtime

    async def go():
        config = EngineConfig(device="cuda", residents=2, link="2", draft=DraftConfig(k=4), lookahead="fixed",
                              static_verify=static_verify)
        runtime = await Runtime.load(tiny, config)
        try:
            return (await runtime.complete_ids([1, 2, 3, 4], GenerationConfig(max_new_tokens=24))).stats
        finally:
            await runtime.aclose()

    stats = asyncio.run(go())
    assert stats.stall_s > 0 and stats.copy_window_s > 0
    assert 0.0 < stats.copy_busy_fraction <= 1.0 + 1e-6
    assert stats.as_dict()["copy_busy_fraction"] == round(stats.copy_busy_fraction, 4)


def test_to_host_reuses_its_pinned_buffer_and_parks_a_cancelled_ones_until_its_copy_landed(cuda):
    """The router read (`verify.to_host`) takes a pinned buffer from a free list and gives it back after the read; a
    call cancelled while its raw copy may still write is parked, and reused only once that copy completed."""
    from specter import verify

    backend, kernel = cuda
    ids = torch.arange(12, device=backend.device, dtype=torch.long).view(3, 4)
    key = ((3, 4), torch.long)

    async def main() -> None:
        verify._PINNED_FREE.pop(key, None)
        assert await verify.to_host(kernel, ids) == ids.tolist()
        (first,) = [buffer.data_ptr() for buffer in verify._PINNED_FREE[key]]
        assert await verify.to_host(kernel, ids + 1) == (ids + 1).tolist()
        assert [b.data_ptr() for b in verify._PINNED_FREE[key]] == [first], "the second read allocated a new pinned buffer"
        torch.cuda._sleep(200_000_000)  # keep the stream busy: the next read cannot land before it is cancelled
        task = asyncio.get_running_loop().create_task(verify.to_host(kernel, ids + 2))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert verify._PINNED_FREE[key] == [] and [entry[1].data_ptr() for entry in verify._PINNED_ABANDONED] == [first]
        torch.cuda.synchronize()
        assert await verify.to_host(kernel, ids + 3) == (ids + 3).tolist()
        assert verify._PINNED_ABANDONED == [], "the parked buffer stayed parked after its copy landed"
        assert [b.data_ptr() for b in verify._PINNED_FREE[key]] == [first], "the parked buffer was not reused"

    run(main())


def test_set_int32_writes_in_stream_order_on_cuda(cuda):
    """The protocol's set_int32 on CUDA (the cache's slot table; the segmented step's int64 expert id through its
    low word): values in stream order, the high word of an int64 left alone."""
    backend, _ = cuda
    table = torch.full((4,), -1, dtype=torch.int32, device=backend.device)
    expert_id = torch.zeros(1, dtype=torch.long, device=backend.device)
    stream = backend.copy_stream
    backend.stream_wait(stream, backend.record_event(backend.compute_stream))  # after the tensors' fills
    backend.stream_sleep(stream, 0.01)  # the writes queue behind this on the device
    for value in (3, 5000, -1, 7):
        backend.set_int32(table, 1, value, stream)
    backend.set_int32(expert_id.view(torch.int32), 0, 37, stream)
    backend.record_event(stream).wait()
    assert table.tolist() == [-1, 7, -1, -1] and expert_id.item() == 37
