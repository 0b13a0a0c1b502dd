"""Each of the draft step's one-row kernels alone at the Qwen1.5-MoE-A2.7B shape, over a grid of tiles (CUDA only).

For every kernel (the q/k/v product with its norm, o_proj with the residual, the FFN input product with the router's
top-k, the experts' gate/up, the finish, RoPE with the KV writes, attention over 16 visible positions) a CUDA graph of
`--layers` launches, each on its own copy of the weights (24 copies: more bytes than L2 holds, as in the step), is
replayed and timed with CUDA events: microseconds per launch and the bytes it reads per second. The step's total
(docs/BENCHMARKS.md) says how long the kernels take together; this says which of them is far from its bytes and
which tiles suit each one, since RowTiles' fields (EngineConfig.tuning.kernels.row) are shared by kernels of different shapes.

    python benchmarks/row_kernels_bench.py --out out/row-kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernel_bench import capture  # noqa: E402  (the same warm-up and capture)
from specter.config import RowTiles  # noqa: E402
from specter.model import fused, rowfused  # noqa: E402
from specter.quant import QuantizedExperts  # noqa: E402

D, HEADS, HEAD_DIM, I, E, A, S, GROUP, CAPACITY, VISIBLE = 2048, 16, 128, 1408, 60, 4, 5632, 128, 512, 16


def bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def experts() -> QuantizedExperts:
    """Random int4 codes and scales in the quantizer's layout (the kernels' speed does not depend on the values)."""
    codes = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")  # noqa: E731
    return QuantizedExperts(w13=codes(E, 2 * I, D // 2), w13_scales=bf16(E, D // GROUP, 2 * I, scale=0.01),
                            w2=codes(E, D, I // 2), w2_scales=bf16(E, I // GROUP, D, scale=0.01), bits=4,
                            w13_group=GROUP, w2_group=GROUP, hidden=D, intermediate=I)  # fmt: skip


@dataclasses.dataclass
class Layer:
    norm: torch.Tensor
    qkv: torch.Tensor
    bias: torch.Tensor
    o_proj: torch.Tensor
    packed: torch.Tensor
    shared_down: torch.Tensor
    experts: QuantizedExperts
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def layers(count: int) -> list[Layer]:
    return [Layer(norm=1 + bf16(D, scale=0.1), qkv=bf16(3 * D, D, scale=D**-0.5), bias=bf16(3 * D),
                  o_proj=bf16(D, D, scale=D**-0.5), packed=bf16(2 * S + E + 1 + 3, D, scale=D**-0.5),
                  shared_down=bf16(D, S, scale=S**-0.5), experts=experts(),
                  k_cache=bf16(HEADS, CAPACITY, HEAD_DIM), v_cache=bf16(HEADS, CAPACITY, HEAD_DIM))
            for _ in range(count)]  # fmt: skip


def kernels(stack: list[Layer]) -> dict[str, tuple[Callable[[Layer, RowTiles], object], int]]:
    """name -> (one launch on a layer with a config, the bytes it reads from its layer's weights)."""
    x, residual = bf16(1, D), bf16(1, D)
    sync, counts = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(E, device="cuda")
    h = bf16(1, D)
    act = bf16(A, I, scale=0.1)
    ids = torch.tensor([3, 17, 29, 41], dtype=torch.int32, device="cuda")
    weights = torch.full((A,), 0.25, device="cuda")
    picks = rowfused.Select.new(E, A, False, sync)  # what the router's launch leaves for gate/up in the step
    picks.ids.copy_(ids)
    picks.weights.copy_(weights)
    shared_act, gate_logit = bf16(1, S, scale=0.1), bf16(1, 1)
    q, k, v = bf16(1, HEADS, HEAD_DIM), bf16(1, HEADS, HEAD_DIM), bf16(1, HEADS, HEAD_DIM)
    angles = torch.arange(CAPACITY, device="cuda")[:, None] * torch.linspace(0, 1, HEAD_DIM, device="cuda")[None, :]
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    position = torch.tensor([VISIBLE - 1], device="cuda")
    int4_row = lambda k_dim: k_dim // 2 + 2 * (k_dim // GROUP)  # noqa: E731  (codes and bf16 scales of one row)
    routed_bytes = A * (2 * I * int4_row(D))
    finish_bytes = A * D * int4_row(I) + D * S * 2

    def ffn_input(layer: Layer, config: RowTiles) -> object:
        select = rowfused.Select.new(E, A, False, sync, counts)
        return rowfused.norm_ffn_input(x, layer.norm, 1e-6, layer.packed, S, E + 1, config, select)

    return {
        "qkv": (lambda layer, config: rowfused.norm_linear(x, layer.norm, 1e-6, layer.qkv, layer.bias, 3 * D, config),
                3 * D * D * 2),
        "o_proj": (lambda layer, config: rowfused.linear_residual(x, layer.o_proj, residual, config), D * D * 2),
        "ffn_input": (ffn_input, (2 * S + E + 1) * D * 2),
        "gate_up": (lambda layer, config: rowfused.moe_gate_up(h, None, layer.experts, A, False, None, config, picks),
                    routed_bytes),
        "finish": (lambda layer, config: rowfused.moe_finish(x, act, ids, weights, layer.experts, shared_act,
                                                             layer.shared_down, gate_logit, config), finish_bytes),
        "rope": (lambda layer, config: fused.rope_and_cache(q, k, v, cos, sin, position, layer.k_cache, layer.v_cache), 0),
        **{f"attention-{splits}": ((lambda splits: lambda layer, config: fused.decode_attention(
            q, layer.k_cache, layer.v_cache, position, None, splits))(splits), 0) for splits in (1, 2, 4)},
    }  # fmt: skip


def time_launches(run: Callable[[Layer, RowTiles], object], stack: list[Layer], config: RowTiles,
                  replays: int) -> float:
    """Microseconds per launch: a graph of one launch per layer, replayed."""
    graph, _ = capture(lambda: [run(layer, config) for layer in stack])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(stack))


