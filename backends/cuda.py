"""The cuda backend: torch streams, blocking-sync events and pinned host memory; cupy (when installed) for
host callbacks and raw cudaMemcpyAsync of expert copies.

Tested on the GPU machine only: tests/test_gpu_transfer.py and benchmarks/transfer_bench.py cover it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specter.errors import ConfigError
from specter.log import get_logger

log = get_logger(__name__)


CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


def cupy_memcpy_async() -> Callable[..., None] | None:
    """cupy's cudaMemcpyAsync binding, or None without cupy (torch's copy_ is used then)."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime.memcpyAsync


class CUDAEvent:
    """A torch.cuda.Event recorded with blocking sync, so `wait` sleeps instead of spinning a core."""

    def __init__(self, stream: torch.cuda.Stream, timed: bool) -> None:
        self.stream = stream
        self.event = torch.cuda.Event(enable_timing=timed, blocking=True)
        self.event.record(stream)

    def query(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()  # torch releases the GIL here

    def elapsed_since(self, start: CUDAEvent) -> float:
        return start.event.elapsed_time(self.event) / 1000.0

    def __repr__(self) -> str:
        return f"CUDAEvent(stream={self.stream.cuda_stream:#x})"


class CUDABackend:
    """One CUDA device. `device` is an index or 'cuda:N'."""

    name = "cuda"

    def __init__(self, device: int | str = 0) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("backend 'cuda' needs a CUDA device and a CUDA build of torch; use backend='cpu' instead")
        self.device = torch.device(device if isinstance(device, str) else f"cuda:{device}")
        torch.cuda.set_device(self.device)
        self._streams: list[torch.cuda.Stream] = []
        self.compute_stream = torch.cuda.current_stream(self.device)
        self.copy_stream = self.new_stream("copy")
        self._cycles_per_s: float | None = None
        self._memcpy_async = cupy_memcpy_async()
        self._value_tables: list[torch.Tensor] = []  # pinned int32 -1..n, for set_int32

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def alloc_device(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        stream = torch.cuda.Stream(self.device)
        self._streams.append(stream)
        return stream

    def record_event(self, stream: torch.cuda.Stream, timed: bool = False) -> CUDAEvent:
        return CUDAEvent(stream, timed)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> CUDAEvent:
        self.enqueue_h2d(dst, src, stream)
        return CUDAEvent(stream, timed=False)

    def enqueue_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """`copy_h2d` without its event: the transfer engine records its own per chunk."""
        if not self._raw_copy(dst, src, stream):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

    def set_int32(self, flat: torch.Tensor, index: int, value: int, stream: torch.cuda.Stream) -> None:
        """flat[index] = value in `stream` order: 4 bytes copied from an immutable pinned table of values (with
        cupy; a fill kernel without it)."""
        assert flat.dtype == torch.int32 and value >= -1, "set_int32 writes int32 values >= -1"
        if self._memcpy_async is None or not flat.is_contiguous():
            with torch.cuda.stream(stream):
                flat[index : index + 1].fill_(value)
            return
        source = self._int32_values(value)
        self._memcpy_async(flat.data_ptr() + 4 * index, source, 4, CUDA_MEMCPY_DEFAULT, stream.cuda_stream)

    def _int32_values(self, value: int) -> int:
        """Host address of `value` in a pinned int32 table of -1..n (grown by replacement; old tables stay
        alive, as copies already enqueued may still read them)."""
        table = self._value_tables[-1] if self._value_tables else None
        if table is None or not -1 <= value < table.numel() - 1:
            size = max(1024, 2 * (abs(value) + 2))
            table = torch.arange(-1, size - 1, dtype=torch.int32).pin_memory()
            self._value_tables.append(table)
        return table.data_ptr() + 4 * (value + 1)

    def _raw_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> bool:
        """One cudaMemcpyAsync through cupy when both sides are contiguous and alike, one on this device and the
        other on the host (pinned pool -> slot, router ids -> pinned buffer): a few microseconds of host time
        instead of torch's stream switch and dispatch. False: not taken."""
        memcpy = self._memcpy_async
        if memcpy is None or dst.dtype != src.dtype or dst.numel() != src.numel():
            return False
        if not (dst.is_contiguous() and src.is_contiguous()):
            return False
        if not ((dst.device == self.device and src.device.type == "cpu") or (src.device == self.device and dst.device.type == "cpu")):
            return False
        memcpy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
        return True

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> CUDAEvent:
        """dst (pinned host) <- src (device) in `stream` order. With cupy and both sides contiguous and alike, one raw
        cudaMemcpyAsync: the caller must then keep `dst` alive until the returned event completes (torch's host
        allocator does not know of the copy). `dst` is not checked for being pinned (a driver query per call): a
        pageable one would still be correct, only synchronous."""
        if not self._raw_copy(dst, src, stream):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        return CUDAEvent(stream, timed=False)

    def stream_wait(self, stream: torch.cuda.Stream, event: CUDAEvent) -> None:
        stream.wait_event(event.event)

    def stream_sleep(self, stream: torch.cuda.Stream, seconds: float) -> None:
        cycles = int(seconds * self.cycles_per_s())
        if cycles > 0:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)  # a 1-thread spin kernel: keeps the stream busy, not the link

    def cycles_per_s(self) -> float:
        """GPU clock for `torch.cuda._sleep`, measured once (the nominal clock_rate ignores boost)."""
        if self._cycles_per_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # warm-up: clocks ramp
            start.record()
            torch.cuda._sleep(50_000_000)
            end.record()
            end.synchronize()
            self._cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1000.0)
            log.debug("cuda.sleep_calibrated", cycles_per_s=self._cycles_per_s)
        return self._cycles_per_s

    def launch(self, stream: torch.cuda.Stream, work: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            work()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()


def measure_h2d_gbps(backend: CUDABackend, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Raw pinned H2D bandwidth of `backend.copy_stream` (no engine, no emulation), in GB/s."""
    src = backend.alloc_host(nbytes, torch.uint8)
    dst = backend.alloc_device((nbytes,), torch.uint8)
    backend.copy_h2d(dst, src, backend.copy_stream).wait()
    start = backend.record_event(backend.copy_stream, timed=True)
    for _ in range(repeats):
        backend.copy_h2d(dst, src, backend.copy_stream)
    end = backend.record_event(backend.copy_stream, timed=True)
    end.wait()
    return nbytes * repeats / end.elapsed_since(start) / 1e9
