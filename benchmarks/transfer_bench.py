"""Transfer-engine benchmark: H2D bandwidth, copy/compute overlap, urgent-miss wait, await cost, link emulation.

Run: python -m benchmarks.transfer_bench --out DIR   (or python benchmarks/transfer_bench.py --out DIR)
Prints a short table last and writes DIR/transfer_bench.json. `--backend cpu --quick` runs anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from specter.experts.transfer import LinkEmulation, TransferEngine
from specter.config import WaitTuning
from specter.kernel import Kernel, run

MiB = 1 << 20
MIXTRAL_EXPERT_BYTES = 3 * 14336 * 4096 * 2  # gate + up + down, bf16: 352 MB


def make_backend(name: str) -> Any:
    if name == "cuda":
        from backends.cuda import CUDABackend

        return CUDABackend()
    from backends.cpu import CPUBackend

    return CPUBackend(link_gbps=4.0)  # a stand-in link so the numbers mean something on a laptop


def buffers(backend: Any, count: int, nbytes: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    sources = [backend.alloc_host(nbytes, torch.uint8).fill_(index % 251) for index in range(count)]
    targets = [backend.alloc_device((nbytes,), torch.uint8) for _ in range(count)]
    return sources, targets


async def engine_gbps(engine: TransferEngine, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    await engine.submit(targets[0], sources[0]).landed()  # warm-up
    started = time.perf_counter()
    for source, target in zip(sources, targets):
        engine.submit(target, source)
    await engine.drain()
    return sum(source.numel() for source in sources) / (time.perf_counter() - started) / 1e9


def bench_h2d(backend: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Expert-size H2D GB/s through the engine, per chunk size."""
    sources, targets = buffers(backend, args.experts, args.expert_bytes)
    results = {}
    for chunk_mib in args.chunks_mib:
        kernel = Kernel(backend)
        engine = TransferEngine(backend, kernel, chunk_bytes=chunk_mib * MiB)

        async def measure() -> float:
            gbps = await engine_gbps(engine, sources, targets)
            await engine.aclose()
            return gbps

        results[f"chunk_{chunk_mib}MiB_gbps"] = run(measure())
        kernel.close()
    return results


def compute_burst(backend: Any, size: int, repeats: int) -> Any:
    """A compute-bound matmul loop on the compute stream; returns its end event."""
    dtype = torch.bfloat16 if backend.name == "cuda" else torch.float32
    a = torch.randn(size, size, device=backend.device, dtype=dtype)

    def work() -> None:
        for _ in range(repeats):
            torch.mm(a, a)

    backend.launch(backend.compute_stream, work)
    return backend.record_event(backend.compute_stream, timed=True)


def bench_overlap(backend: Any, args: argparse.Namespace) -> dict[str, Any]:
    """% of copy time hidden under a compute-bound matmul running concurrently."""
    sources, targets = buffers(backend, args.experts, args.expert_bytes)
    size, repeats = (8192, 40) if backend.name == "cuda" else (512, 40)
    kernel = Kernel(backend)
    engine = TransferEngine(backend, kernel, chunk_bytes=16 * MiB)

    async def timed(copy: bool, compute: bool) -> float:
        started = time.perf_counter()
        end = compute_burst(backend, size, repeats) if compute else None
        if copy:
            for source, target in zip(sources, targets):
                engine.submit(target, source)
            await engine.drain()
        if end is not None:
            await kernel.wait(end)
        return time.perf_counter() - started

    async def measure() -> dict[str, float]:
        await timed(True, True)  # warm-up
        copy_s, compute_s, both_s = await timed(True, False), await timed(False, True), await timed(True, True)
        await engine.aclose()
        hidden = (copy_s + compute_s - both_s) / min(copy_s, compute_s)
        return {"copy_s": copy_s, "compute_s": compute_s, "both_s": both_s, "hidden_pct": 100.0 * min(1.0, max(0.0, hidden))}

    result = run(measure())
    kernel.close()
    return result


def bench_urgent(backend: Any, args: argparse.Namespace) -> dict[str, Any]:
    """An urgent miss behind a full prefetch queue: its wait vs one chunk + its own copy."""
    sources, targets = buffers(backend, args.experts + 1, args.expert_bytes)
    results: dict[str, Any] = {}
    for label, chunk_bytes, window in (("unchunked", args.expert_bytes, 1), ("chunk16_w1", 16 * MiB, 1), ("chunk16_w2", 16 * MiB, 2)):
        kernel = Kernel(backend)
        engine = TransferEngine(backend, kernel, chunk_bytes=chunk_bytes, max_chunks_in_flight=window)

        async def measure() -> dict[str, float]:
            gbps = await engine_gbps(engine, sources[:2], targets[:2])
            for source, target in zip(sources[:-1], targets[:-1]):
                engine.submit(target, source)
            await asyncio.sleep(0.002)
            started = time.perf_counter()
            await engine.submit(targets[-1], sources[-1], urgent=True).landed()
            waited = time.perf_counter() - started
            await engine.drain()
            await engine.aclose()
            bound = (min(chunk_bytes, args.expert_bytes) + args.expert_bytes) / (gbps * 1e9)
            return {"wait_ms": waited * 1e3, "one_chunk_plus_own_ms": bound * 1e3, "queue_ms": args.experts * args.expert_bytes / (gbps * 1e6)}

        results[label] = run(measure())
        kernel.close()
    return results