SWEEPS: dict[str, list[dict]] = {
    "gemv": [dict(block_n=n, block_k=k, num_warps=w) for n, k, w in itertools.product((2, 4, 8, 16), (512, 1024), (4, 8))]
    + [dict(block_n_residual=n, block_k_residual=k) for n, k in itertools.product((1, 2, 4), (512, 1024, 2048))]
    + [dict(block_n_input=n) for n in (2, 4, 8)],
    "gate_up": [dict(int8_gate_up=False)]
    + [dict(block_n_moe=n, block_k_gate_up=k, warps_moe=w) for n, k, w in itertools.product((8, 16, 32), (512, 1024), (4, 8))],
    "finish": [dict(block_n_finish=n, warps_finish=w, block_k_shared=s) for n, w, s in itertools.product((1, 2, 4, 8), (2, 4, 8), (1024, 2048))],
}  # fmt: skip
SWEEP_OF = {"qkv": "gemv", "o_proj": "gemv", "ffn_input": "gemv", "gate_up": "gate_up", "finish": "finish"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="weight copies (one launch each per replay)")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--kernels", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--no-sweep", action="store_true", help="the default tiles only")
    parser.add_argument("--out", default="out/row-kernels")
    args = parser.parse_args()
    stack = layers(args.layers)
    table = kernels(stack)
    chosen = [name for name in table if not args.kernels or name in args.kernels.split(",")]
    rows = []
    for name in chosen:
        run, nbytes = table[name]
        changes = [{}] + ([] if args.no_sweep else SWEEPS.get(SWEEP_OF.get(name, ""), []))
        for change in changes:
            config = RowTiles(**change)  # the tuning's default tiles with these changed
            try:
                us = time_launches(run, stack, config, args.replays)
            except Exception as error:  # a tile that does not compile or fit: recorded, the sweep goes on
                rows.append(dict(kernel=name, config=change, error=f"{type(error).__name__}: {str(error)[:200]}"))
                continue
            rows.append(dict(kernel=name, config=change, us=us, tb_s=nbytes / us / 1e6 if nbytes else None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "row_kernels.json").write_text(json.dumps(rows, indent=1))
    print(f"{'kernel':<14}{'default us':>11}{'TB/s':>7}{'best us':>9}{'TB/s':>7}  best tiles")
    for name in chosen:
        mine = [row for row in rows if row["kernel"] == name and "us" in row]
        if not mine:
            print(f"{name:<14} every tile failed")
            continue
        default, best = mine[0], min(mine, key=lambda row: row["us"])
        rate = lambda row: f"{row['tb_s']:7.2f}" if row["tb_s"] else f"{'-':>7}"  # noqa: E731
        print(f"{name:<14}{default['us']:11.2f}{rate(default)}{best['us']:9.2f}{rate(best)}  {json.dumps(best['config'])}")


if __name__ == "__main__":
    main()
