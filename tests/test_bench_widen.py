"""The bench at full width from a narrow checkpoint (`--widen F`) and the desktop's host threads (`--desktop-threads`),
on the CPU with the built-in tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specter.bench import cli, protocol, realism, systems, widen
from specter.experts.costs import Calibration
from specter.experts.host import HostExperts, default_threads, per_thread_counts

RUN = ["--max-new-tokens", "6", "--warmup-tokens", "2", "--link", "1", "--no-progress", "--no-plots", "--no-hf"]


def bench(out: Path, monkeypatch, *args: str) -> tuple[dict, protocol.ModelBench]:
    """Run the bench CLI; its results.json and the model's ModelBench (whose baseline tokens the records leave out)."""
    benches = []
    run = protocol.ModelBench.run

    async def keep(self):
        await run(self)
        benches.append(self)

    monkeypatch.setattr(protocol.ModelBench, "run", keep)
    assert cli.main([*RUN, *args, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text()), benches[0]


def test_widen_benches_the_widened_model_with_the_narrow_models_tokens(tmp_path, monkeypatch):
    """tiny widened x2 in bf16 computes tiny's function (bf16 x2: bit-identical logits on the CPU,
    tests/test_widen.py), so its tokens are tiny's in bf16, while every expert moved is 4x the bytes."""
    systems_ = "ondemand,specter-fixed"
    narrow, narrow_bench = bench(tmp_path / "narrow", monkeypatch, "--model", "tiny", "--dtype", "bfloat16", "--systems", systems_)
    wide, wide_bench = bench(tmp_path / "wide", monkeypatch, "--model", "tiny", "--widen", "2", "--systems", systems_)
    assert all(row["tokens_equal"] for row in narrow["summary"] + wide["summary"]), wide["summary"]
    assert wide_bench.offloaded_baseline == narrow_bench.offloaded_baseline  # the narrow model's tokens
    (small,), (big,) = narrow["models"], wide["models"]
    assert (big["label"], big["widen"], big["dtype"]) == ("tiny x2", 2, "bfloat16") and small["widen"] is None
    assert (big["hidden"], big["expert_intermediate"]) == (2 * small["hidden"], 2 * small["expert_intermediate"])
    assert big["expert_bytes"] == 4 * small["expert_bytes"] == 4 * 3 * 256 * 128 * 2  # tiny's expert: 3 x I x D, bf16
    assert {row["model"] for row in wide["summary"]} == {"tiny x2"}
    # ondemand loads exactly its misses: the same routes, so the same loads, each of a 4x larger expert (specter's
    # prefetches depend on timing)
    moved = {r["prompt_kind"]: r["h2d_bytes"] for r in narrow["runs"] if r["system"] == "ondemand"}
    assert all(moved.values())
    for run in (run for run in wide["runs"] if run["system"] == "ondemand"):
        assert run["h2d_bytes"] == 4 * moved[run["prompt_kind"]], run
    assert "hf-accelerate" not in {row["system"] for row in wide["summary"]}


def test_widen_auto_takes_the_trainers_factor(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps({"shape": "mixtral-8x7b", "factor": 8}))
    assert cli.widen_factor("auto", tmp_path) == 8 and cli.widen_factor("3", tmp_path) == 3
    assert cli.widen_factor(None, tmp_path) is None
    with pytest.raises(cli.ConfigError, match="records no widening factor"):
        cli.widen_factor("auto", tmp_path / "elsewhere")
    for text in ("{not json", "[8]", '{"factor": true}', '{"factor": "8"}', "[" * 100_000 + "]" * 100_000):
        (tmp_path / "train.json").write_text(text)
        with pytest.raises(cli.ConfigError, match="--widen auto: "):
            cli.widen_factor("auto", tmp_path)


def test_the_widened_loads_widen_on_the_engines_device(monkeypatch):
    """The bench's widened target widens on its --device (auto: CUDA when present) and the realism report on its
    config's; on the GPU, tests/test_gpu_widen.py checks what that gives."""
    seen = []

    class Recording(widen.WidenedCheckpoint):
        def __init__(self, path, factor, dtype=None, device="cpu"):
            super().__init__(path, factor, dtype, device)
            seen.append((device, self.device.type))

    monkeypatch.setattr(protocol, "WidenedCheckpoint", Recording)
    for device in ("auto", "cpu"):
        (target,), _ = cli.targets_from_args(cli.build_parser().parse_args(["--model", "tiny", "--widen", "2", "--device", device]))
        target.make_source().close()
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert seen == [("auto", auto), ("auto", auto), ("cpu", "cpu"), ("cpu", "cpu")]  # the spec's open, then make_source

    monkeypatch.setattr(widen, "WidenedCheckpoint", Recording)  # realism imports it at the call
    seen.clear()
    source = realism.weight_source(target.path, 2, "cpu")
    assert seen == [("cpu", "cpu")] and source.ckpt.device.type == "cpu"
    asked = []

    def stop(path, factor, device="cpu"):
        asked.append((factor, device))
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(realism, "weight_source", stop)
    with pytest.raises(RuntimeError, match="stop before loading"):
        realism.realism_report(target.path, factor=2, config=realism.realism_config("auto"))
    assert asked == [(2, "auto")]


@pytest.mark.parametrize("args, message", [
    (["--widen", "2"], "--widen 2 needs --model DIR"),
    (["--widen", "0", "--model", "tiny"], "--widen '0': expected a whole number F >= 1"),
    (["--widen", "-2", "--model", "tiny"], "--widen '-2': expected a whole number F >= 1"),
    (["--widen", "two", "--model", "tiny"], "--widen 'two': expected a whole number F >= 1"),
    (["--widen", "\u00b2", "--model", "tiny"], "--widen '\u00b2': expected a whole number F >= 1"),
    (["--widen", "2", "--model", "mixtral-8x7b"], "--widen: mixtral-8x7b is a synthetic shape"),
    (["--widen", "auto", "--model", "tiny"], "--widen auto: "),
    (["--desktop-threads", "0", "--model", "tiny"], "--desktop-threads 0: expected 1 or more"),
])
def test_bad_widen_and_desktop_threads_are_one_line_errors(args, message, tmp_path, capsys):
    assert cli.main([*args, "--no-progress", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "results.json").exists()


def test_desktop_cells_place_and_compute_with_the_desktop_threads(tmp_path, monkeypatch):
    """At ddr4-desktop the host path's calibration, the `auto` decision made from it and the path's own thread run
    with --desktop-threads; at another link with the engine's default. The calibration here says the host is fast
    at the desktop's count and slow at the default, so `auto` puts experts on the host only where it used the
    desktop's calibration (at the faster link, where the default's host time would have placed some too)."""
    desktop, default = default_threads() + 2, default_threads()
    calibrated = []

    async def by_threads(kernel, pool, mlp, state, hidden_size, device, profile=None, parallel=False):
        calibrated.append(state.host_threads)
        return Calibration({state.row_bucket: 2e-6 if state.host_threads == desktop else 1.0}, None, None)

    computed = []
    compute_layer = HostExperts.compute_layer

    def spy(self, *args, **kwargs):  # on the host thread: the count the path asked for and the one torch has there
        computed.append((self.threads, torch.get_num_threads()))
        return compute_layer(self, *args, **kwargs)

    monkeypatch.setattr(systems, "calibrate", by_threads)
    monkeypatch.setattr(HostExperts, "compute_layer", spy)
    results, _ = bench(tmp_path, monkeypatch, "--model", "tiny", "--systems", "cpu-experts,ondemand-hybrid",
                       "--desktop-threads", str(desktop), "--link", "1,ddr4-desktop")
    assert all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    assert sorted(calibrated) == sorted({desktop, default})  # once per thread count
    cells = {(cell["link"], cell["system"]): cell["host_threads"] for cell in results["cells"]}
    assert cells == {("1", "cpu-experts"): default, ("1", "ondemand-hybrid"): default,
                     ("ddr4-desktop", "cpu-experts"): desktop, ("ddr4-desktop", "ondemand-hybrid"): desktop}
    rows = {(row["link"], row["system"]): row for row in results["summary"]}
    assert all(rows[key]["host_threads"] == threads for key, threads in cells.items())
    assert rows[("ddr4-desktop", "ondemand-hybrid")]["host_experts_placed"] > 0
    assert rows[("1", "ondemand-hybrid")]["host_experts_placed"] == 0
    assert {threads for threads, _ in computed} == {desktop, default}
    if per_thread_counts():  # OpenMP: the count is the host thread's own
        assert all(asked == seen for asked, seen in computed), computed
    assert "| host threads |" in (tmp_path / "results.md").read_text()