def bench_await(backend: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Wall and CPU cost of one await of a short GPU event, per completion mechanism."""
    results: dict[str, Any] = {}
    for label, spin_s in [("waiter", 0.0), ("waiter_spin50us", 50e-6)]:
        kernel = Kernel(backend, WaitTuning(spin_s=spin_s))
        try:
            results[label] = run(await_loop(backend, kernel, args.awaits))
        finally:
            kernel.close()
    return results


async def await_loop(backend: Any, kernel: Kernel, count: int) -> dict[str, float]:
    busy_s = 20e-6
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        backend.stream_sleep(backend.compute_stream, busy_s)
        await kernel.wait(backend.record_event(backend.compute_stream))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"overhead_us": (wall / count - busy_s) * 1e6, "cpu_us_per_await": cpu / count * 1e6}


def bench_link(backend: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy of link emulation (host pacing and device sleep) at several GB/s."""
    sources, targets = buffers(backend, args.experts, args.expert_bytes)
    results: dict[str, Any] = {}
    for gbps in args.link_gbps:
        for mode in ("host", "device"):
            kernel = Kernel(backend)
            engine = TransferEngine(backend, kernel, chunk_bytes=16 * MiB, link=LinkEmulation(gbps, mode))

            async def measure() -> float:
                measured = await engine_gbps(engine, sources, targets)
                await engine.aclose()
                return measured

            measured = run(measure())
            kernel.close()
            results[f"{mode}_{gbps:g}"] = {"asked_gbps": gbps, "measured_gbps": measured, "error_pct": 100 * (measured - gbps) / gbps}
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory (or .json path) for the results")
    parser.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--quick", action="store_true", help="small sizes (cpu smoke run)")
    parser.add_argument("--experts", type=int, default=8, help="experts per measurement")
    parser.add_argument("--awaits", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.backend == "auto":
        args.backend = "cuda" if torch.cuda.is_available() else "cpu"
    args.expert_bytes = 4 * MiB if args.quick else MIXTRAL_EXPERT_BYTES
    args.chunks_mib = [1, 4] if args.quick else [4, 16, 64]
    args.link_gbps = [1.0, 2.0] if args.backend == "cpu" else [12.0, 25.0, 32.0]
    args.awaits = min(args.awaits, 200) if args.quick else args.awaits
    args.experts = min(args.experts, 4) if args.quick else args.experts
    return args


def table(results: dict[str, Any]) -> str:
    h2d, overlap, urgent, awaits, link = (results[key] for key in ("h2d", "overlap", "urgent", "await", "link"))
    lines = [f"transfer_bench  backend={results['backend']}  expert={results['expert_bytes'] / 1e6:.0f} MB"]
    lines += [f"  h2d {name:<24} {value:8.2f} GB/s" for name, value in h2d.items()]
    lines.append(f"  overlap hidden             {overlap['hidden_pct']:8.1f} %")
    for name, row in urgent.items():
        lines.append(f"  urgent {name:<19} {row['wait_ms']:8.2f} ms wait (chunk+own {row['one_chunk_plus_own_ms']:.2f}, queue {row['queue_ms']:.1f})")
    for name, row in awaits.items():
        lines.append(f"  await {name:<20} " + ("error: " + row["error"][:50] if "error" in row else f"{row['overhead_us']:8.1f} us, {row['cpu_us_per_await']:.1f} us cpu"))
    for name, row in link.items():
        lines.append(f"  link {name:<21} {row['measured_gbps']:8.2f} GB/s ({row['error_pct']:+.1f} %)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    backend = make_backend(args.backend)
    results: dict[str, Any] = {
        "backend": backend.name,
        "device": torch.cuda.get_device_name() if backend.name == "cuda" else platform.processor() or platform.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.transfer_bench", *(argv or sys.argv[1:])]),
        "expert_bytes": args.expert_bytes,
    }
    for name, bench in (("h2d", bench_h2d), ("overlap", bench_overlap), ("urgent", bench_urgent), ("await", bench_await), ("link", bench_link)):
        results[name] = bench(backend, args)
    backend.close()
    out = Path(args.out)
    path = out if out.suffix == ".json" else out / "transfer_bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
