"""Seconds for the host CPU to compute one routed expert (the host expert path, specter/experts/host.py) by rows and
torch threads, at a real shape, against the time the same expert takes to cross the link: what a placement weighs.

    python benchmarks/host_expert.py [SHAPE] [ROWS] [THREADS] [REPEATS]
    python benchmarks/host_expert.py mixtral-8x7b 1,4,16 1,8,16 5

SHAPE is a name of specter.bench.synthetic.SHAPES (hidden and expert width of the real model), ROWS and THREADS comma
lists. The expert runs on the host thread as the engine runs it: bf16 weights from pinned memory when CUDA is present
(else plain), blocks of 16 rows, its own torch thread count; one warm-up, then the median of REPEATS. Prints one line
per (threads, rows) and a JSON line at the end.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from specter.bench.synthetic import SHAPES, shape_config
from specter.config import LINK_PRESETS
from specter.experts.host import HostExperts
from specter.experts.pool import ExpertPool
from specter.kernel import Kernel, run
from specter.model.weights import unpack_expert
from specter.placement import Placement


class HostMemory:
    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


def swiglu(hidden: int, inter: int):
    def mlp(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        w13, w2 = unpack_expert(packed, hidden, inter)
        gate_up = torch.nn.functional.linear(rows, w13)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2)
    return mlp


async def time_expert(shape: str, rows_list: list[int], threads_list: list[int], repeats: int) -> list[dict]:
    config = shape_config(shape)
    hidden, inter = config["hidden_size"], config.get("moe_intermediate_size") or config["intermediate_size"]
    pool = ExpertPool(HostMemory(), 1, 1, 3 * hidden * inter, torch.bfloat16)
    pool.write(0, 0, (torch.randn(3 * hidden * inter) * 0.02).to(torch.bfloat16))
    expert_bytes = pool.expert_bytes
    kernel, results = Kernel(), []
    try:
        for threads in threads_list:
            host = HostExperts(pool, Placement.of([[0]], 1, 1), row_bucket=16, threads=threads)
            try:
                for rows in rows_list:
                    x = torch.randn(rows, hidden).to(torch.bfloat16)
                    w = torch.ones(rows, 1, dtype=torch.bfloat16)
                    work = lambda: host.compute(0, 0, x, w, swiglu(hidden, inter))  # noqa: E731
                    await kernel.wait_host(kernel.submit_host(host.thread, work))  # warm-up
                    seconds = []
                    for _ in range(repeats):
                        started = time.perf_counter()
                        await kernel.wait_host(kernel.submit_host(host.thread, work))
                        seconds.append(time.perf_counter() - started)
                    median = statistics.median(seconds)
                    links = {name: expert_bytes / (gbps * 1e9) for name, gbps in LINK_PRESETS.items()}
                    results.append({"shape": shape, "threads": threads, "rows": rows, "host_s": median, "expert_bytes": expert_bytes,
                                    "copy_s": links})
                    print(f"{shape} threads={threads:>3} rows={rows:>3}: host {median * 1e3:8.2f} ms; copy "
                          + ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in links.items()), flush=True)
            finally:
                host.close()
    finally:
        kernel.close()
    return results


if __name__ == "__main__":
    shape = sys.argv[1] if len(sys.argv) > 1 else "mixtral-8x7b"
    assert shape in SHAPES, f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}"
    rows = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16").split(",")]
    threads = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else str(torch.get_num_threads())).split(",")]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    print(json.dumps(run(time_expert(shape, rows, threads, repeats))))
