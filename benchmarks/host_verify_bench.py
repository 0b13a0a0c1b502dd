"""Host time of the offloaded verify's expert handling per MoE layer, on the CPU (no GPU needed).

The verify's serial part per MoE layer includes the host's Python between the router's choice and the
last expert launch: choosing victims through the guarded eviction policy, starting and issuing copies,
handing experts out, recording events. This times exactly that code (`compute_hot_first` over an
`ExpertCache` with the engine's guarded policy and use history) on the cpu backend, with a compute that
only records events, so the figure is host overhead alone. Copies are small (the link is not the subject).
`--backend instant`: a backend whose copies and events complete at once and cost nothing (no stream threads), so
the figure is the cache's own Python, as on CUDA where the host only enqueues (less each CUDA call's own cost).

    python benchmarks/host_verify_bench.py --experts 60 --slots 15 --needed 16 --misses 4 --layers 8 --rounds 200
    python benchmarks/host_verify_bench.py --backend instant --experts 128 --slots 19 --needed 59 --misses 40 --layers 48
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=60)
    parser.add_argument("--slots", type=int, default=15)
    parser.add_argument("--needed", type=int, default=16, help="distinct experts the layer's rows choose")
    parser.add_argument("--misses", type=int, default=4, help="of those, how many are not resident")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--eviction", default="lru")
    parser.add_argument("--device-ordered", action=argparse.BooleanOptionalAction, default=True,
                        help="iter_issued (the CUDA path) or iter_ready (host waits for each landing)")
    parser.add_argument("--backend", choices=("cpu", "instant"), default="cpu",
                        help="cpu: the CPU backend (stream threads, real copies); instant: events complete at once")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if not args.misses <= args.needed <= args.experts or args.needed - args.misses > args.slots:
        parser.error("need misses <= needed <= experts and needed - misses <= slots")
    if args.misses > args.slots and not args.device_ordered:
        parser.error("more misses than slots need --device-ordered (the host-waiting path then waits on landings)")
    print(json.dumps(run(args)))


def run(args: argparse.Namespace) -> dict:
    from backends.cpu import CPUBackend
    from specter.engine import UseClock
    from specter.experts import ExpertCache, ExpertPool, TransferEngine
    from specter.kernel import Kernel, run as run_loop
    from specter.plugins import load_policy
    from specter.verify import VerifyRecord, compute_hot_first

    backend = CPUBackend() if args.backend == "cpu" else InstantBackend()
    kernel = Kernel(backend)
    numel = 256
    pool = ExpertPool(backend, args.layers, args.experts, numel, torch.float32)
    pool.load((layer, expert, torch.zeros(numel)) for layer in range(args.layers) for expert in range(args.experts))
    transfer = TransferEngine(backend, kernel, chunk_bytes=numel * 4)
    policy = load_policy("eviction", args.eviction)
    uses = UseClock(args.layers)

    def choose(layer, residents, protected, count):
        return policy.victims(layer=layer, residents=list(residents), protected=frozenset(protected), count=count,
                              history=uses.history(layer), plan=None)

    cache = ExpertCache(backend, kernel, transfer, pool, args.slots, choose)
    rng = random.Random(0)
    stream = backend.compute_stream

    def compute(expert: int, weights: torch.Tensor) -> None:  # the launch only: host overhead is the subject
        backend.record_event(stream)

    async def one_round(samples: list[float] | None) -> None:
        for layer in range(args.layers):
            residents = cache.lru_order(layer)
            hot = rng.sample(residents, min(len(residents), args.needed - args.misses))
            cold = rng.sample([e for e in range(args.experts) if e not in residents], args.needed - len(hot))
            needed = sorted(hot + cold)
            record = VerifyRecord()
            started = time.perf_counter()
            order = await compute_hot_first(cache, kernel, layer, needed, compute, record, on_device=args.device_ordered)
            if samples is not None:
                samples.append(time.perf_counter() - started)
            uses.used(layer, order)
        cache.unprotect_all(backend.record_event(stream))
        await transfer.drain()

    async def bench() -> list[float]:
        for _ in range(10):  # fill the slots, warm up
            await one_round(None)
        samples: list[float] = []
        for _ in range(args.rounds):
            await one_round(samples)
        await cache.aclose()
        await transfer.aclose()
        return samples

    try:
        samples = run_loop(bench())
    finally:
        kernel.close()
        backend.close()
    per_layer_us = [s * 1e6 for s in samples]
    result = {"backend": args.backend, "experts": args.experts, "slots": args.slots, "needed": args.needed, "misses": args.misses,
              "eviction": args.eviction, "device_ordered": args.device_ordered, "layers_timed": len(samples),
              "host_us_per_layer_median": round(statistics.median(per_layer_us), 1),
              "host_us_per_layer_p90": round(sorted(per_layer_us)[int(0.9 * len(per_layer_us))], 1)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


class _Done:
    """An event that has completed (at no cost)."""

    __slots__ = ("stream",)

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def elapsed_since(self, start: object) -> float:
        return 0.0


class InstantBackend:
    """The backend protocol (backends/base.py) with every copy, launch and event done at once and nothing copied:
    what is left of a verify layer's host time is the engine's own Python."""

    name = "instant"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.compute_stream, self.copy_stream = object(), object()

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def alloc_device(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype)

    def new_stream(self, name: str) -> object:
        return object()

    def record_event(self, stream: object, timed: bool = False) -> _Done:
        return _Done(stream)

    def copy_h2d(self, dst, src, stream) -> _Done:
        return _Done(stream)

    def copy_d2h(self, dst, src, stream) -> _Done:
        return _Done(stream)

    def enqueue_h2d(self, dst, src, stream) -> None:
        pass

    def set_int32(self, flat, index: int, value: int, stream) -> None:
        pass

    def stream_wait(self, stream, event) -> None:
        pass

    def stream_sleep(self, stream, seconds: float) -> None:
        pass

    def launch(self, stream, work) -> None:
        work()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()
