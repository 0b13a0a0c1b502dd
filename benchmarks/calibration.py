"""What GPTQ calibration buys the draft: acceptance and window recall, RTN against GPTQ, per model family.

    python benchmarks/calibration.py                      # tiny random checkpoints of every family (CPU)
    python benchmarks/calibration.py --model PATH         # any checkpoint (e.g. the reference model: its prompts.json)
    python benchmarks/calibration.py --model qwen1.5-moe-a2.7b --device cuda --group 128 --formats int4,gptq4
                                                          # a real shape with synthetic weights (all 24 layers, or --layers N)

Each row also gives the runtime's load time (for gptq4 it includes the calibration: the target's decode of the
calibration prompts plus GPTQ) and, for gptq4, the seconds spent in GPTQ itself (`calibrate.gptq_layer`, which runs
on the device of the recorded activations: the GPU for --device cuda).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

from specter import calibrate
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime

PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [50, 60, 70], [11, 5, 80, 33, 2], [90, 91, 4]]


def prompts_for(path: str, per_kind: int = 2) -> list[list[int]]:
    """The reference model's held-out snippets (prompts.json, written by reference_model.py), else PROMPTS."""
    listed = Path(path) / "prompts.json"
    if not listed.exists():
        return PROMPTS
    return [list(ids) for snippets in json.loads(listed.read_text())["kinds"].values() for ids in snippets[:per_kind]]


class GptqTimer:
    """Wraps `calibrate.gptq_layer` (the engine calls it through the module) and adds up its seconds, waiting for the
    device so that queued GPU work is counted."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.layers = 0
        self.inner = calibrate.gptq_layer

    def __call__(self, flats, inputs, *args, **kwargs):
        begin = time.perf_counter()
        result = self.inner(flats, inputs, *args, **kwargs)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)  # benchmark timing only
        self.seconds += time.perf_counter() - begin
        self.layers += 1
        return result


async def load(model: str, layers: int | None, config: EngineConfig) -> Runtime:
    """A checkpoint directory, or the name of a real shape (synthetic weights, `python -m specter.bench --model`)."""
    from specter.bench.synthetic import SHAPES, synthetic_source

    if model in SHAPES:
        return await Runtime.build(synthetic_source(model, layers), config)
    return await Runtime.load(model, config)


async def measure(path: str, quant: str, device: str, residents: int | None, tokens: int, group: int, k: int = 4,
                  layers: int | None = None) -> dict:
    config = EngineConfig(device=device, max_context=256, residents=residents, draft=DraftConfig(k=k, quant=quant, group_size=group))
    timer = GptqTimer()
    calibrate.gptq_layer = timer
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    begin = time.perf_counter()
    try:
        runtime = await load(path, layers, config)
    finally:
        calibrate.gptq_layer = timer.inner
    load_s = time.perf_counter() - begin
    drafted = accepted = recall_hits = recall_total = 0
    for prompt in prompts_for(path):
        stats = (await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=tokens))).stats
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        recall_hits, recall_total = recall_hits + stats.recall_hits, recall_total + stats.recall_total
    await runtime.aclose()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else 0.0
    return {"acceptance": accepted / max(drafted, 1), "window_recall": recall_hits / max(recall_total, 1),
            "load_s": load_s, "gptq_s": timer.seconds, "gptq_layers": timer.layers, "peak_gpu_gib": peak}


def tiny_checkpoints(root: Path) -> dict[str, str]:
    from tests.hf_models import FAMILIES, hf_model, save_hf

    return {family: str(save_hf(hf_model(family, seed=3), root / family)) for family in FAMILIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint directory or a real shape's name (synthetic weights)")
    parser.add_argument("--layers", type=int, default=None, help="truncate a real shape to N decoder layers")
    parser.add_argument("--device", default="cpu", help="the engine's device; GPTQ runs there too (cuda: on the GPU)")
    parser.add_argument("--residents", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--group", type=int, default=16, help="quantization group (tiny models have hidden 32)")
    parser.add_argument("--formats", default="int4,gptq4,int8,int2", help="draft formats to measure, comma-separated")
    parser.add_argument("--k", type=int, default=4, help="the fixed draft depth")
    parser.add_argument("--out", default=None, help="JSON rows, rewritten after each format (a run cut short keeps them)")
    args = parser.parse_args()
    models = {"model": args.model} if args.model else tiny_checkpoints(Path(tempfile.mkdtemp()))
    rows = []
    for name, path in models.items():
        for quant in args.formats.split(","):
            begin = time.perf_counter()
            row = asyncio.run(measure(path, quant, args.device, args.residents, args.tokens, args.group, args.k, args.layers))
            rows.append({"model": name, "quant": quant, "k": args.k, **row, "wall_s": time.perf_counter() - begin})
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'model':<12}{'quant':<8}{'acceptance':>12}{'recall':>9}{'load s':>9}{'gptq s':>9}{'wall s':>9}{'peak GiB':>10}")
    for row in rows:
        print(f"{row['model']:<12}{row['quant']:<8}{row['acceptance']:>12.3f}{row['window_recall']:>9.3f}"
              f"{row['load_s']:>9.1f}{row['gptq_s']:>9.2f}{row['wall_s']:>9.1f}{row['peak_gpu_gib']:>10.1f}")


if __name__ == "__main__":
    main()
