"""The bench's sampled workloads (issue 28 item 3): seeded sampling held to a baseline sampled with the same seed."""

from __future__ import annotations

import json

import pytest

from specter.bench import cli, protocol
from specter.bench.protocol import Prompt
from specter.errors import ConfigError

ARGS = ["--systems", "ondemand,specter-fixed", "--max-new-tokens", "8", "--warmup-tokens", "2", "--link", "1", "--k", "3",
        "--no-progress", "--no-plots", "--sampling", "greedy,sampled"]


def _run(out) -> tuple[int, dict]:
    code = cli.main([*ARGS, "--out", str(out)])
    return code, json.loads((out / "results.json").read_text())


def test_sampled_and_greedy_cells_are_token_identical_to_their_baselines(tmp_path):
    code, results = _run(tmp_path)
    assert code == 0
    rows = {(row["system"], row["sampling"]) for row in results["summary"]}
    assert rows == {(system, mode) for system in ("ondemand", "specter-fixed") for mode in ("greedy", "sampled")}
    assert all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    sampled = [run for run in results["runs"] if run["sampling"] == "sampled"]
    assert sampled and all(run["seed"] is not None for run in sampled)
    assert all(run["seed"] is None for run in results["runs"] if run["sampling"] == "greedy")
    assert any(run["drafted"] > 0 for run in sampled if run["system"] == "specter-fixed")  # fixed k = 3: it drafted while sampling
    assert "| sampling |" in (tmp_path / "results.md").read_text()


def test_a_baseline_sampled_with_another_seed_is_caught(tmp_path, monkeypatch):
    """Meta-test: the check compares tokens, so a baseline sampled with a different seed fails the sampled rows (and
    only those), and the command exits 1."""
    real = protocol.ModelBench._baseline_on

    async def wrong_seed(self, runtime):
        seed = Prompt.seed
        monkeypatch.setattr(Prompt, "seed", property(lambda prompt: seed.fget(prompt) + 1))
        try:
            await real(self, runtime)
        finally:
            monkeypatch.setattr(Prompt, "seed", seed)

    monkeypatch.setattr(protocol.ModelBench, "_baseline_on", wrong_seed)
    code, results = _run(tmp_path)
    assert code == 1
    equal = {(row["system"], row["sampling"]): row["tokens_equal"] for row in results["summary"]}
    assert equal == {("ondemand", "greedy"): True, ("specter-fixed", "greedy"): True,
                     ("ondemand", "sampled"): False, ("specter-fixed", "sampled"): False}


def test_sampling_modes_are_checked():
    args = cli.build_parser().parse_args(["--sampling", "greedy,nucleus"])
    with pytest.raises(ConfigError, match="nucleus.*greedy, sampled"):
        cli.options_from_args(args)
