"""benchmarks/paper_ratios.py: the paper's ratios cell by cell, within one results file, averaged per shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paper_ratios():
    spec = importlib.util.spec_from_file_location("paper_ratios", ROOT / "benchmarks" / "paper_ratios.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, rows: list[tuple], placed: dict[tuple[str, str, str], int] | None = None) -> None:
    """Rows (model, link, sampling, system, TPOT); `placed`: (link, sampling, system) -> its host experts placed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = [dict(model=model, setting="budget=48.00GiB", link=link, sampling=sampling, system=system, tpot_ms=tpot)
               for model, link, sampling, system, tpot in rows]
    for row in summary:
        row["host_experts_placed"] = 0  # as the bench writes it for every offloaded system
        if (row["link"], row["sampling"], row["system"]) in (placed or {}):
            row["host_experts_placed"] = placed[row["link"], row["sampling"], row["system"]]
            row["placement"] = {"host_experts": row["host_experts_placed"]}  # its decision (summary rows hold more)
    path.write_text(json.dumps({"summary": summary}))


def test_ratios_pair_cells_within_one_file_and_average_per_shape_and_over_all(tmp_path, paper_ratios, capsys):
    write(tmp_path / "a" / "results.json", [
        ("phi-3.5-moe x8", "native", "greedy", "specter", 50.0), ("phi-3.5-moe x8", "native", "greedy", "ondemand", 100.0),
        ("phi-3.5-moe x8", "native", "greedy", "specter-hybrid", 25.0), ("phi-3.5-moe x8", "native", "greedy", "specmoeoff", 75.0),
        ("phi-3.5-moe x8", "gen4", "greedy", "specter", 40.0), ("phi-3.5-moe x8", "gen4", "greedy", "ondemand", 20.0),
        ("phi-3.5-moe", "native", "greedy", "specter", 1.0), ("phi-3.5-moe", "native", "greedy", "ondemand", 9.0),  # not widened
    ])
    write(tmp_path / "b" / "c" / "results.json", [
        ("mixtral-8x7b x8", "native", "sampled", "specter", 30.0), ("mixtral-8x7b x8", "native", "sampled", "ondemand", 90.0),
        ("phi-3.5-moe x8", "gen4", "sampled", "ondemand", 10.0),  # its specter cell is in another file: no pair
    ])
    write(tmp_path / "d" / "results.json", [("phi-3.5-moe x8", "gen4", "sampled", "specter", 5.0)])
    assert paper_ratios.main([str(tmp_path)]) == 0
    table = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line.strip("|").split("|")[2:]
             for line in capsys.readouterr().out.splitlines()[2:]}
    assert [c.strip() for c in table["phi-3.5-moe", "specter"]] == ["1.50 (1)", "1.25 (2)"]  # (2 + 0.5) / 2
    assert [c.strip() for c in table["phi-3.5-moe", "specter-hybrid"]] == ["3.00 (1)", "4.00 (1)"]
    assert [c.strip() for c in table["mixtral-8x7b", "specter"]] == ["-", "3.00 (1)"]
    assert [c.strip() for c in table["all cells", "specter"]] == ["1.50 (1)", "1.83 (3)"]  # (2 + 0.5 + 3) / 3


def test_no_pair_is_a_failure_that_says_so(tmp_path, paper_ratios, capsys):
    write(tmp_path / "results.json", [("phi-3.5-moe x8", "native", "greedy", "ondemand", 10.0)])
    assert paper_ratios.main([str(tmp_path / "results.json")]) == 1
    assert "no full-depth cell" in capsys.readouterr().out


def test_by_placement_splits_a_systems_cells_by_whether_it_placed_any_expert(tmp_path, paper_ratios, capsys):
    """A hybrid cell that placed nothing runs the same engine as `specter`: --by-placement keeps it apart from the cells
    where the placement acted, per shape and over all; without the flag they pool."""
    write(tmp_path / "results.json", [
        ("qwen1.5-moe-a2.7b x4", "native", "greedy", "specter", 10.0), ("qwen1.5-moe-a2.7b x4", "native", "greedy", "specter-hybrid", 12.5),
        ("qwen1.5-moe-a2.7b x4", "gen4", "greedy", "specter", 20.0), ("qwen1.5-moe-a2.7b x4", "gen4", "greedy", "specter-hybrid", 10.0),
        ("qwen1.5-moe-a2.7b x4", "gen4", "sampled", "specter", 30.0), ("qwen1.5-moe-a2.7b x4", "gen4", "sampled", "specter-hybrid", 60.0),
    ], placed={("native", "greedy", "specter-hybrid"): 0, ("gen4", "greedy", "specter-hybrid"): 96,
               ("gen4", "sampled", "specter-hybrid"): 12})
    args = [str(tmp_path), "--systems", "specter-hybrid", "--baselines", "specter"]

    def table() -> dict[tuple[str, str], str]:
        lines = capsys.readouterr().out.splitlines()[2:]
        return {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line.strip("|").split("|")[2].strip()
                for line in lines}

    assert paper_ratios.main(args) == 0
    assert table() == {("qwen1.5-moe-a2.7b", "specter-hybrid"): "1.10 (3)", ("all cells", "specter-hybrid"): "1.10 (3)"}  # (0.8 + 2 + 0.5) / 3
    assert paper_ratios.main(args + ["--by-placement"]) == 0
    split = table()
    assert split[("qwen1.5-moe-a2.7b", "specter-hybrid (placed none)")] == "0.80 (1)"
    assert split[("all cells", "specter-hybrid (placed some)")] == "1.25 (2)"  # (2 + 0.5) / 2
    assert ("all cells", "specter-hybrid") not in split
    # a copy-only system has no placement to split by, though its rows count 0 host experts
    assert paper_ratios.main([str(tmp_path), "--systems", "specter", "--baselines", "specter-hybrid", "--by-placement"]) == 0
    assert set(table()) == {("qwen1.5-moe-a2.7b", "specter"), ("all cells", "specter")}


def test_a_merged_files_parts_are_not_paired_and_a_superseded_run_is_not_counted(tmp_path, paper_ratios, capsys):
    """A merge's rows of different parts (processes, maybe machines) paired into a ratio; and the run a later one moved
    to `previous/` was averaged beside it (each cell counted twice)."""
    path = tmp_path / "merged" / "results.json"
    write(path, [("phi-3.5-moe x8", "gen4", "greedy", "specter", 50.0), ("phi-3.5-moe x8", "gen4", "greedy", "ondemand", 100.0),
                 ("phi-3.5-moe x8", "native", "greedy", "specter", 10.0), ("phi-3.5-moe x8", "native", "greedy", "ondemand", 90.0)])
    payload = json.loads(path.read_text())
    for row in payload["summary"]:
        row["part"] = 0 if row["link"] == "gen4" or row["system"] == "specter" else 1  # native: specter and ondemand apart
    path.write_text(json.dumps(payload))
    (tmp_path / "merged" / "previous" / "2026-12-01T00-00-00Z").mkdir(parents=True)
    (tmp_path / "merged" / "previous" / "2026-12-01T00-00-00Z" / "results.json").write_text(path.read_text())
    assert paper_ratios.main([str(tmp_path), "--baselines", "ondemand"]) == 0
    table = {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line.strip("|").split("|")[2:]
             for line in capsys.readouterr().out.splitlines()[2:]}
    assert [c.strip() for c in table["all cells", "specter"]] == ["2.00 (1)"]  # gen4 alone, once
