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


def write(path: Path, rows: list[tuple[str, str, str, str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = [dict(model=model, setting="budget=48.00GiB", link=link, sampling=sampling, system=system, tpot_ms=tpot)
               for model, link, sampling, system, tpot in rows]
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
