"""Replay `auto`'s placement at overlap 0 / 0.5 / 1 on every stored full-depth hybrid bench cell's placement trace,
with the cell's own calibration (widened copy time, host block, host job, link, slots, row_bucket).

Usage: python replay_overlap.py [--json out.json] [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from policies.placement import Auto
from specter.experts.costs import routing_profile
from specter.placement import Placement, decision_record
from specter.replay import replay, trace_placement_state
from specter.trace import read_trace

RESULTS = Path("/work/main/benchmarks/results")
DEVICE3 = Path("/work/.device/3/fulldepth-qwen3-30b-a3b")
# results dirs without a trace beside them -> the trace recorded for their series (docs/BENCHMARKS.md "Raw:" lines)
SIBLING = {
    "h200-2026-12-03/deepseek-b-ddr4": "h200-2026-12-03/deepseek-b-native/placement-trace.jsonl",
    "h200-2026-12-03/deepseek-b-gen4-16": "h200-2026-12-03/deepseek-b-native/placement-trace.jsonl",
    "h200-2026-12-03/qwen3-d-native-36": "h200-2026-12-03/qwen3-d-native-24/placement-trace.jsonl",
    "h200-2026-12-03/qwen3-d2-overlap1": "h200-2026-12-03/qwen3-d2-profile/placement-trace.jsonl",
    "h200-2026-12-03/qwen3-d2-overlap1-sampled24": "h200-2026-12-03/qwen3-d2-profile/placement-trace.jsonl",
}
OVERLAPS = (0.0, 0.5, 1.0)


def trace_for(results: Path) -> tuple[Path | None, bool]:
    """(trace path, borrowed from a sibling dir?)."""
    for candidate in (results.parent / "placement-trace.jsonl", results.parent.parent / "placement-trace.jsonl"):
        if candidate.exists():
            return candidate, False
    try:
        rel = str(results.parent.relative_to(RESULTS))
    except ValueError:
        return None, False
    return (RESULTS / SIBLING[rel], True) if rel in SIBLING else (None, False)


def tpot(summary: list[dict], cell: dict, system: str) -> str:
    rows = [s for s in summary if (s["model"], s["setting"], s["link"], s["system"]) ==
            (cell["model"], cell["setting"], cell["link"], system)]
    return "/".join(f"{s['tpot_ms']:.1f}" if s.get("tpot_ms") is not None else "-" for s in
                    sorted(rows, key=lambda s: s.get("sampling", ""))) or "-"  # greedy/sampled


def cell_replays(results_path: Path) -> list[dict]:
    data = json.loads(results_path.read_text())
    trace_path, borrowed = trace_for(results_path)
    cells = [c for c in data["cells"] if c.get("system") == "specter-hybrid" and c.get("placement")]
    if not cells or trace_path is None:
        return []
    header, rounds = read_trace(trace_path)
    counts, sequence = routing_profile(trace_path, header.num_layers, header.num_experts)
    models = {m["label"]: m for m in data["models"]}
    out = []
    for cell in cells:
        rec, model = cell["placement"], models[cell["model"]]
        link_bps = rec["link_bytes_per_s"]
        widened = model["expert_bytes"]
        copy_check = widened / link_bps
        row_bucket = rec["row_bucket"]
        block = rec["host_s_per_expert_by_rows"].get(str(row_bucket))
        job = rec.get("host_s_per_job")
        hdr = dataclasses.replace(header, expert_bytes=widened)  # the widened copy, as the engine's pool has it
        state = trace_placement_state(hdr, rounds, link_bps / 1e9, block, slots_per_layer=rec["slots_per_layer"],
                                      row_bucket=row_bucket, profile=counts, sequence=sequence,
                                      eviction="plan-protect", prefetch="topm-keep", host_job_s=job)
        started = time.perf_counter()
        off_replay = replay(hdr, rounds, "plan-protect", "topm-keep", link_bps / 1e9, slots_per_layer=state.slots_per_layer,
                            roll="engine", placement=None, host_block_s=block, row_bucket=row_bucket, host_job_s=job or 0.0)
        row = {"results": str(results_path.parent.relative_to(RESULTS)) if results_path.is_relative_to(RESULTS)
               else str(results_path.parent), "trace": str(trace_path), "borrowed_trace": borrowed,
               "commit": data["machine"].get("git_commit", "")[:8], "model": cell["model"], "setting": cell["setting"],
               "link": cell["link"], "slots": rec["slots_per_layer"], "rec_overlap": rec.get("overlap", 0.0),
               "rec_host": rec["host_experts"], "rec_per_layer": rec.get("host_experts_per_layer"),
               "rec_pred": rec.get("predicted_s_per_token"), "rec_speculates": rec.get("speculates"),
               "speculates": state.speculates, "copy_ms": rec["copy_s_per_expert"] * 1e3, "copy_ms_check": copy_check * 1e3,
               "host_ms": None if block is None else block * 1e3, "job_ms": None if job is None else job * 1e3,
               "tpot_specter": tpot(data.get("summary", []), cell, "specter"),
               "tpot_hybrid": tpot(data.get("summary", []), cell, "specter-hybrid"),
               "replay_off_ms": (off_replay.per_token_s or 0.0) * 1e3, "by_overlap": {}}
        for overlap in OVERLAPS:
            policy = Auto(overlap=overlap)
            placement = policy.place(state=state)
            decision = decision_record(state, placement, 0.0, overlap)
            result = replay(hdr, rounds, "plan-protect", "topm-keep", link_bps / 1e9, slots_per_layer=state.slots_per_layer,
                            roll="engine", placement=placement, placement_name="auto", host_block_s=block,
                            row_bucket=row_bucket, overlap=overlap, host_job_s=job or 0.0)
            row["by_overlap"][overlap] = {
                "host": placement.total, "per_layer": placement.counts(),
                "pred_off_ms": (decision["predicted_s_per_token"]["off"] or 0.0) * 1e3,
                "pred_placed_ms": (decision["predicted_s_per_token"]["placed"] or 0.0) * 1e3,
                "replay_ms": (result.per_token_s or 0.0) * 1e3,
                "replay_off_ms": row["replay_off_ms"] if overlap == 0 else None,
            }
        row["seconds"] = round(time.perf_counter() - started, 1)
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("rec_per_layer",)}, default=str)[:1500], file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="/tmp/replay-ov/replay_overlap.json")
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    paths = sorted(p for p in RESULTS.rglob("results.json") if "2026-12-0" in str(p)) + [DEVICE3 / "results.json"]
    rows = []
    for path in paths:
        if args.only and args.only not in str(path):
            continue
        rows += cell_replays(path)
    Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
