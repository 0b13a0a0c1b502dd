"""Graphed resident decoding and the graphed draft step (CUDA graphs, batch 1) on a real-shape MoE with synthetic weights.

Reports the graphed resident TPOT against the HBM floor (bytes of active weights read per token over 3.3 TB/s),
the 16-row verify step, and the int4 draft step against its floor (active int4 experts + bf16 non-expert
weights), next to the eager paths, in one run.

    python benchmarks/graphed_tpot.py --shape qwen1.5-moe-a2.7b --out out/graphed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resident_tpot import HBM_BYTES_PER_S, SHAPES, active_bytes, build_hf  # noqa: E402  (the same model construction)

DEVICE = "cuda"
FUSED_FLAGS = ("merge_in_launch", "row_kernels", "decode_attention", "router_and_gate", "rope_writes_cache", "packed_qkv",
               "packed_ffn_input", "residual_addend")  # KernelTuning's fused paths of the non-exact forward


def gpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Mean wall time of fn over `repeats` calls, GPU-synchronised at both ends (fn itself never syncs)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def dense_read_bytes(model) -> int:
    """Non-expert weights one token reads: everything except the embedding table, plus one embedding row."""
    weights = model.w
    table = weights["model.embed_tokens.weight"]
    rest = sum(t.numel() * t.element_size() for name, t in weights.items() if name != "model.embed_tokens.weight")
    return rest + table.shape[1] * table.element_size()


def draft_floor_bytes(runtime) -> int:
    spec, layers = runtime.spec, runtime.draft.experts.layers
    return dense_read_bytes(runtime.model) + sum(spec.top_k * layers[layer].bytes_per_expert for layer in spec.moe_layers)


async def build_runtime(config_dict: dict, state: dict, max_context: int):
    from specter.config import DraftConfig, EngineConfig
    from specter.engine import CheckpointWeights, Runtime
    from specter.model.checkpoint import InMemoryCheckpoint

    source = CheckpointWeights(InMemoryCheckpoint(config_dict, state))
    config = EngineConfig(device=DEVICE, dtype="bfloat16", exact=True, max_context=max_context, lookahead="fixed", draft=DraftConfig(k=8))
    return await Runtime.build(source, config)


def target_rows(runtime, prompt: list[int], tokens: int, eager_tokens: int) -> tuple[dict, dict]:
    """Graphed resident decoding (sync-free and with one host read per token), 16-row verify, eager for reference."""
    from specter.decode import decode_resident_graphed, prefill
    from specter.model.graphed import GraphedTarget

    model, experts = runtime.model, runtime.experts
    kv = model.new_kv()
    target = GraphedTarget(model, experts, kv)
    x0 = asyncio.run(prefill(model, kv, experts, prompt)).argmax(dim=-1, keepdim=True)
    position = len(prompt)

    def decode_step() -> torch.Tensor:
        return target.logits(x0, position).argmax(dim=-1)  # rewrites one scratch position: same work per step

    block = torch.arange(100, 100 + target.rows, device=DEVICE)
    step_s = gpu_seconds(decode_step, tokens)
    synced_s = gpu_seconds(lambda: int(decode_step()[0]), tokens)  # what an engine round with k = 0 pays
    verify_s = gpu_seconds(lambda: target.logits(block, position), max(4, tokens // 4))
    floor_s = active_bytes(runtime) / HBM_BYTES_PER_S
    graphed = asyncio.run(decode_resident_graphed(model, experts, prompt, eager_tokens))
    eager_s, eager = eager_tpot(model, experts, prompt, eager_tokens)
    agree = next((i for i, (a, b) in enumerate(zip(graphed, eager)) if a != b), len(eager))
    rows = {
        "graphed-resident": {"ms": step_s * 1e3, "floor_ms": floor_s * 1e3, "ratio": step_s / floor_s},
        "graphed-resident+sync": {"ms": synced_s * 1e3, "floor_ms": floor_s * 1e3, "ratio": synced_s / floor_s},
        f"graphed-verify-{target.rows}rows": {"ms": verify_s * 1e3, "floor_ms": None, "ratio": None},
        "eager-exact": {"ms": eager_s * 1e3, "floor_ms": floor_s * 1e3, "ratio": eager_s / floor_s},
    }
    return rows, {"tokens_compared": eager_tokens, "identical_prefix": agree}


def eager_tpot(model, experts, prompt: list[int], count: int) -> tuple[float, list[int]]:
    """The eager exact path's TPOT (prefill and first token excluded) and its `count` greedy tokens."""
    from specter.decode import greedy_decode

    def timed(tokens: int) -> tuple[float, list[int]]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = asyncio.run(greedy_decode(model, experts, prompt, tokens))
        return time.perf_counter() - started, out

    timed(2)  # warm-up
    one_s, _ = timed(1)
    all_s, tokens = timed(count)
    return (all_s - one_s) / (count - 1), tokens


