"""The paper's headline ratios over the full-depth cells: for each system, its TPOT against each baseline's, cell by
cell (the same model, setting, link and sampling in one results.json, a merged file's parts apart: one run, one checkpoint), then the mean of
those ratios per shape and over every cell. Full-depth cells are the widened checkpoints' (a model label `NAME xF`).

    python benchmarks/paper_ratios.py benchmarks/results/h200-*/ [--systems specter,specter-hybrid]
        [--baselines specmoeoff,ondemand] [--cells] [--by-placement]

Prints a markdown table: per shape and system, `x BASELINE` as the mean ratio (baseline's TPOT over the system's,
above 1 when the system is faster) and the cells it averages; --cells lists every cell's ratios first.
--by-placement splits a system's cells by whether its placement put any expert on the host (the row's
`host_experts_placed`): `SYSTEM (placed none)` is the same engine as with no host path, so its ratio against that
engine (`--systems specter-hybrid --baselines specter`) is the bench's spread between two runs of one configuration.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

WIDENED = re.compile(r"^(?P<shape>\S+) x\d+$")


def result_files(paths: list[str]) -> list[Path]:
    """Every results.json under the given files and directories, once, sorted; not those a later run into the same
    folder moved to its `previous/` (superseded: counted beside their successor, a cell would count twice), unless
    named."""
    found: set[Path] = set()
    for name in paths:
        path = Path(name)
        found.update([path] if path.is_file() else
                     (file for file in path.rglob("results.json") if "previous" not in file.relative_to(path).parts[:-1]))
    return sorted(found)


def cells(path: Path) -> dict[tuple[str, str, str, str, int | None], dict[str, dict]]:
    """{(shape, setting, link, sampling, part): {system: its summary row}} of one results.json's full-depth rows; a
    merged file's parts (processes) apart, so that a ratio compares two systems one process measured."""
    out: dict[tuple[str, str, str, str, int | None], dict[str, dict]] = defaultdict(dict)
    for row in json.loads(path.read_text()).get("summary") or []:
        match = WIDENED.match(row.get("model", ""))
        if match and row.get("tpot_ms"):
            out[(match["shape"], row["setting"], row["link"], row["sampling"], row.get("part"))][row["system"]] = row
    return out


def placed_label(system: str, row: dict) -> str:
    """`system` with whether its placement put experts on the host; unchanged for a row without a placement decision
    (a copy-only system's rows count 0 host experts too)."""
    if row.get("placement") is None:
        return system
    return f"{system} (placed {'some' if row.get('host_experts_placed') else 'none'})"


def ratios(files: list[Path], systems: list[str], baselines: list[str], by_placement: bool = False) -> list[dict]:
    """One record per (file, cell, system, baseline) where both ran: the baseline's TPOT over the system's (with
    `by_placement`, the system named by `placed_label`)."""
    records = []
    for path in files:
        for (shape, setting, link, sampling, _part), rows in cells(path).items():
            for system in systems:
                for baseline in baselines:
                    if system in rows and baseline in rows:
                        label = placed_label(system, rows[system]) if by_placement else system
                        records.append(dict(file=str(path), shape=shape, setting=setting, link=link, sampling=sampling,
                                            system=label, baseline=baseline,
                                            ratio=rows[baseline]["tpot_ms"] / rows[system]["tpot_ms"]))
    return records


def summary(records: list[dict], systems: list[str], baselines: list[str]) -> list[list[str]]:
    """Rows of the markdown table: shape (then "all cells"), system (each of `systems`, then any `placed_label` of
    it), and per baseline `mean (cells)`."""
    systems = [label for system in systems for label in (system, f"{system} (placed none)", f"{system} (placed some)")]
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for record in records:
        for shape in (record["shape"], "all cells"):
            groups[(shape, record["system"], record["baseline"])].append(record["ratio"])
    shapes = sorted({record["shape"] for record in records}) + ["all cells"]
    rows = []
    for shape in shapes:
        for system in systems:
            found = [groups.get((shape, system, baseline), []) for baseline in baselines]
            if any(found):
                rows.append([shape, system] + [f"{sum(v) / len(v):.2f} ({len(v)})" if v else "-" for v in found])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="results.json files or directories holding them")
    parser.add_argument("--systems", default="specter,specter-hybrid")
    parser.add_argument("--baselines", default="specmoeoff,ondemand")
    parser.add_argument("--cells", action="store_true", help="list every cell's ratio first")
    parser.add_argument("--by-placement", action="store_true",
                        help="split each system's cells by whether its placement put any expert on the host")
    args = parser.parse_args(argv)
    systems, baselines = args.systems.split(","), args.baselines.split(",")
    records = ratios(result_files(args.paths), systems, baselines, args.by_placement)
    if not records:
        print("no full-depth cell holds one of the systems beside one of the baselines")
        return 1
    if args.cells:
        for r in records:
            print(f"{r['shape']} {r['setting']} {r['link']} {r['sampling']}: {r['system']} x {r['baseline']} "
                  f"{r['ratio']:.2f} ({r['file']})")
        print()
    print("| shape | system | " + " | ".join(f"x {b}" for b in baselines) + " |")
    print("|---|---|" + "---|" * len(baselines))
    for row in summary(records, systems, baselines):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
