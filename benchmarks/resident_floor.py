"""Resident TPOT of synthetic real-shape models at full depth against their HBM floor (batch 1, bf16, k = 0).

Every expert sits in device memory; the engine decodes with its default path on CUDA (the graphed static
step). The floor is the bytes one token must read (every non-expert weight except the embedding table,
one embedding row, and top-k routed experts per MoE layer) over the H200's 3.3 TB/s. Weights are random
(synthetic, `specter.bench.synthetic`), which changes no timing.

    python benchmarks/resident_floor.py --shape phi-3.5-moe --shape deepseek-v2-lite --out out/floor
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

HBM_BYTES_PER_S = 3.3e12


def floor_bytes(spec) -> int:
    """Bytes a one-token step reads, from the shape alone (no allocation)."""
    from specter.model.weights import dense_shapes

    element = 2
    dense = 0
    for name, shape in dense_shapes(spec).items():
        numel = 1
        for size in shape:
            numel *= size
        if name == "model.embed_tokens.weight":
            numel = spec.hidden_size  # one row
        dense += numel * element
    return dense + len(spec.moe_layers) * spec.top_k * spec.expert_bytes(element)


async def measure(shape: str, layers: int | None, tokens: int, device: str = "cuda", tune: list[str] | None = None) -> dict:
    from specter.bench.synthetic import shape_label, synthetic_source
    from specter.config import DraftConfig, EngineConfig, GenerationConfig, TuningConfig
    from specter.engine import Runtime

    source = synthetic_source(shape, layers)
    spec = source.spec
    config = EngineConfig(device=device, dtype="bfloat16", exact=True, max_context=512, lookahead="fixed",
                          draft=DraftConfig(k=0, k_max=0), progress=False, tuning=TuningConfig().with_overrides(tune or []))
    started = time.perf_counter()
    runtime = await Runtime.build(source, config)
    load_s = time.perf_counter() - started
    try:
        prompt = list(range(100, 116))
        await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=8))  # warm-up: graphs captured
        result = await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=tokens))
        floor_s = floor_bytes(spec) / HBM_BYTES_PER_S
        tpot = result.stats.tpot_s
        return {"shape": shape_label(shape, layers), "layers": spec.num_layers, "moe_layers": len(spec.moe_layers),
                "tpot_ms": tpot * 1e3, "floor_ms": floor_s * 1e3, "ratio": tpot / floor_s, "floor_bytes": floor_bytes(spec),
                "tokens": tokens, "load_s": round(load_s, 1), "graphed": runtime.graphed is not None,
                "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    finally:
        await runtime.aclose()
        del runtime
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=None, help="a synthetic shape of specter.bench (repeatable)")
    parser.add_argument("--layers", type=int, default=None, help="truncate depth (labelled in the output)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cuda (the figure) or cpu (a smoke run of the script)")
    parser.add_argument("--tune", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a field of EngineConfig.tuning, e.g. kernels.exact_rowwise=true (repeatable)")
    parser.add_argument("--out", default="out/floor")
    args = parser.parse_args()
    shapes = args.shape or ["phi-3.5-moe", "deepseek-v2-lite", "qwen1.5-moe-a2.7b"]
    rows = [asyncio.run(measure(shape, args.layers, args.tokens, args.device, args.tune)) for shape in shapes]
    result = {"rows": rows, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(), "torch": torch.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "tune": args.tune}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resident_floor.json").write_text(json.dumps(result, indent=1))
    print(f"\nresident decoding, bf16, batch 1, {args.tokens} tokens, synthetic weights")
    print(f"{'shape':<34}{'ms':>9}{'floor ms':>10}{'ratio':>8}{'load s':>8}")
    for row in rows:
        print(f"{row['shape']:<34}{row['tpot_ms']:>9.2f}{row['floor_ms']:>10.3f}{row['ratio']:>8.2f}{row['load_s']:>8}")


if __name__ == "__main__":
    main()