def draft_rows(runtime, prompt: list[int], k: int, repeats: int, graphed_splits: tuple[int, ...] = (0,),
               profile_out: str | None = None, router_ab: bool = False, ab: bool = False,
               kv_write_ab: bool = False, without: Sequence[str] = (), moe_configs: Sequence[dict] = (),
               row_configs: Sequence[dict] = (), profile_row: dict | None = None,
               positions_per_split: Sequence[int] = ()) -> dict:
    """The int4 draft's per-step time, graphed (k replays, no host sync) and eager, against its byte floor."""
    from specter.decode import prefill
    from specter.draft import Draft, DraftExperts
    from specter.sampling import SamplingParams

    kv = runtime.model.new_kv()
    asyncio.run(prefill(runtime.model, kv, runtime.experts, prompt))
    x0 = torch.tensor([7], device=DEVICE)
    floor_s = draft_floor_bytes(runtime) / HBM_BYTES_PER_S
    rows = {}

    async def seconds_per_round(draft: Draft) -> float:
        await draft.propose(x0, len(prompt), k, kv, SamplingParams())  # warm-up (captures the graphs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            await draft.propose(x0, len(prompt), k, kv, SamplingParams())
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    spec, layers = runtime.spec, runtime.draft.experts.layers

    def tuned_draft(static: bool, moe: dict | None = None, row: dict | None = None, **fields: object) -> Draft:
        """A draft over the runtime's target and quantized experts whose EngineConfig.tuning.kernels is the runtime's
        with the named fields set and the fused MoE's tiles (kernels.moe) and one-row kernels' (kernels.row) changed."""
        overrides = [f"kernels.{name}={json.dumps(value)}" for name, value in fields.items()]
        overrides += [f"kernels.{section}.{name}={json.dumps(value)}"
                      for section, changes in (("moe", moe), ("row", row)) for name, value in (changes or {}).items()]
        kernels = runtime.config.tuning.with_overrides(overrides).kernels
        experts = DraftExperts(layers, spec.num_layers, spec.num_experts, runtime.model.device, tiles=kernels.moe)
        return Draft(runtime.model, experts, static=static, kernels=kernels)

    def measure(name: str, static: bool = True, moe: dict | None = None, row: dict | None = None, **fields: object) -> None:
        """One row: the step of a draft built with these kernel fields and tiles (see `tuned_draft`)."""
        step_s = asyncio.run(seconds_per_round(tuned_draft(static, moe, row, **fields))) / k
        rows[name] = {"ms": step_s * 1e3, "floor_ms": floor_s * 1e3, "ratio": step_s / floor_s}

    for split in graphed_splits:  # the fused MoE's down GEMM in this many K parts (0: its default)
        measure("draft-int4-graphed" + (f"-split{split}" if split else ""), moe=dict(split_k_down=split) if split else None)
    measure("draft-int4-eager", static=False)
    if ab:  # each default kernel choice undone alone: the general MoE kernels, attention over the whole cache
        measure("draft-int4-graphed-no-gemv", moe=dict(single_token_gemv=False))
        measure("draft-int4-graphed-no-attention", decode_attention=False)
        measure("draft-int4-graphed-neither", moe=dict(single_token_gemv=False), decode_attention=False)
    if kv_write_ab:  # the rotation and the KV writes in one launch (fused.rope_and_cache), against the default
        measure("draft-int4-graphed-rope-cache", rope_writes_cache=not runtime.config.tuning.kernels.rope_writes_cache)
    if router_ab:  # torch's router and shared gate instead of the fused ones
        measure("draft-int4-graphed-torch-router", router_and_gate=False)
    for index, changes in enumerate(moe_configs):  # the draft MoE's kernel with these config fields changed
        measure(f"draft-int4-graphed-moe{index}", moe=changes)
    for index, changes in enumerate(row_configs):  # the one-row kernels (specter.model.rowfused) with these tiles
        measure(f"draft-int4-graphed-row{index}", row=changes)
    for positions in positions_per_split:  # decode_attention's runs of this many cache positions
        measure(f"draft-int4-graphed-split-positions{positions}", positions_per_split=positions)
    for flag in without:  # each fused path off alone, then all of them at once
        measure(f"draft-int4-graphed-no-{flag.replace('_', '-')}", **{flag: False})
    if len(without) > 1:
        measure("draft-int4-graphed-none-of-them", **{flag: False for flag in without})
    if profile_out is not None:  # where the graphed draft step's time goes, kernel by kernel (one proposal)
        from torch.profiler import ProfilerActivity, profile

        profiled = tuned_draft(True, row=profile_row)  # the profiled tiles
        asyncio.run(seconds_per_round(profiled))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            asyncio.run(profiled.propose(x0, len(prompt), k, kv, SamplingParams()))
            torch.cuda.synchronize()
        averages = prof.key_averages()
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                table = averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
                break
            except (AttributeError, KeyError, ValueError):
                continue
        Path(profile_out).write_text(f"one graphed proposal of k={k} draft steps\n{table}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen1.5-moe-a2.7b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="truncate depth (labelled in the output)")
    parser.add_argument("--tokens", type=int, default=64, help="timed graphed decode steps")
    parser.add_argument("--eager-tokens", type=int, default=8, help="tokens of the eager exact reference (slow; >= 2)")
    parser.add_argument("--k", type=int, default=8, help="draft steps per timed proposal")
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--out", default="out/graphed")
    parser.add_argument("--draft-splits", default="0", help="K parts of the draft's fused MoE down GEMM to time the "
                        "graphed draft step with, comma-separated (0: the default; 1: no split)")
    parser.add_argument("--draft-only", action="store_true", help="skip the target's rows")
    parser.add_argument("--profile-draft", default=None, help="write a kernel table of one graphed proposal here")
    parser.add_argument("--router-ab", action="store_true", help="also time the graphed draft step with torch's router and gate")
    parser.add_argument("--ab", action="store_true", help="also time the graphed draft step without the one-token GEMV "
                        "MoE, without the fused decode attention, and without both")
    parser.add_argument("--kv-write", action="store_true", help="also time the step with KernelTuning.rope_writes_cache "
                        "switched (RoPE and the KV writes in one launch)")
    parser.add_argument("--without", default="", help="KernelTuning fields (EngineConfig.tuning.kernels: "
                        + ", ".join(FUSED_FLAGS) + ") to time the graphed draft step without, each alone and, with several, all at once")
    parser.add_argument("--moe-config", action="append", default=[], help="a JSON object of MoETiles fields "
                        "(EngineConfig.tuning.kernels.moe): also time the graphed draft step with them (rows "
                        "draft-int4-graphed-moe0, -moe1, ...)")
    parser.add_argument("--row-config", action="append", default=[], help="a JSON object of RowTiles fields "
                        "(EngineConfig.tuning.kernels.row, the one-row kernels): also time the graphed draft step with "
                        "them (repeatable)")
    parser.add_argument("--profile-row-config", default=None, help="a JSON object of RowTiles fields for the "
                        "--profile-draft table (default: the tuning's tiles)")
    parser.add_argument("--positions-per-split", default="", help="also time the step with KernelTuning.positions_per_split "
                        "set to each of these (comma-separated; decode_attention's runs, one launch when one run)")
    parser.add_argument("--prompt-length", type=int, default=16, help="positions already in the cache (the draft "
                        "attends over these; at most --max-context minus k)")
    args = parser.parse_args()
    unknown = sorted(set(filter(None, args.without.split(","))) - set(FUSED_FLAGS))
    if unknown:
        parser.error(f"--without: unknown field(s) {', '.join(unknown)}; known: {', '.join(FUSED_FLAGS)}")
    config, hf = build_hf(args.shape, args.layers)
    config_dict, state = config.to_dict(), dict(hf.state_dict())
    assert 1 <= args.prompt_length <= args.max_context - args.k - 1, "--prompt-length must leave room for k steps"
    prompt = [100 + i % 1000 for i in range(args.prompt_length)]
    runtime = asyncio.run(build_runtime(config_dict, state, args.max_context))
    rows, agreement = ({}, {"tokens_compared": 0, "identical_prefix": 0}) if args.draft_only else \
        target_rows(runtime, prompt, args.tokens, args.eager_tokens)
    splits = tuple(int(split) for split in args.draft_splits.split(","))
    rows |= draft_rows(runtime, prompt, args.k, repeats=max(2, args.tokens // args.k), graphed_splits=splits,
                       profile_out=args.profile_draft, router_ab=args.router_ab, ab=args.ab,
                       kv_write_ab=args.kv_write, without=[flag for flag in args.without.split(",") if flag],
                       moe_configs=[json.loads(text) for text in args.moe_config],
                       row_configs=[json.loads(text) for text in args.row_config],
                       profile_row=json.loads(args.profile_row_config) if args.profile_row_config else None,
                       positions_per_split=[int(p) for p in args.positions_per_split.split(",") if p])
    asyncio.run(runtime.aclose())
    label = f"{args.shape}" + (f" (first {args.layers} layers)" if args.layers else "")
    result = {"shape": label, "rows": rows, "graphed_vs_eager": agreement, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graphed_tpot.json").write_text(json.dumps(result, indent=1))
    print(f"\ngraphed decoding, {label}, bf16 target, int4 draft, batch 1")
    print(f"greedy tokens identical to the eager exact path: {agreement['identical_prefix']}/{agreement['tokens_compared']}")
    print(f"{'step':<30}{'ms':>10}{'floor ms':>10}{'ratio':>10}")
    for name, row in rows.items():
        floor = f"{row['floor_ms']:>10.3f}" if row["floor_ms"] is not None else f"{'-':>10}"
        ratio = f"{row['ratio']:>10.2f}" if row["ratio"] is not None else f"{'-':>10}"
        print(f"{name:<30}{row['ms']:>10.2f}{floor}{ratio}")


if __name__ == "__main__":
    main()
