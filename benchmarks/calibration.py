"""What GPTQ calibration buys the draft: acceptance and window recall, RTN against GPTQ, per model family.

    python benchmarks/calibration.py                      # tiny random checkpoints of every family (CPU)
    python benchmarks/calibration.py --model PATH         # any checkpoint (e.g. the reference model: its prompts.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime

PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [50, 60, 70], [11, 5, 80, 33, 2], [90, 91, 4]]


def prompts_for(path: str, per_kind: int = 2) -> list[list[int]]:
    """The reference model's held-out snippets (prompts.json, written by reference_model.py), else PROMPTS."""
    listed = Path(path) / "prompts.json"
    if not listed.exists():
        return PROMPTS
    return [list(ids) for snippets in json.loads(listed.read_text())["kinds"].values() for ids in snippets[:per_kind]]


async def measure(path: str, quant: str, device: str, residents: int | None, tokens: int, group: int, k: int = 4) -> dict:
    config = EngineConfig(device=device, max_context=256, residents=residents, draft=DraftConfig(k=k, quant=quant, group_size=group))
    runtime = await Runtime.load(path, config)
    drafted = accepted = recall_hits = recall_total = 0
    for prompt in prompts_for(path):
        stats = (await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=tokens))).stats
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        recall_hits, recall_total = recall_hits + stats.recall_hits, recall_total + stats.recall_total
    await runtime.aclose()
    return {"acceptance": accepted / max(drafted, 1), "window_recall": recall_hits / max(recall_total, 1)}


def tiny_checkpoints(root: Path) -> dict[str, str]:
    from tests.hf_models import FAMILIES, hf_model, save_hf

    return {family: str(save_hf(hf_model(family, seed=3), root / family)) for family in FAMILIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
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
            row = asyncio.run(measure(path, quant, args.device, args.residents, args.tokens, args.group, args.k))
            rows.append({"model": name, "quant": quant, "k": args.k, **row})
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'model':<12}{'quant':<8}{'acceptance':>12}{'recall':>9}")
    for row in rows:
        print(f"{row['model']:<12}{row['quant']:<8}{row['acceptance']:>12.3f}{row['window_recall']:>9.3f}")


if __name__ == "__main__":
    main()
