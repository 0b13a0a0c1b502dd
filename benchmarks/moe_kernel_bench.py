"""Times the draft's fused int4 MoE (Triton) against per-expert torch tinygemm calls and the HBM floor.

Run on the GPU machine: `python benchmarks/moe_kernel_bench.py --out DIR` (add `--quick` to skip the
tile sweep). Shapes: Qwen1.5-MoE-A2.7B experts (D=2048, I=1408, E=60, A=4) and Mixtral-8x7B experts
(D=4096, I=14336, E=8, A=2), T in {1, 4, 8, 16} tokens. Every timing is a CUDA-graph replay measured
with CUDA events, L2 flushed before each repeat (Qwen's 4 active experts, ~17 MB, would otherwise sit
in the 50 MB L2), median over repeats and over several random route sets.

Baseline (a): for each selected expert, torch.ops.aten._weight_int4pack_mm (tinygemm) for gate/up and for
down, with the routing known on the host (the draft cannot know it without a sync: this favours the
baseline). Weights packed by torch.ops.aten._convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles),
scales and zeros [K/group, N, 2] bf16, dequant (q - 8) * scale + zero; our mid-rise levels map exactly with
zero = scale / 2. Floor (b): distinct active experts x bytes per expert / 3.3e12 B/s.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specter.quant import QuantizedExperts, moe_forward, quantize_experts  # noqa: E402
from specter.quant.groupwise import dequantize_packed  # noqa: E402
from specter.config import MoETiles  # noqa: E402
from specter.quant.moe_triton import fused_moe_triton  # noqa: E402

HBM_BYTES_PER_S = 3.3e12
GROUP = 128
INNER_K_TILES = 8
SHAPES = {
    "qwen1.5-moe-a2.7b": dict(hidden=2048, intermediate=1408, experts=60, active=4),
    "mixtral-8x7b": dict(hidden=4096, intermediate=14336, experts=8, active=2),
}
TOKENS = (1, 4, 8, 16)
ROUTE_SETS = 8
SWEEP = [  # the general kernel's tiles with the default split-K, then the down GEMM's parts by hand on the default tiles
    *(MoETiles(block_n_gate_up=bn, block_n_down=bn, block_k=bk, num_warps=warps, num_stages=3,
                      single_token_gemv=False) for bn in (16, 32, 64) for bk in (64, 128) for warps in (2, 4)),
    *(MoETiles(split_k_down=down, single_token_gemv=False) for down in (1, 3, 4, 8)),
]
NO_SPLIT = MoETiles(split_k_down=1, single_token_gemv=False)  # the kernel before split-K (2026-11-29's figures)
GEMM = MoETiles(single_token_gemv=False)  # one token through the general (route + 16-row tile) kernels
GEMV_SWEEP = [  # K steps of 1-4 groups (a scale per group), gate/up in 1-4 K parts, down in 2 or 4
    *(MoETiles(block_n_gemv=bn, block_k_gemv=bk, num_warps=warps, split_k_gemv_gate_up=parts)
      for bn in (16, 32) for bk in (128, 256, 512) for warps in (4, 8) for parts in (1, 2, 4)),
    *(MoETiles(block_k_gemv=bk, split_k_gemv_gate_up=parts, split_k_down=4) for bk in (128, 256) for parts in (2, 4)),
]


# ---------------------------------------------------------------------------------------------------------
# set-up


def make_layer(hidden: int, intermediate: int, experts: int) -> QuantizedExperts:
    """Random bf16 experts quantized to int4 one at a time (keeps Mixtral's fp32 temporaries small)."""
    parts = []
    for _ in range(experts):
        new = functools.partial(torch.randn, device="cuda", dtype=torch.bfloat16)
        gate, up = (new(1, intermediate, hidden) / hidden**0.5 for _ in range(2))
        down = new(1, hidden, intermediate) / intermediate**0.5
        parts.append(quantize_experts(gate, up, down, bits=4, group=GROUP))
    return QuantizedExperts(
        torch.cat([p.w13 for p in parts]), torch.cat([p.w13_scales for p in parts]),
        torch.cat([p.w2 for p in parts]), torch.cat([p.w2_scales for p in parts]),
        bits=4, w13_group=GROUP, w2_group=GROUP, hidden=hidden, intermediate=intermediate,
    )  # fmt: skip


def make_routes(tokens: int, active: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(active, dim=-1)
    return ids, weights


def to_tinygemm(packed: torch.Tensor, scales: torch.Tensor, swap_nibbles: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [N, K/2] uint8 (even k low) + [G, N] scales -> tinygemm's packed weight and [G, N, 2] scales/zeros."""
    torch_order = ((packed & 0xF) << 4) | (packed >> 4) if swap_nibbles else packed  # torch: even k high
    weight = torch.ops.aten._convert_weight_to_int4pack(torch_order.contiguous(), INNER_K_TILES)
    scales_zeros = torch.stack([scales, scales / 2], dim=-1).to(torch.bfloat16).contiguous()
    return weight, scales_zeros


def tinygemm_layer(qe: QuantizedExperts, swap_nibbles: bool) -> list[tuple[torch.Tensor, ...]]:
    layer = []
    for e in range(qe.num_experts):
        w13, sz13 = to_tinygemm(qe.w13[e], qe.w13_scales[e], swap_nibbles)
        w2, sz2 = to_tinygemm(qe.w2[e], qe.w2_scales[e], swap_nibbles)
        layer.append((w13, sz13, w2, sz2))
    return layer


Plan = list[tuple[int, int, float]]  # (expert, token row, routing weight)


def tinygemm_moe(x: torch.Tensor, plan: Plan, layer: list, inter: int) -> torch.Tensor:
    """Per selected (token, expert) pair: two tinygemm calls on that token's row (host-known routing)."""
    rows = [torch.zeros(1, x.shape[1], device=x.device, dtype=torch.float32) for _ in range(x.shape[0])]
    for expert, token, weight in plan:
        w13, sz13, w2, sz2 = layer[expert]
        gate_up = torch.ops.aten._weight_int4pack_mm(x[token : token + 1], w13, GROUP, sz13)
        hidden_act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        rows[token] = rows[token] + torch.ops.aten._weight_int4pack_mm(hidden_act, w2, GROUP, sz2).float() * weight
    return torch.cat(rows).to(x.dtype)


def host_plan(ids: torch.Tensor, weights: torch.Tensor) -> Plan:
    """(expert, token row, routing weight) per pair, ascending expert id (set-up time: syncs are fine)."""
    ids_host, weights_host = ids.cpu().tolist(), weights.float().cpu().tolist()
    pairs = [(e, t, weights_host[t][a]) for t, chosen in enumerate(ids_host) for a, e in enumerate(chosen)]
    return sorted(pairs)


# ---------------------------------------------------------------------------------------------------------
# timing


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def median_us(runs: list[Callable[[], None]], flush: torch.Tensor, repeats: int) -> float:
    """Median GPU time of runs[r % len(runs)] over repeats, L2 flushed before each (flush not timed)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for _ in range(5):
        runs[0]()
    for r in range(repeats):
        flush.zero_()
        starts[r].record()
        runs[r % len(runs)]()
        ends[r].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def triton_graphs(qe: QuantizedExperts, x: torch.Tensor, routes: list, config: MoETiles) -> list[Callable]:
    runs = []
    for ids, weights in routes:
        graph, _ = capture(lambda ids=ids, weights=weights: fused_moe_triton(x, ids, weights, qe, config))
        runs.append(graph.replay)
    return runs


def bench_triton(qe, x, routes, flush, repeats, sweep: bool, gemv_only: bool = False) -> dict:
    default = MoETiles()
    result = {"triton_us": median_us(triton_graphs(qe, x, routes, default), flush, repeats)}
    result["triton_no_split_us"] = median_us(triton_graphs(qe, x, routes, NO_SPLIT), flush, repeats)
    if x.shape[0] == 1:  # the default is the GEMV here: the general kernels alone
        result["triton_gemm_us"] = median_us(triton_graphs(qe, x, routes, GEMM), flush, repeats)
    ids, weights = routes[0]
    result["triton_eager_us"] = median_us([lambda: fused_moe_triton(x, ids, weights, qe, default)], flush, repeats)
    if sweep:
        timed = []
        for config in (([] if gemv_only else SWEEP) + GEMV_SWEEP) if x.shape[0] == 1 else SWEEP:
            try:
                timed.append((median_us(triton_graphs(qe, x, routes[:2], config), flush, repeats // 2), config))
            except Exception as error:  # e.g. triton's OutOfResources: tiles too large for shared memory
                print(f"skipped {config}: {type(error).__name__}", file=sys.stderr)
                torch.cuda.synchronize()
        if not timed:
            return result
        best = min(timed, key=lambda pair: pair[0])
        result.update(triton_best_us=best[0], triton_best_config=best[1].model_dump(),
                      triton_sweep=[dict(us=us, **config.model_dump()) for us, config in timed])  # fmt: skip
    return result


def bench_tinygemm(qe, layer, x, routes, flush, repeats) -> dict:
    runs = []
    for ids, weights in routes:
        plan = host_plan(ids, weights)
        graph, _ = capture(lambda plan=plan: tinygemm_moe(x, plan, layer, qe.intermediate))
        runs.append(graph.replay)
    return {"tinygemm_us": median_us(runs, flush, repeats)}


def floor_us(qe: QuantizedExperts, routes: list) -> float:
    distinct = [len(set(ids.flatten().tolist())) for ids, _ in routes]
    return statistics.median(distinct) * qe.bytes_per_expert / HBM_BYTES_PER_S * 1e6


# ---------------------------------------------------------------------------------------------------------
# checks and main


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


def check_tinygemm(qe: QuantizedExperts) -> tuple[list | None, dict]:
    """Find the nibble order that makes tinygemm reproduce our dequantized weights; None if unusable."""
    x = torch.randn(4, qe.hidden, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_packed(qe.w13[0], qe.w13_scales[0], 4, GROUP, qe.hidden).T
    info: dict = {}
    try:
        for swap in (True, False):
            w13, sz13 = to_tinygemm(qe.w13[0], qe.w13_scales[0], swap)
            error = relative_error(torch.ops.aten._weight_int4pack_mm(x, w13, GROUP, sz13), expected)
            info[f"rel_error_swap_nibbles_{swap}"] = error
            if error < 2e-2:
                info["swap_nibbles"] = swap
                return tinygemm_layer(qe, swap), info
    except (RuntimeError, AttributeError) as exc:  # op missing on this build/arch: report it
        info["unavailable"] = repr(exc)[:300]
        return None, info
    info["unavailable"] = "no nibble order reproduces our weights"
    return None, info


def bench_shape(name: str, shape: dict, repeats: int, sweep: bool, flush: torch.Tensor,
                tokens_list: tuple[int, ...] = TOKENS, gemv_only: bool = False) -> list[dict]:
    qe = make_layer(shape["hidden"], shape["intermediate"], shape["experts"])
    layer, tinygemm_info = check_tinygemm(qe)
    rows = []
    for tokens in tokens_list:
        routes = [make_routes(tokens, shape["active"], shape["experts"], seed) for seed in range(ROUTE_SETS)]
        x = torch.randn(tokens, shape["hidden"], device="cuda", dtype=torch.bfloat16)
        row = dict(shape=name, tokens=tokens, **shape, bytes_per_expert=qe.bytes_per_expert)
        row["floor_us"] = floor_us(qe, routes)
        if tokens <= 4:  # the torch path dequantizes one expert copy per pair: large at Mixtral size
            ids, weights = routes[0]
            kernel_out, torch_out = fused_moe_triton(x, ids, weights, qe), moe_forward(x, ids, weights, qe)
            row["rel_error_vs_torch_path"] = relative_error(kernel_out, torch_out)
            if tokens == 1:
                row["gemm_rel_error_vs_torch_path"] = relative_error(fused_moe_triton(x, ids, weights, qe, GEMM), torch_out)
        row.update(bench_triton(qe, x, routes, flush, repeats, sweep, gemv_only))
        if layer is not None:
            row.update(bench_tinygemm(qe, layer, x, routes, flush, repeats))
        row["tinygemm"] = tinygemm_info
        rows.append(row)
        print(f"done {name} T={tokens}", file=sys.stderr, flush=True)
    del qe, layer
    torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'shape':<20}{'T':>3}{'floor us':>10}{'triton us':>11}{'no split':>10}{'gemm':>8}{'best us':>9}{'tinygemm us':>13}"
    print(header + f"{'floor/triton':>14}  best config")
    for r in rows:
        best = r.get("triton_best_us", float("nan"))
        tiny = r.get("tinygemm_us", float("nan"))
        config = ",".join(str(v) for v in r.get("triton_best_config", {}).values())
        print(f"{r['shape']:<20}{r['tokens']:>3}{r['floor_us']:>10.1f}{r['triton_us']:>11.1f}{r['triton_no_split_us']:>10.1f}"
              f"{r.get('triton_gemm_us', float('nan')):>8.1f}"
              f"{best:>9.1f}{tiny:>13.1f}{r['floor_us'] / r['triton_us']:>14.2f}  {config}")  # fmt: skip
    for r in rows:  # the fastest one-token GEMV configs
        gemv = sorted((e for e in r.get("triton_sweep", []) if r["tokens"] == 1 and e["single_token_gemv"]), key=lambda e: e["us"])
        for e in gemv[:8]:
            print(f"  gemv {r['shape']} {e['us']:6.1f} us  bn {e['block_n_gemv']} bk {e['block_k_gemv']} warps {e['num_warps']} "
                  f"gate/up parts {e['split_k_gemv_gate_up']} down parts {e['split_k_down']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for moe_kernel_bench.json")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="skip the tile-size sweep")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS), help="token counts to time")
    parser.add_argument("--gemv-only", action="store_true", help="at one token, sweep the GEMV's configs only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernel_bench needs a CUDA GPU")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MB > L2
    rows = [row for name in args.shapes
            for row in bench_shape(name, SHAPES[name], args.repeats, not args.quick, flush, tuple(args.tokens),
                                   args.gemv_only)]
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                command=" ".join(sys.argv), hbm_bytes_per_s=HBM_BYTES_PER_S, group=GROUP)  # fmt: skip
    import triton

    meta["triton"] = triton.__version__
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_kernel_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print_table(rows)


if __name__ == "__main__":
    main()
