"""The benchmark harness on the CPU: a small matrix on tiny, synthetic real shapes, budgets, the reference trainer."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.bench import cli, protocol, report
from specter.bench.protocol import Clock, synthetic_prompts
from specter.bench.synthetic import SHAPES, SyntheticWeights, shape_bytes, shape_config, shape_label
from specter.bench.systems import SYSTEMS, BenchRuntime, Setting, initial_state, system_slots
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.model.spec import spec_from_config
from specter.memory import plan_memory
from specter.model.weights import dense_shapes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """One small matrix run through the CLI: every offloaded system that the checks below need."""
    out = tmp_path_factory.mktemp("bench")
    systems = "resident,ondemand,gate-prefetch,specmoeoff,specter,specter-scout,scout-k0,exact-prefetch,exact-prefetch-specter"
    code = cli.main(["--systems", systems, "--max-new-tokens", "8", "--warmup-tokens", "4", "--link", "1", "--no-progress",
                     "--out", str(out)])
    return code, out, json.loads((out / "results.json").read_text())


def test_matrix_tokens_equal_baseline_for_every_system(matrix):
    code, _out, results = matrix
    assert code == 0
    systems = {row["system"] for row in results["summary"]}
    assert systems == {"resident", "ondemand", "gate-prefetch", "specmoeoff", "specter", "specter-scout", "scout-k0", "exact-prefetch",
                       "exact-prefetch-specter"}
    assert all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    assert all(run["new_tokens"] == 8 and run["tpot_s"] > 0 for run in results["runs"])


def test_matrix_records_protocol_and_machine(matrix):
    _code, out, results = matrix
    assert results["machine"]["torch"] == torch.__version__ and results["machine"]["command"].endswith(f"--out {out}")
    assert {p["kind"] for p in results["models"][0]["prompts"]} == {"uniform", "zipf", "motif"}
    offloaded = [run for run in results["runs"] if run["system"] != "resident"]
    assert all(run["link"] == "1" and run["setting"] == "residents=6" for run in offloaded)
    assert any(run["h2d_bytes"] > 0 for run in offloaded)
    assert all(0 <= run["h2d_prefill_bytes"] <= run["h2d_bytes"] for run in offloaded)
    for row in results["summary"]:  # decode bytes per token: each run's bytes after its first token, per token after it
        cell = [run for run in results["runs"] if (run["system"], run["setting"]) == (row["system"], row["setting"])]
        decode = sum(run["h2d_bytes"] - run["h2d_prefill_bytes"] for run in cell) / sum(run["new_tokens"] - 1 for run in cell)
        assert row["h2d_decode_mb_per_token"] == pytest.approx(decode / 1e6, abs=1e-3)
    drafting = [run for run in results["runs"] if run["system"] == "specmoeoff"]  # fixed k=3: always drafts
    assert drafting and all(run["drafted"] > 0 and 0 < run["recall_hits"] <= run["recall_total"] for run in drafting)
    table = (out / "results.md").read_text()
    assert "| model | setting | link | sampling | system | TPOT ms |" in table and "specmoeoff" in table


def test_matrix_writes_plots(matrix):
    pytest.importorskip("matplotlib")
    _code, out, _results = matrix
    for name in ("tpot_by_system.png", "speedup.png", "acceptance.png", "recall_by_layer.png"):
        assert (out / name).stat().st_size > 1000, name


def test_specter_scout_scouts_its_plain_rounds(matrix):
    runs = matrix[2]["runs"]
    scout = [run for run in runs if run["system"] == "specter-scout"]
    assert len(scout) == 3 and all(run["scouted_rounds"] > 0 and run["scout_recall"] is not None for run in scout)
    assert all(run["rounds"] - run["scouted_rounds"] == sum(run["accepted_length_histogram"].values()) for run in scout)
    assert all(run["scouted_rounds"] == 0 for run in runs if run["system"] == "specter")
    alone = [run for run in runs if run["system"] == "scout-k0"]  # every round scouts, none drafts
    assert len(alone) == 3 and all(run["scouted_rounds"] == run["rounds"] == 7 and run["drafted"] == 0 for run in alone)
    assert all(0.0 < run["scout_recall"] <= 1.0 and run["tokens_equal"] for run in alone)
    rows = {row["system"]: row for row in matrix[2]["summary"]}  # pooled over requests, like window recall
    pooled = sum(run["scout_recall_hits"] for run in alone) / sum(run["scout_recall_total"] for run in alone)
    assert rows["scout-k0"]["scout_recall"] == round(pooled, 4) and rows["ondemand"]["scout_recall"] is None


def test_exact_prefetch_predicts_every_used_expert_and_gate_prefetch_some(matrix):
    runs = matrix[2]["runs"]
    assert all(run["predictor_recall"] == 1.0 for run in runs if run["system"] == "exact-prefetch")
    gate = [run["predictor_recall"] for run in runs if run["system"] == "gate-prefetch"]
    assert gate and all(0.0 <= recall <= 1.0 for recall in gate)


def test_exact_prefetch_specter_replays_specters_rounds_with_perfect_prefetch(matrix):
    """Same tokens and the same depth per round as the specter run of its cell, so the same rounds and
    acceptances; every expert its verifies use was named in advance."""
    runs = matrix[2]["runs"]
    by_prompt = {(run["system"], run["prompt_kind"], run["prompt_index"]): run for run in runs}
    replayed = [run for run in runs if run["system"] == "exact-prefetch-specter"]
    assert len(replayed) == 3
    for run in replayed:
        source = by_prompt[("specter", run["prompt_kind"], run["prompt_index"])]
        assert (run["rounds"], run["drafted"], run["accepted"]) == (source["rounds"], source["drafted"], source["accepted"])
        assert run["accepted_length_histogram"] == source["accepted_length_histogram"]
        assert run["depth_histogram"] == source["depth_histogram"]
        assert run["predictor_recall"] == 1.0


def test_a_cells_depth_histogram_counts_every_speculative_round_at_its_depth(matrix):
    """The depth each speculative round ran (the governor's choice, cut to the tokens left), per run and pooled per cell: the depths sum to the drafted tokens, the counts to
    the speculative rounds (those with an accepted length)."""
    results = matrix[2]
    drafting = [run for run in results["runs"] if run["drafted"]]
    assert drafting
    for run in drafting:
        depths = {int(k): c for k, c in run["depth_histogram"].items()}
        assert sum(k * c for k, c in depths.items()) == run["drafted"] and 0 not in depths
        assert sum(depths.values()) == sum(run["accepted_length_histogram"].values())
    for cell in results["summary"]:
        runs = [r for r in results["runs"] if all(r[f] == cell[f] for f in ("model", "setting", "link", "sampling", "system"))]
        assert sum(int(k) * c for k, c in cell["depth_histogram"].items()) == sum(r["drafted"] for r in runs)


def test_specter_and_exact_prefetch_specter_take_the_engines_default_draft_ahead(tmp_path, monkeypatch):
    """`specter` and `exact-prefetch-specter` draft ahead as the engine does by default (16 on CUDA, off on the CPU);
    `specter-serial` never does. Here the default is forced on, as on CUDA: tokens equal, exact-prefetch replays
    specter's rounds, draft-ahead counted for both and not for specter-serial."""
    monkeypatch.setattr(DraftConfig, "overlap_steps", lambda self, device_type, cuda_graphs: 16 if self.overlap is None else self.overlap)
    code = cli.main(["--systems", "specter-serial,specter,exact-prefetch-specter", "--max-new-tokens", "12", "--warmup-tokens", "2",
                     "--link", "1", "--k", "4", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    ahead = {}
    for run in results["runs"]:
        ahead[run["system"]] = ahead.get(run["system"], 0) + run["ahead_rounds"]
    assert ahead["specter-serial"] == 0 and ahead["specter"] > 0 and ahead["exact-prefetch-specter"] > 0, ahead
    by_prompt = {(run["system"], run["prompt_kind"], run["prompt_index"]): run for run in results["runs"]}
    for run in (run for run in results["runs"] if run["system"] == "exact-prefetch-specter"):
        source = by_prompt[("specter", run["prompt_kind"], run["prompt_index"])]
        assert (run["rounds"], run["drafted"], run["accepted"]) == (source["rounds"], source["drafted"], source["accepted"])


def test_exact_prefetch_specter_without_specter_is_refused_before_anything_runs(tmp_path, capsys):
    """It replays specter's rounds of the same run: without specter it could only be skipped, after the load."""
    code = cli.main(["--systems", "ondemand,exact-prefetch-specter", "--max-new-tokens", "4", "--warmup-tokens", "2", "--link", "1",
                     "--no-progress", "--no-plots", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: exact-prefetch-specter replays the rounds specter runs") and err.count("\n") == 1, err
    assert "add specter to --systems" in err and not (tmp_path / "out").exists()


def test_exact_prefetch_specter_whose_specter_cell_did_not_run_is_skipped_and_says_why(tmp_path, monkeypatch):
    """specter in the run, but its cell not run (as the time budget skips a cell): the replay is skipped with the
    reason, not run on rounds that were never recorded."""
    real = protocol.ModelBench._cell

    async def cell(self, runtime, system, setting, link, slots, initial, note=""):
        if system.name != "specter":
            return await real(self, runtime, system, setting, link, slots, initial, note)
        self.cells.append({"model": self.target.label, "setting": setting.label, "link": link, "system": system.name,
                           "slots": slots, "note": note, "status": "skipped: time budget"})
        self._ended((self.target.label, setting.label, link, system.name))

    monkeypatch.setattr(protocol.ModelBench, "_cell", cell)
    code = cli.main(["--systems", "specter,exact-prefetch-specter", "--max-new-tokens", "4", "--warmup-tokens", "2",
                     "--link", "1", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == cli.NOTHING_MEASURED  # both cells skipped: nothing measured
    status = {cell["system"]: cell["status"] for cell in results["cells"]}
    assert status == {"specter": "skipped: time budget", "exact-prefetch-specter": "skipped: needs specter earlier in the same run"}
    assert any("exact-prefetch-specter: skipped: needs specter" in note for note in results["notes"])


def test_exact_prefetch_specter_listed_before_specter_runs_after_it(tmp_path):
    """The replaying system needs specter's rounds: the bench runs it last, whatever the order of --systems."""
    code = cli.main(["--systems", "exact-prefetch-specter,specter,ondemand", "--max-new-tokens", "4", "--warmup-tokens", "2",
                     "--link", "1", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0
    assert [cell["system"] for cell in results["cells"]] == ["specter", "ondemand", "exact-prefetch-specter"]
    assert all(cell["status"] == "ok" for cell in results["cells"]), results["cells"]
    by_prompt = {(run["system"], run["prompt_kind"], run["prompt_index"]): run for run in results["runs"]}
    replays = [run for run in results["runs"] if run["system"] == "exact-prefetch-specter"]
    assert replays
    for run in replays:
        source = by_prompt[("specter", run["prompt_kind"], run["prompt_index"])]
        assert (run["rounds"], run["accepted"]) == (source["rounds"], source["accepted"])


def test_specmoeoff_pays_for_its_separate_draft(matrix):
    cells = {cell["system"]: cell for cell in matrix[2]["cells"]}
    assert cells["specmoeoff"]["slots"] < cells["specter"]["slots"] == 6
    assert "separate draft" in cells["specmoeoff"]["note"]


def test_time_budget_skips_cells_and_says_so(tmp_path):
    code = cli.main(["--systems", "ondemand", "--max-new-tokens", "4", "--time-budget", "1e-9", "--no-progress", "--no-plots",
                     "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == cli.NOTHING_MEASURED and results["runs"] == []
    assert results["cells"] and all(cell["status"] == "skipped: time budget" for cell in results["cells"])
    assert all(cell["note"] == "offloaded part not loaded: its time was up" for cell in results["cells"])  # no load
    assert any("time budget" in note for note in results["notes"])
    assert not Clock.fits(Clock(1e-9).deadline, 0.0) and Clock.fits(None, 1e9)


QUICK = ["--max-new-tokens", "4", "--warmup-tokens", "2", "--link", "1", "--no-progress", "--no-plots", "--no-hf"]


def test_a_budget_below_the_minimum_says_so_on_the_console(tmp_path, capsys):
    """Every cell of a budget too small is skipped: the reason (what the model needs) is printed, not only stored, so
    an empty table does not read as a run that measured nothing for no reason."""
    assert cli.main([*QUICK, "--systems", "ondemand", "--budget", "1MiB", "--out", str(tmp_path)]) == cli.NOTHING_MEASURED
    err = capsys.readouterr().err
    assert "note: " in err and "ondemand skipped: budget 1.0 MiB is" in err and "short of the minimum" in err, err
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == []


def test_a_run_where_only_the_ceiling_ran_compared_nothing(tmp_path, capsys):
    """`--budget 1KiB` on the quick matrix: `resident` ran, every other cell was skipped, and the bench exited 0; its
    notes read 'budget=0.00GiB', twice alike (one per link, unnamed)."""
    code = cli.main([*QUICK, "--link", "1,2", "--systems", "resident,ondemand", "--budget", "1KiB", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == cli.NOTHING_MEASURED, err
    assert "nothing was compared: only resident (the ceiling) ran; every cell of ondemand was skipped" in err
    notes = [line for line in err.splitlines() if "ondemand skipped" in line]
    assert len(notes) == len(set(notes)) == 2 and all("budget=1024B link=" in line for line in notes), notes
    assert {row["system"] for row in json.loads((tmp_path / "results.json").read_text())["summary"]} == {"resident"}
    assert cli.main([*QUICK, "--systems", "resident", "--budget", "1KiB", "--out", str(tmp_path / "alone")]) == 0


def test_a_budget_without_its_unit_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main([*QUICK, "--systems", "ondemand", "--budget", "24", "--out", str(tmp_path / "out")])
    assert "'24' is 24 bytes; give a unit, e.g. 24MiB or 24GiB" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf"])
def test_a_time_budget_that_is_no_positive_number_of_seconds_is_refused(budget, tmp_path, capsys):
    assert cli.main([*QUICK, "--time-budget", budget, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --time-budget {budget}: expected seconds above 0") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_the_first_cell_of_a_model_is_held_to_the_time_budget(tmp_path, monkeypatch):
    """No cell has run yet, but the baseline pass over the same requests took longer than the time left: the first
    cell is skipped, not started (before, it expected 0 s and ran past the budget)."""
    baseline = protocol.ModelBench._baseline_on

    async def slow_baseline(self, runtime):
        complete = runtime.complete_ids

        async def slow(*args, **kwargs):
            await asyncio.sleep(1.5)
            return await complete(*args, **kwargs)

        runtime.complete_ids = slow
        try:
            await baseline(self, runtime)
        finally:
            del runtime.complete_ids

    monkeypatch.setattr(protocol.ModelBench, "_baseline_on", slow_baseline)
    time_left = []
    cell = protocol.ModelBench._cell

    async def first_cell(self, *args, **kwargs):
        time_left.append(self.deadline - time.monotonic())
        await cell(self, *args, **kwargs)

    monkeypatch.setattr(protocol.ModelBench, "_cell", first_cell)
    code = cli.main([*QUICK, "--systems", "ondemand", "--time-budget", "7", "--out", str(tmp_path)])
    if time_left[0] <= 0:  # a machine so busy that the load and the baseline pass alone spent the budget
        pytest.skip("the load and the baseline pass took the whole budget")
    assert time_left[0] < 3 * 1.5  # what the pass took: it says the cell will not fit
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["runs"] == [] and [cell["status"] for cell in results["cells"]] == ["skipped: time budget"]
    assert code == cli.NOTHING_MEASURED


def test_a_cell_on_a_slow_emulated_link_is_held_to_the_time_budget_by_its_bytes(tmp_path):
    """The cells so far ran on a fast link and the untimed passes on the real one: a cell on a link 500 times slower
    is expected to take the bytes a cell copied at that link's speed (about 20 s here), so it is skipped, and the
    run ends inside its budget. Before, it was expected to take the fast cell's 0.4 s and ran past the budget."""
    started = time.monotonic()
    code = cli.main([*QUICK, "--link", "1,0.002", "--systems", "ondemand", "--time-budget", "15", "--out", str(tmp_path)])
    elapsed = time.monotonic() - started
    results = json.loads((tmp_path / "results.json").read_text())
    statuses = {cell["link"]: cell["status"] for cell in results["cells"]}
    assert statuses == {"1": "ok", "0.002": "skipped: time budget"}, results["cells"]
    moved = sum(run["h2d_bytes"] for run in results["runs"])
    assert moved / 0.002e9 > 15  # the skipped cell would have copied past the budget at 2 MB/s
    assert code == 0 and elapsed < 15


def test_the_first_cell_on_a_slow_emulated_link_is_held_to_the_time_budget(tmp_path):
    """The first cell of a model, on a slow emulated link: its estimate adds the baseline pass's bytes at the link's
    speed (the pass ran on the real link), so it is skipped without running its warm-up on the slow link."""
    started = time.monotonic()
    code = cli.main([*QUICK, "--link", "0.002", "--systems", "ondemand", "--time-budget", "15", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert [cell["status"] for cell in results["cells"]] == ["skipped: time budget"], results["cells"]
    assert code == cli.NOTHING_MEASURED and time.monotonic() - started < 15


def test_real_shapes_have_published_sizes_and_truncate_with_a_label():
    mixtral = spec_from_config(shape_config("mixtral-8x7b"))
    assert shape_bytes(mixtral)["expert_bytes"] == 3 * 4096 * 14336 * 2
    qwen = spec_from_config(shape_config("qwen1.5-moe-a2.7b", layers=2))
    assert (qwen.num_layers, qwen.num_experts, qwen.top_k, qwen.shared_intermediate) == (2, 60, 4, 5632)
    deepseek = spec_from_config(shape_config("deepseek-v2-lite", layers=3))
    assert deepseek.moe_layers == [1, 2] and deepseek.num_experts == 64
    assert shape_label("olmoe-1b-7b", 4) == "olmoe-1b-7b[L=4/16]" and shape_label("olmoe-1b-7b", None) == "olmoe-1b-7b"
    for name in SHAPES:
        assert spec_from_config(shape_config(name, layers=1)).num_layers == 1


def test_synthetic_source_serves_every_weight_and_runs():
    config = dict(shape_config("olmoe-1b-7b", layers=2), hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                  vocab_size=128, num_experts=8, num_experts_per_tok=2, intermediate_size=32, torch_dtype="float32")
    source = SyntheticWeights(config, seed=3)
    dense = source.dense(torch.float32, torch.device("cpu"), progress=False)
    assert {name: tuple(t.shape) for name, t in dense.items()} == dense_shapes(source.spec)
    experts = list(source.experts(torch.float32, progress=False))
    assert [(layer, expert) for layer, expert, _ in experts] == [(l, e) for l in range(2) for e in range(8)]
    assert all(flat.numel() == source.spec.expert_numel for _, _, flat in experts)

    async def generate(k: int) -> list[int]:
        engine = EngineConfig(device="cpu", residents=3, max_context=64, draft=DraftConfig(k=k, k_max=4))
        runtime = await BenchRuntime.build(SyntheticWeights(config, seed=3), engine)
        try:
            runtime.configure(SYSTEMS["specter" if k else "ondemand"], k)
            return (await runtime.complete_ids([1, 2, 3], GenerationConfig(max_new_tokens=6))).tokens
        finally:
            await runtime.aclose()

    assert asyncio.run(generate(0)) == asyncio.run(generate(3))


def test_a_trace_of_a_bench_cache_gives_its_own_slots(tmp_path):
    """`use_slots` may give the layers counts that are not one plan's spread (the first layer one more here, where the
    plan's spread gives the last): a trace recorded then says the cache's counts."""
    from specter.trace import read_trace

    config = dict(shape_config("olmoe-1b-7b", layers=2), hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                  vocab_size=128, num_experts=8, num_experts_per_tok=2, intermediate_size=32, torch_dtype="float32")

    async def go() -> tuple[int, ...]:
        engine = EngineConfig(device="cpu", residents=3, max_context=64, draft=DraftConfig(k=2, k_max=4))
        runtime = await BenchRuntime.build(SyntheticWeights(config, seed=3), engine)
        try:
            await runtime.use_slots((4, 3))
            runtime.record_trace(tmp_path / "bench.jsonl")
            return runtime.memory.layer_slots
        finally:
            await runtime.aclose()

    assert asyncio.run(go()) == (3, 4)  # the plan's spread of the same total
    header, _ = read_trace(tmp_path / "bench.jsonl")
    assert header.slots() == (4, 3) and header.slots_per_layer == 3


def test_budgets_give_slots_per_system():
    spec = spec_from_config(shape_config("qwen1.5-moe-a2.7b", layers=4))
    full = spec_from_config(shape_config("qwen1.5-moe-a2.7b"))
    args = (spec, full, torch.bfloat16, 176, 8)

    def total(system: str, setting: Setting, **options) -> int:  # every layer's slots, each layer's within one
        counts = system_slots(SYSTEMS[system], setting, *args, **options)[0]
        assert len(counts) == len(spec.moe_layers) and max(counts) - min(counts) <= 1
        return sum(counts)

    assert system_slots(SYSTEMS["specter"], Setting(residents=15), *args)[0] == (15,) * 4
    penalised, note = system_slots(SYSTEMS["specmoeoff"], Setting(residents=15), *args)
    assert len(set(penalised)) == 1 and 1 <= penalised[0] < 15 and "separate draft" in note
    budget = Setting(budget=6 * 2**30)
    plain, speculative = total("ondemand", budget), total("specter", budget)
    assert plain >= speculative > total("specmoeoff", budget)
    assert system_slots(SYSTEMS["specter"], budget, *args)[0] == plan_memory(
        spec, torch.bfloat16, EngineConfig(budget=6 * 2**30, max_context=176, draft=DraftConfig(k_max=8))).layer_slots
    assert total("scout-k0", budget) == speculative  # a scout pays for the draft too
    int8 = total("specter", budget, quant="int8")  # a bigger draft leaves fewer slots
    assert int8 < speculative and total("ondemand", budget, quant="int8") == plain
    assert initial_state(((1, 2, 3), (4,)), 2, 8) == ((2, 3), (0, 4))  # a short layer filled, least recent first
    assert initial_state(((1, 2, 3), ()), 3, 4) == ((1, 2, 3), (0, 1, 2))
    assert initial_state(((1,),), 6, 4) == ((0, 2, 3, 1),)  # never more than the layer's experts
    assert initial_state(((1, 2),), 0, 4) == ((),)
    rates = [[0.0, 0.1, 0.0, 0.9, 0.5], [0.0] * 5]
    assert initial_state(((1,), (2,)), 3, 5, rates) == ((3, 4, 1), (0, 1, 2))  # the most used fill, else the lowest


def test_synthetic_prompts_are_seeded_and_in_vocabulary():
    first, again = synthetic_prompts(100, 2), synthetic_prompts(100, 2)
    assert [p.ids for p in first] == [p.ids for p in again] and len(first) == 6
    assert all(len(p.ids) == 16 and all(0 <= t < 100 for t in p.ids) for p in first)


def test_reference_model_tiny_is_a_loadable_checkpoint(tmp_path):
    spec = importlib.util.spec_from_file_location("reference_model", ROOT / "benchmarks" / "reference_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--out", str(tmp_path), "--max-steps", "2", "--log-every", "1"]) == 0
    kinds = json.loads((tmp_path / "prompts.json").read_text())["kinds"]
    assert set(kinds) == {"code", "docs", "prose"} and all(len(ids) == 16 for ids in kinds["code"])

    async def generate() -> list[int]:
        runtime = await Runtime.load(tmp_path, EngineConfig(device="cpu", residents=2, max_context=64, draft=DraftConfig(k=2)))
        try:
            return (await runtime.complete_ids(kinds["code"][0], GenerationConfig(max_new_tokens=4))).tokens
        finally:
            await runtime.aclose()

    tokens = asyncio.run(generate())
    assert len(tokens) == 4 and all(0 <= t < 256 for t in tokens)
    if (tmp_path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        assert PreTrainedTokenizerFast.from_pretrained(tmp_path)("ab\n")["input_ids"] == [97, 98, 10]


def test_the_machine_record_names_the_sources_that_ran():
    from specter.bench import report

    info = report.machine(["--no-plots"])
    assert len(info["source_digest"]) == 16 and info["source_digest"] == report.source_digest()
    assert info["git_commit"] is None or len(info["git_commit"]) >= 40


def test_hf_baseline_says_when_the_time_budget_cut_its_prompts(monkeypatch):
    """A setting whose prompts the deadline cut short is named in a note, not dropped in silence."""
    from types import SimpleNamespace

    from specter.bench import hf_baseline

    monkeypatch.setattr(hf_baseline, "unavailable_reason", lambda: None)
    monkeypatch.setattr(hf_baseline, "_run_setting", lambda target, bench, options, setting: [{"setting": setting.label}])
    monkeypatch.setattr(hf_baseline.torch.cuda, "empty_cache", lambda: None)
    target = SimpleNamespace(label="m", settings=[Setting(residents=4), Setting(residents=2)], prompts=["a", "b", "c"])
    records, note = hf_baseline.run_hf(target, SimpleNamespace(deadline=None), SimpleNamespace(max_new_tokens=8))
    assert records == [{"setting": "residents=4"}]
    assert note == "m residents=4: hf-accelerate ran 1 of 3 prompts: time budget"


def test_merge_combines_disjoint_runs_and_refuses_overlaps(tmp_path, capsys):
    """A matrix run in parts (one GPU call per model) merges into one table; a cell in two parts is refused."""
    parts = []
    for index, link in enumerate(("1", "2")):
        out = tmp_path / f"part{index}"
        assert cli.main(["--systems", "ondemand", "--max-new-tokens", "4", "--warmup-tokens", "2", "--link", link,
                         "--no-progress", "--no-plots", "--out", str(out)]) == 0
        parts.append(out)
        payload = json.loads((out / "results.json").read_text())
        payload["notes"] += ["shared note", f"note of part {index}"]
        payload["options"]["quant"] = ("int4", "int8")[index]
        payload["options"]["repeats"] = (1, 2)[index]
        if index == 1:  # part 1 noted a cell it skipped that part 0 ran: the run stands, the skip goes
            cell = dict(zip(report.CELL_FIELDS, ("tiny", payload["summary"][0]["setting"], "1", "ondemand")))
            payload["cells"].append(cell | {"status": "skipped: time budget"})
            payload["notes"].append(f"tiny {cell['setting']} 1 ondemand: skipped: time budget")
        (out / "results.json").write_text(json.dumps(payload))
    merged = tmp_path / "merged"
    assert cli.main(["--merge", str(parts[0]), "--merge", str(parts[1]), "--no-plots", "--out", str(merged)]) == 0
    results = json.loads((merged / "results.json").read_text())
    assert {(row["link"], row["system"]) for row in results["summary"]} == {("1", "ondemand"), ("2", "ondemand")}
    assert [n for n in results["notes"] if "note" in n] == ["shared note", "note of part 0", "note of part 1"]
    assert "merged parts differ in the draft's expert format: ['int4', 'int8']" in results["notes"]
    assert "merged parts differ in requests per prompt: [1, 2]" in results["notes"]  # the protocol line is part 0's
    assert not [note for note in results["notes"] if "skipped: time budget" in note]
    assert [cell["status"] for cell in results["cells"] if cell["link"] == "1"] == ["ok"]
    assert [model["label"] for model in results["models"]] == ["tiny"]  # was listed once per part
    assert len(results["runs"]) == 6 and [part["directory"] for part in results["merged_from"]] == [str(p) for p in parts]
    assert "| model | setting | link | sampling | system |" in (merged / "results.md").read_text()
    assert cli.main(["--merge", str(parts[0]), "--merge", str(parts[0]), "--no-plots", "--out", str(tmp_path / "bad")]) == 2
    assert "is in both" in capsys.readouterr().err
    assert cli.main(["--merge", str(tmp_path / "missing"), "--out", str(tmp_path / "bad2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "results.json").write_text('{"runs": []}')  # was a KeyError traceback
    assert cli.main(["--merge", str(parts[0]), "--merge", str(stub), "--out", str(tmp_path / "bad3")]) == 2
    assert "is not a bench results file" in capsys.readouterr().err
    (stub / "results.json").write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError traceback
    assert cli.main(["--merge", str(parts[0]), "--merge", str(stub), "--out", str(tmp_path / "bad4")]) == 2
    assert "is not a bench results file (nested too deeply" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()


def test_quant_sets_the_draft_format_of_every_speculative_system(tmp_path):
    """--quant reaches the draft: an int8 draft agrees with the target more often than an int2 one."""
    acceptance = {}
    for quant in ("int2", "int8"):
        out = tmp_path / quant
        assert cli.main(["--systems", "specter-fixed", "--k", "4", "--max-new-tokens", "16", "--warmup-tokens", "2", "--link", "1",
                         "--quant", quant, "--no-progress", "--no-plots", "--out", str(out)]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["options"]["quant"] == quant and f"draft experts {quant}" in (out / "results.md").read_text()
        runs = results["runs"]
        acceptance[quant] = sum(run["accepted"] for run in runs) / sum(run["drafted"] for run in runs)
    assert acceptance["int8"] > acceptance["int2"], acceptance


def test_small_reference_model_and_calibration_prompts(tmp_path):
    """--small trains the CPU-sized reference shape; calibration.py reads the held-out prompts it writes."""
    def load_script(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    trainer, calibration = load_script("reference_model"), load_script("calibration")
    assert trainer.main(["--small", "--out", str(tmp_path), "--max-steps", "1", "--device", "cpu"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_local_experts"]) == (256, 4, 8)
    assert json.loads((tmp_path / "reference.json").read_text())["small"] is True
    prompts = calibration.prompts_for(str(tmp_path))
    kinds = json.loads((tmp_path / "prompts.json").read_text())["kinds"]
    assert len(prompts) == 6 and len({tuple(ids) for ids in prompts}) == 6
    assert all(len(ids) == 16 and all(isinstance(t, int) and 0 <= t < 256 for t in ids) for ids in prompts)
    assert prompts[:2] == kinds["code"][:2] and len(calibration.prompts_for(str(tmp_path), per_kind=1)) == 3
    assert calibration.prompts_for(str(tmp_path / "elsewhere")) == calibration.PROMPTS
    qwen = tmp_path / "qwen"
    assert trainer.main(["--small", "--family", "qwen2_moe", "--out", str(qwen), "--max-steps", "1", "--device", "cpu"]) == 0
    config = json.loads((qwen / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen2_moe", 256, 16, 4)


def test_qwen_shaped_reference_model_loads_and_decodes_like_transformers(tmp_path):
    """--family qwen2_moe --tiny: a trained Qwen2-MoE checkpoint the engine decodes exactly as transformers does."""
    spec = importlib.util.spec_from_file_location("reference_model", ROOT / "benchmarks" / "reference_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--family", "qwen2_moe", "--out", str(tmp_path), "--max-steps", "3", "--device", "cpu"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["num_experts"] == 8 and config["shared_expert_intermediate_size"] == 128
    prompt = json.loads((tmp_path / "prompts.json").read_text())["kinds"]["code"][0]

    async def generate() -> list[int]:
        config = EngineConfig(device="cpu", dtype="float32", residents=2, max_context=64, draft=DraftConfig(k=3))
        async with await Runtime.load(tmp_path, config) as runtime:
            return (await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=6))).tokens

    from transformers import Qwen2MoeForCausalLM

    hf = Qwen2MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert asyncio.run(generate()) == expected


def test_copy_gaps_splits_the_copy_idle_time_by_cause(tmp_path):
    """--copy-gaps turns the issue marks on: each stalled cell reports its idle shares, which add up to 1 - copy busy."""
    out = tmp_path / "gaps"
    assert cli.main(["--systems", "specter-fixed", "--k", "4", "--max-new-tokens", "12", "--warmup-tokens", "2", "--link", "0.25",
                     "--copy-gaps", "--no-progress", "--no-plots", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["options"]["tuning"]["transfer"]["issue_marks"] is True
    (row,) = json.loads((out / "results.json").read_text())["summary"]
    assert row["copy_busy"] is not None and set(row["copy_idle"]) == {"head", "handover", "issue", "pump", "plan", "slot"}
    assert row["copy_busy"] + sum(row["copy_idle"].values()) == pytest.approx(1.0, abs=2e-3)
    assert "idle: handover" in (out / "results.md").read_text()
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(isinstance(run["pump_gaps"], list) for run in runs)  # (late, lag) per gap a late prefetch ended
    gaps = [gap for run in runs for gap in run["pump_gaps"]]
    assert (row["pump_gaps"] is None) == (not gaps)
    if gaps:
        assert row["pump_gaps"]["gaps"] == len(gaps) and 0 <= row["pump_gaps"]["waited_for_room"] <= 1
        assert "Gaps a late prefetch chunk ended" in (out / "results.md").read_text()


def test_ab_bench_sets_tuning_fields_and_row_config_and_refuses_unknown_names():
    """benchmarks/ab_bench.py: --set becomes the bench's --tune of a tuning field (a tile by its dotted path),
    --row-config JSON one kernels.row.FIELD each; typos and bad values are refused with the field named."""
    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "benchmarks" / "ab_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.tune_args(["cache.lead_relay=false", "verify.lead_misses=0", "kernels.row.block_k=1024"]) == [
        "--tune", "cache.lead_relay=false", "--tune", "verify.lead_misses=0", "--tune", "kernels.row.block_k=1024"]
    settings = module.row_config_settings(json.dumps({"int8_finish": False, "block_n_moe": 8}))
    assert settings == ["kernels.row.int8_finish=false", "kernels.row.block_n_moe=8"]
    assert module.row_config_settings(None) == []
    with pytest.raises(SystemExit, match="kernels.row.block_n_moe"):  # the row tiles' names, listed
        module.tune_args(module.row_config_settings(json.dumps({"block_n_mo": 8})))
    with pytest.raises(SystemExit, match="not a power of two"):
        module.tune_args(["kernels.moe.block_k=100"])
    with pytest.raises(SystemExit, match="cache.lead_relay"):
        module.tune_args(["cache.lead_rleay=false"])
    with pytest.raises(SystemExit, match="SECTION.FIELD=VALUE"):
        module.tune_args(["lead_relay"])
    with pytest.raises(SystemExit, match="lead_misses"):
        module.tune_args(["verify.lead_misses=-1"])
    with pytest.raises(SystemExit, match="SECTION.FIELD=A|B"):
        module.alternate(["cache.lead_relay=false"])
    with pytest.raises(SystemExit, match="fixed when the graphs are captured"):
        module.alternate(["kernels.row_kernels=false|true"])


def test_bench_tune_sets_the_tuning_of_every_system_and_refuses_a_bad_field(tmp_path):
    """`python -m specter.bench --tune SECTION.FIELD=VALUE` reaches the runtimes' EngineConfig; a bad one is refused."""
    from specter.bench import protocol

    built = []
    real = protocol.ModelBench.engine_config

    def spy(self, **kwargs):
        built.append(real(self, **kwargs))
        return built[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(protocol.ModelBench, "engine_config", spy)
        out = tmp_path / "tuned"
        assert cli.main(["--systems", "specter-fixed", "--k", "4", "--max-new-tokens", "4", "--warmup-tokens", "2", "--link", "1",
                         "--tune", "cache.lead_relay=false", "--tune", "verify.lead_misses=1", "--no-progress", "--no-plots",
                         "--no-hf", "--out", str(out)]) == 0
    assert built and all(not c.tuning.cache.lead_relay and c.tuning.verify.lead_misses == 1 for c in built)
    assert cli.main(["--tune", "cache.nothing=1", "--no-progress", "--no-plots", "--out", str(tmp_path / "bad")]) == 2


def test_ab_bench_alternates_a_tuning_field_between_the_requests_of_one_process(tmp_path, monkeypatch):
    """--alternate: each measured request runs with the value its record names (A B B A per prompt), a second field
    flips with the first, each warm-up runs once per side, and the tuning is back after every request."""
    from specter.bench import protocol
    from specter.config import TuningConfig

    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "benchmarks" / "ab_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real = protocol.ModelBench._request
    during = []  # (warm, the field's value while the request ran)
    after = []  # the runtime's tuning once each request is done

    async def spy(self, runtime, system, prompt, start_state, cell, warm=False):
        tuning = runtime.config.tuning
        assert tuning.verify.lead_misses == (2 if tuning.cache.lead_relay else 0), "the second field did not flip with the first"
        if runtime.cache is not None:  # the components read what the config says
            assert runtime.cache.tuning == tuning.cache and runtime.experts.tuning == tuning.verify
        during.append((warm, tuning.cache.lead_relay))
        return await real(self, runtime, system, prompt, start_state, cell, warm=warm)

    monkeypatch.setattr(protocol.ModelBench, "_request", spy)
    original = module.alternate

    def alternate_and_watch(settings):
        name = original(settings)
        wrapped = protocol.ModelBench._request

        async def watched(self, runtime, *args, **kwargs):
            record = await wrapped(self, runtime, *args, **kwargs)
            after.append(runtime.config.tuning)
            return record

        monkeypatch.setattr(protocol.ModelBench, "_request", watched)
        return name

    monkeypatch.setattr(module, "alternate", alternate_and_watch)
    out = tmp_path / "ab"
    with pytest.raises(SystemExit) as exit_:
        module.main(["--alternate", "cache.lead_relay=false|true",
                     "--alternate", "verify.lead_misses=0|2", "--", "--systems", "specter-fixed",
                     "--k", "4", "--max-new-tokens", "6", "--warmup-tokens", "2", "--link", "1", "--repeats", "4",
                     "--no-progress", "--no-plots", f"--out={out}"])
    assert exit_.value.code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    measured = [value for warm, value in during if not warm]
    assert [run["variant"] for run in runs] == [f"cache.lead_relay={json.dumps(v)}" for v in measured]
    assert measured == [False, True, True, False] * (len(runs) // 4)
    warm_values = [value for warm, value in during if warm]
    assert warm_values and warm_values == [False, True] * (len(warm_values) // 2), "each warm-up runs once per side"
    assert after and all(tuning == TuningConfig() for tuning in after)
    assert module.compare(str(out))[0].startswith("tiny residents=6 1 specter-fixed cache.lead_relay=false: 6 requests")


def test_ab_bench_pairs_each_prompt_with_itself():
    """The paired ratio compares each prompt's two sides, so a prompt twice as slow as another does not swamp it."""
    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "benchmarks" / "ab_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cell = {"model": "m", "setting": "residents=8", "link": "native", "system": "specter"}
    tpots = {("code", "X=true"): [1.0, 1.0], ("code", "X=false"): [1.25, 1.25],
             ("docs", "X=true"): [4.0, 4.2], ("docs", "X=false"): [4.1, 4.1]}
    runs = [cell | {"prompt_kind": kind, "prompt_index": 0, "variant": variant, "tpot_s": t}
            for (kind, variant), values in tpots.items() for t in values]
    runs.insert(0, runs.pop(2))  # the first measured request is side A (X=false here)
    (line,) = module.paired(runs)
    assert "X=false / X=true" in line and "over 2 prompts" in line
    assert "per prompt 1.250, 1.000" in line and f"{(1.25 * 1.0) ** 0.5:.3f} (per" in line


def test_row_bucket_reaches_every_engine_the_bench_builds(tmp_path, monkeypatch):
    """--row-bucket sets EngineConfig.row_bucket of every system (the baseline's too, so exactness holds)."""
    from specter.bench import protocol

    built = []
    real = protocol.EngineConfig

    def spy(**kwargs):
        config = real(**kwargs)
        if "draft" in kwargs:  # an engine's config (not the one that only resolves the dtype)
            built.append(config.row_bucket)
        return config

    monkeypatch.setattr(protocol, "EngineConfig", spy)
    out = tmp_path / "bucket"
    assert cli.main(["--systems", "ondemand,specter-fixed", "--k", "7", "--k-max", "7", "--row-bucket", "8",
                     "--max-new-tokens", "12", "--warmup-tokens", "2", "--link", "1", "--no-progress", "--no-plots",
                     "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["options"]["row_bucket"] == 8 and built and set(built) == {8}, built
    with pytest.raises(SystemExit):  # argparse's error: a clear message, exit status 2
        cli.main(["--row-bucket", "0", "--no-progress", "--out", str(tmp_path / "bad")])
    assert all(run["tokens_equal"] for run in results["runs"])


# ---- the quick matrix's output: plots a reader can read, and one line that says what it found --------------

def _plot_payload() -> dict:
    """A summary and runs shaped like the quick matrix's (two links, ondemand and specter), without running it."""
    summary, runs = [], []
    for link, ondemand, specter in (("0.02", 80.0, 40.0), ("0.1", 20.0, 16.0)):
        for system, tpot in (("ondemand", ondemand), ("specter", specter)):
            row = {"model": "tiny", "setting": "residents=6", "link": link, "system": system, "tpot_ms": tpot,
                   "acceptance": 0.9 if system == "specter" else None}
            if system == "specter":
                row["x_ondemand"] = round(ondemand / specter, 3)
            summary.append(row)
            runs.append({"model": "tiny", "setting": "residents=6", "link": link, "system": system,
                         "accepted_length_histogram": {"0": 1, "3": 2, "4": 5} if system == "specter" else {},
                         "recall_by_layer": {str(layer): [3, 4] for layer in range(4)} if system == "specter" else {}})
    summary.append({"model": "tiny", "setting": "all", "link": "-", "system": "resident", "tpot_ms": 4.0, "acceptance": None})
    return {"summary": summary, "runs": runs}


def _drawn(figure):
    figure.canvas.draw()
    return figure


def test_every_plot_axis_has_its_unit_integer_ticks_where_it_counts_and_the_legend_outside_the_data():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from specter.bench import plots

    payload = _plot_payload()
    figures = {name: _drawn(plot(payload["summary"], payload["runs"])) for name, plot in (
        ("tpot", plots._tpot_by_system), ("speedup", plots._speedups), ("acceptance", plots._acceptance),
        ("lengths", plots._accepted_lengths), ("recall", plots._recall_by_layer), ("link", plots._tpot_vs_link))}
    for name in ("tpot", "speedup", "acceptance"):  # bar groups: every link with its unit
        ax = figures[name].axes[0]
        assert [label.get_text().split("\n")[-1] for label in ax.get_xticklabels()] == ["0.02 GB/s", "0.1 GB/s"], name
        assert "GB/s" in ax.get_xlabel()
    assert "ms" in figures["tpot"].axes[0].get_ylabel() and "ms" in figures["link"].axes[0].get_ylabel()
    assert "GB/s" in figures["link"].axes[0].get_xlabel()
    for ax in (figures["lengths"].axes[0], figures["recall"].axes[0]):  # counts and layer indices: whole numbers
        ticks = [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
        assert ticks and all(float(tick).is_integer() for tick in ticks), (ax.get_xlabel(), ticks)
    for name in ("tpot", "speedup", "acceptance", "recall", "link"):  # legends right of the data, not over it
        ax = figures[name].axes[-1]
        legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= frame.x1, name
    import matplotlib.pyplot as plt

    for figure in figures.values():
        plt.close(figure)


def test_the_reading_line_states_the_ratios_of_the_medians():
    from specter.bench import report

    line = report.reading(_plot_payload()["summary"])
    assert line == ("specter vs ondemand (tiny, 6 resident experts/layer): 2.00x lower TPOT at 0.02 GB/s (40 vs 80 ms), "
                    "1.25x lower TPOT at 0.1 GB/s (16 vs 20 ms)")
    slower = [dict(row, tpot_ms=25.0) if row["system"] == "specter" and row["link"] == "0.1" else row for row in _plot_payload()["summary"]]
    assert "1.25x higher TPOT at 0.1 GB/s (25 vs 20 ms)" in report.reading(slower)
    assert report.reading([row for row in _plot_payload()["summary"] if row["system"] != "ondemand"]) is None


def test_the_reading_line_and_the_table_round_one_ratio():
    """A ratio of 1.6648 was stored to three decimals (1.665) and printed in the table as 1.67, while the closing line,
    from the medians, said 1.66x: both now print the one stored ratio (four decimals)."""
    rows = [{"model": "m", "setting": "residents=2", "link": "1", "sampling": "greedy", "system": name, "tpot_ms": tpot,
             "tokens_equal": True} for name, tpot in (("ondemand", 16.648), ("specter", 10.0))]
    report._add_speedups(rows)
    specter = next(row for row in rows if row["system"] == "specter")
    table = report.table_lines([specter], (("x_ondemand", "x ondemand"),))[-1].strip()
    assert table == "1.66" and "1.66x lower TPOT" in report.reading(rows)


def test_the_matrix_prints_its_reading_consistent_with_its_table(tmp_path):
    import contextlib
    import io

    # stdout only: capsys would also swap stderr, and the bench's log.configure would keep writing to it once closed
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(["--systems", "ondemand,specter", "--max-new-tokens", "4", "--warmup-tokens", "2", "--link", "1",
                         "--no-progress", "--no-plots", "--out", str(tmp_path)]) == 0
    printed = stdout.getvalue().strip().splitlines()
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    tpot = {row["system"]: row["tpot_ms"] for row in summary}
    ratio = tpot["ondemand"] / tpot["specter"]
    assert printed[-1].startswith("specter vs ondemand (tiny, 6 resident experts/layer): ")
    assert f"{max(ratio, 1 / ratio):.2f}x {'lower' if ratio >= 1 else 'higher'} TPOT at 1 GB/s" in printed[-1]


def test_the_bare_quick_matrix_shows_the_idea_with_repeats_and_a_draft_that_agrees():
    options = cli.options_from_args(cli.build_parser().parse_args([]))
    assert options.systems == ["resident", "ondemand", "specter"] and options.repeats >= 2 and options.quant == "int8"
    if not torch.cuda.is_available():
        assert options.links == list(cli.QUICK_LINKS)
    shaped = cli.options_from_args(cli.build_parser().parse_args(["--systems", "ondemand"]))
    assert (shaped.repeats, shaped.quant) == (1, "int4")  # a matrix of the user's own keeps the plain defaults


def test_the_exact_prefetch_systems_carry_no_oracle_name_in_code_or_docs():
    """Issue 28 item 7: the systems that prefetch the recorded routes are no floor, so nothing calls them the oracle
    (the journal in git history keeps the old names)."""
    from specter.bench import report

    assert not [name for name in SYSTEMS if "oracle" in name]
    assert {"exact-prefetch", "exact-prefetch-k0", "exact-prefetch-specter"} <= set(SYSTEMS)
    assert "x_oracle" not in {key for key, _ in report.COLUMNS + report.SHORT_COLUMNS} and "oracle" not in report.BASELINES
    for doc in ("README.md", "docs/BENCHMARKS.md", "benchmarks/README.md", "docs/ARCHITECTURE.md"):
        text = (ROOT / doc).read_text().replace("named `oracle*` before issue 28", "")
        assert "oracle" not in text.lower(), doc


def test_cells_where_a_system_beats_exact_prefetch_are_flagged():
    from specter.bench import report

    def row(system, mb, tpot):
        return {"model": "m", "setting": "residents=2", "link": "1", "sampling": "greedy", "system": system,
                "h2d_decode_mb_per_token": mb, "tpot_ms": tpot}

    rows = [row("specter-fixed", 3.02, 17.2), row("exact-prefetch", 3.15, 18.0), row("specter", 2.6, 10.7),
            row("exact-prefetch-specter", 2.5, 10.0), row("exact-prefetch-k0", 2.62, 9.99)]
    report._add_speedups(rows)
    flags = report.exact_prefetch_flags(rows)
    assert len(flags) == 1 and "specter-fixed moves fewer decode bytes (3.02 MB/token) than exact-prefetch (3.15)" in flags[0]
    rows[2]["tpot_ms"] = 9.0  # faster than every variant now
    report._add_speedups(rows)
    assert any("m residents=2 1 greedy: specter is faster than every exact-prefetch variant" in f
               for f in report.exact_prefetch_flags(rows))


def test_realism_reports_each_checkpoint_once_prints_it_and_stores_it(tmp_path, capsys):
    """bench --realism on tiny (a checkpoint): the report is printed, kept under the model in results.json and
    summarised in one row of results.md."""
    code = cli.main(["--model", "tiny", "--realism", "--realism-tokens", "6", "--systems", "ondemand", "--max-new-tokens", "4",
                     "--warmup-tokens", "2", "--link", "1", "--no-progress", "--no-plots", "--no-hf", "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.count("realism: tiny (") == 1 and "| layer | entropy |" in printed
    realism = json.loads((tmp_path / "results.json").read_text())["models"][0]["realism"]
    assert realism["new_tokens"] == 6 and realism["model"] == "tiny"
    assert {"repetition", "routing", "draft", "held_out", "flags"} <= set(realism)
    assert 0.0 <= realism["routing"]["mean"]["entropy"] <= 1.0 and realism["draft"]["drafted_greedy"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| model | held-out loss | greedy 4-gram repeat |" in table
    assert sum(line.startswith("| tiny |") for line in table.split("Realism of each checkpoint")[1].splitlines()) == 1


def test_realism_skips_synthetic_shapes_with_a_note():
    from specter.bench.protocol import ModelTarget, Options

    target = ModelTarget(label="shape", make_source=lambda: None, spec=None, full_spec=None, prompts=[], warmup=None,
                         settings=[])
    assert cli.realism_reports([target], Options(systems=[], links=[]), 4) == {}
    assert target.notes == ["shape: no realism report (synthetic random weights route at random)"]


def _fewest_loads_by_search(rounds: list[set[int]], slots: int) -> int:
    """The same floor by exhaustive search: after each round keep any `slots` of what was held or used."""
    import itertools

    costs = {frozenset(): 0}
    for used in rounds:
        following: dict[frozenset, int] = {}
        for held, cost in costs.items():
            paid = cost + len(used - held)
            pool = sorted(held | used)
            for size in range(min(slots, len(pool)) + 1):
                for kept in itertools.combinations(pool, size):
                    key = frozenset(kept)
                    following[key] = min(following.get(key, paid), paid)
        costs = following
    return min(costs.values())


@given(rounds=st.lists(st.sets(st.integers(0, 5), max_size=4), min_size=1, max_size=6), slots=st.integers(1, 3))
@settings(max_examples=150, deadline=None)
def test_fewest_loads_is_the_optimum_of_every_keep_choice(rounds, slots):
    """Belady on whole rounds is the optimum of the relaxation the bytes floor stands on (issue 28 item 7)."""
    from specter.replay import fewest_loads

    assert fewest_loads(rounds, slots) == _fewest_loads_by_search(rounds, slots)


def test_no_system_moves_fewer_decode_bytes_than_the_floor_of_its_rounds(matrix):
    runs = [run for run in matrix[2]["runs"] if run["system"] != "resident"]
    assert runs and all(run["h2d_decode_floor_bytes"] is not None for run in runs)
    assert all(run["h2d_bytes"] - run["h2d_prefill_bytes"] >= run["h2d_decode_floor_bytes"] for run in runs)
    rows = [row for row in matrix[2]["summary"] if row["system"] != "resident"]
    assert all(row["floor_decode_mb_per_token"] <= row["h2d_decode_mb_per_token"] for row in rows)
    assert not [note for note in matrix[2]["notes"] if "below the bytes floor" in note]


def test_a_cell_below_the_bytes_floor_of_its_rounds_is_flagged():
    from specter.bench import report

    row = {"model": "m", "setting": "residents=2", "link": "1", "sampling": "greedy", "system": "specter",
           "h2d_decode_mb_per_token": 1.5, "floor_decode_mb_per_token": 1.8, "tpot_ms": 1.0}
    assert report.exact_prefetch_flags([row]) == ["m residents=2 1 greedy: specter moved 1.5 decode MB/token, below the "
                                                  "bytes floor of its own rounds (1.8): the floor or the byte accounting is wrong"]
    assert report.exact_prefetch_flags([row | {"floor_decode_mb_per_token": 1.5}]) == []


def test_cpu_experts_copies_nothing_and_is_held_to_its_own_placements_baseline(tmp_path, monkeypatch):
    """`cpu-experts` (issue 28 item 4): k = 0, the cell's starting residents on the device, the rest on the host; no
    expert byte after the prompt, host experts counted, tokens equal to the same placement's k = 0 baseline."""
    from specter.bench import protocol

    baselines = []
    placed = protocol.ModelBench._placement_baseline

    async def spy(self, runtime, system, start_state, cell):
        await placed(self, runtime, system, start_state, cell)
        baselines.append((system.name, cell, dict(self.placed_baseline)))

    monkeypatch.setattr(protocol.ModelBench, "_placement_baseline", spy)
    code = cli.main(["--systems", "ondemand,cpu-experts", "--max-new-tokens", "6", "--warmup-tokens", "4", "--link", "1",
                     "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    runs = [run for run in results["runs"] if run["system"] == "cpu-experts"]
    assert runs and all(run["h2d_bytes"] == 0 and run["misses"] == 0 and run["host_computed_experts"] > 0 for run in runs)
    assert all(run["host_computed_experts"] == 0 for run in results["runs"] if run["system"] == "ondemand")
    assert baselines and all(name == "cpu-experts" and table for name, _cell, table in baselines)
    # per token after the first, as TPOT: the prompt's host experts and seconds left out
    row = next(row for row in results["summary"] if row["system"] == "cpu-experts")
    decode_tokens = sum(run["new_tokens"] - 1 for run in runs)
    assert all(0 < run["host_prefill_experts"] < run["host_computed_experts"] for run in runs)
    assert row["host_per_token"] == round(sum(r["host_computed_experts"] - r["host_prefill_experts"] for r in runs) / decode_tokens, 3)
    assert row["host_ms_per_token"] == round(1e3 * sum(r["host_compute_s"] - r["host_prefill_s"] for r in runs) / decode_tokens, 3)
    assert 0 < row["host_ms_per_token"] < 1e3 * sum(r["host_compute_s"] for r in runs) / decode_tokens
    for wait in ("routing_wait", "host_wait"):  # the verify's waits, counted the same way
        assert all(0 < run[f"{wait}_prefill_s"] < run[f"{wait}_s"] for run in runs), wait
        assert row[f"{wait}_ms_per_token"] == round(1e3 * sum(r[f"{wait}_s"] - r[f"{wait}_prefill_s"] for r in runs)
                                                    / decode_tokens, 3)
    old = [{k: v for k, v in run.items() if not k.endswith("wait_prefill_s")} for run in runs]  # results from before
    assert report.summarize(old)[0]["routing_wait_ms_per_token"] is None


def test_the_hybrids_place_with_auto_and_hold_their_tokens_to_that_placements_baseline(tmp_path, monkeypatch):
    """`specter-hybrid` (k as specter) and `ondemand-hybrid` (k = 0) place with `auto` from the cell's start and link,
    beside `cpu-experts`; each is held to the same placement's k = 0 run. The host's cost is fixed here (0.2 ms per
    block against 0.4 ms per copy of tiny's expert at 1 GB/s) and `auto` weighs the two paths as fully overlapped
    (`--placement-overlap 1`: by default it adds them up, and under uniform use it then puts all or none on the host),
    so it puts some experts, not all, on the host for `ondemand-hybrid`; `specter-hybrid` speculates and has no trace
    (`--self-profile-tokens 0`: none of its own either, tests/test_own_profile.py), so it places none
    (`Auto.prices_misses`). The host-path table gives one host expert's time and the share of the
    host's time that ran beside the device path."""
    from specter import plugins
    from specter.bench import protocol, systems
    from specter.experts.costs import Calibration

    offered = []

    async def fixed(kernel, pool, kernels, state, hidden_size, device, profile=None, parallel=False):
        offered.append([candidate.name for candidate in kernels])
        return Calibration({state.row_bucket: 2e-4}, None, None, None, "torch")

    monkeypatch.setattr(systems, "calibrate", fixed)
    load_policy, options = plugins.load_policy, []
    monkeypatch.setattr(plugins, "load_policy", lambda group, name, **kwargs: (
        options.append((group, name, kwargs)), load_policy(group, name, **kwargs))[1])
    baselines = []
    placed = protocol.ModelBench._placement_baseline

    async def spy(self, runtime, system, start_state, cell):
        await placed(self, runtime, system, start_state, cell)
        baselines.append(system.cpu_experts)

    monkeypatch.setattr(protocol.ModelBench, "_placement_baseline", spy)
    code = cli.main(["--systems", "ondemand,cpu-experts,specter-hybrid,ondemand-hybrid", "--max-new-tokens", "6",
                     "--warmup-tokens", "4", "--link", "1", "--placement-overlap", "1", "--self-profile-tokens", "0",
                     "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    rows = {row["system"]: row for row in results["summary"]}
    assert rows["specter-hybrid"]["host_experts_placed"] == 0 < rows["ondemand-hybrid"]["host_experts_placed"]
    assert rows["ondemand-hybrid"]["host_experts_placed"] < rows["cpu-experts"]["host_experts_placed"]
    assert rows["ondemand"]["host_experts_placed"] == 0 and rows["ondemand"]["host_share"] == 0.0
    assert rows["cpu-experts"]["host_share"] == 1.0 and 0 < rows["ondemand-hybrid"]["host_share"] < 1
    hybrid = [run for run in results["runs"] if run["system"] == "ondemand-hybrid"]
    assert hybrid and all(run["host_computed_experts"] > 0 and run["tokens_equal"] for run in hybrid)
    assert baselines.count("auto") == 2 and "all" in baselines
    placements = [(name, kwargs) for group, name, kwargs in options if group == "placement"]
    assert ("auto", {"overlap": 1.0}) in placements and ("all", {}) in placements  # the option is auto's only
    assert results["options"]["placement_overlap"] == 1.0
    assert all(rows[name]["host_expert_ms"] > 0 and 0 <= rows[name]["host_hidden"] <= 1
               for name in ("cpu-experts", "ondemand-hybrid"))
    assert rows["ondemand"]["host_expert_ms"] is None and rows["ondemand"]["host_hidden"] is None
    assert "Host path:" in (tmp_path / "results.md").read_text() and "host hidden" in (tmp_path / "results.md").read_text()
    # Each placed cell carries what its placement was decided from and the cost model's per-token predictions.
    cells = {cell["system"]: cell for cell in results["cells"]}
    decision = cells["ondemand-hybrid"]["placement"]
    assert list(decision["host_s_per_expert_by_rows"].values()) == [2e-4] and decision["overlap"] == 1.0
    assert decision["copy_s_per_expert"] == pytest.approx(results["models"][0]["expert_bytes"] / 1e9)
    assert decision["link_bytes_per_s"] == 1e9 and decision["host_experts"] == rows["ondemand-hybrid"]["host_experts_placed"]
    assert decision["predicted_s_per_token"]["placed"] < decision["predicted_s_per_token"]["off"] and not decision["speculates"]
    speculating = cells["specter-hybrid"]["placement"]
    assert speculating["speculates"] and speculating["routing"] == "uniform" and speculating["host_experts"] == 0
    assert cells["cpu-experts"]["placement"]["overlap"] == 0.0 and cells["ondemand"]["placement"] is None
    assert rows["ondemand-hybrid"]["placement"] == decision and rows["ondemand-hybrid"]["host_expert_ms_calibrated"] == 0.2
    assert rows["ondemand"]["host_expert_ms_calibrated"] is None and "calibrated ms (1st run)" in (tmp_path / "results.md").read_text()
    # the kernels offered to the calibration start with torch's (tiny is float32: the native one is bf16 only), and
    # the one it chose is the cell's
    assert offered and all(names == ["torch"] for names in offered)
    assert decision["host_kernel"] == rows["ondemand-hybrid"]["host_kernel"] == "torch" and rows["ondemand"]["host_kernel"] is None
    assert "host kernel" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("flag, expected", [([], 1), (["--threads", "2"], 2)])
def test_bench_threads_reach_every_runtimes_build(tmp_path, monkeypatch, flag, expected):
    """`--threads` is EngineConfig.threads of each runtime the bench builds (the build sets torch's count, so setting
    it anywhere else would be undone there); on the CPU the bench's own default is 1."""
    import specter.build

    seen = []
    real = specter.build.apply_threads
    monkeypatch.setattr(specter.build, "apply_threads", lambda config, device: (seen.append(config.threads), real(config, device)))
    before = torch.get_num_threads()
    try:
        code = cli.main(["--systems", "resident,ondemand", "--max-new-tokens", "4", "--warmup-tokens", "2", "--link", "1",
                         "--no-progress", "--no-plots", "--no-hf", "--device", "cpu", *flag, "--out", str(tmp_path)])
        assert code == 0 and torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
    assert seen == [expected, expected]  # the resident runtime and the offloaded one


def test_bench_threads_below_one_are_one_line_errors(tmp_path, capsys):
    assert cli.main(["--threads", "0", "--no-progress", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --threads 0: expected 1 or more") and err.count("\n") == 1, err


def test_systems_placed_differently_by_one_policy_each_get_their_own_baseline(tmp_path, monkeypatch):
    """A placement may depend on whether the cell's system speculates (a trace profile's prefetch model), so two
    systems of one cell under the same policy name can be placed differently: each is held to the k = 0 run of its own
    placement, not to the first one's."""
    from specter import plugins
    from specter.bench import protocol
    from specter.placement import Placement

    class BySpeculation:
        name = "by-speculation"

        def place(self, state):
            expert = 1 if state.speculates else 2
            return Placement.of([[expert]] * state.num_layers, state.num_layers, state.num_experts)

    load_policy = plugins.load_policy
    monkeypatch.setattr(plugins, "load_policy", lambda group, name, **kwargs: (
        BySpeculation() if (group, name) == ("placement", "auto") else load_policy(group, name, **kwargs)))
    tables = []
    placed = protocol.ModelBench._placement_baseline

    async def spy(self, runtime, system, start_state, cell):
        await placed(self, runtime, system, start_state, cell)
        tables.append(dict(self.placed_baseline))

    monkeypatch.setattr(protocol.ModelBench, "_placement_baseline", spy)
    code = cli.main(["--systems", "ondemand,ondemand-hybrid,specter-hybrid", "--max-new-tokens", "6", "--warmup-tokens",
                     "4", "--link", "1", "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    placements = {key[2] for key in tables[-1]}  # (setting, link, placement, prompt): one baseline per placement
    assert len(tables) == 2 and len(placements) == 2, placements
    assert {placement[0] for placement in placements} == {frozenset({1}), frozenset({2})}
    runs = [run for run in results["runs"] if run["system"].endswith("-hybrid")]
    assert runs and all(run["host_computed_experts"] > 0 for run in runs)


def test_a_system_without_the_draft_reports_its_peak_without_the_shared_runtimes_draft(tmp_path, monkeypatch):
    """The offloaded systems share one runtime, built with the draft when any of them speculates; `ondemand` is planned
    (its slots) as if it had no draft, so its peak leaves the draft's bytes out, while `specter`'s keeps them. The GPU
    peak is faked here (the CPU has none)."""
    fake = int(1.007 * 2**30)  # 1.01 GiB as reported; tiny's draft (3 MiB) brings it under 1.005
    monkeypatch.setattr(protocol, "peak_gpu_bytes", lambda: fake)
    code = cli.main(["--systems", "ondemand,specter", "--max-new-tokens", "4", "--warmup-tokens", "4", "--no-progress",
                     "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0
    unused = {run["system"]: run["unused_draft_bytes"] for run in results["runs"] if run["system"] in ("ondemand", "specter")}
    assert unused["specter"] == 0 < unused["ondemand"]
    peaks = {row["system"]: row["peak_gib"] for row in results["summary"]}
    assert peaks["specter"] == 1.01 and peaks["ondemand"] == round((fake - unused["ondemand"]) / 2**30, 2) == 1.0
    assert "less the draft's bytes" in (tmp_path / "results.md").read_text()


def test_a_cells_peak_is_split_into_live_tensors_fragmentation_and_the_plan(tmp_path, monkeypatch):
    """Beside the peak reserve, each run records the peak of live tensors and of free bytes in partly used blocks (faked
    here: the CPU has no allocator figures) and the plan's device bytes for the cell's slots; the summary gives each in
    GiB, the draft's bytes left out for a system without it, except from the fragmentation, which is not the draft's."""
    allocated, split = int(0.756 * 2**30), int(0.1265 * 2**30)  # tiny's draft (3 MiB) takes either under its rounding
    monkeypatch.setattr(protocol, "gpu_memory_parts", lambda: {"peak_gpu_allocated_bytes": allocated,
                                                               "peak_gpu_inactive_split_bytes": split})
    code = cli.main(["--systems", "ondemand,specter", "--residents", "3", "--max-new-tokens", "4", "--warmup-tokens", "4",
                     "--no-progress", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0
    model = results["models"][0]
    runs = {run["system"]: run for run in results["runs"] if run["system"] in ("ondemand", "specter")}
    for run in runs.values():  # the fixed parts (weights, draft, KV, workspace) and this cell's slots of experts
        fixed = run["planned_gpu_bytes"] - model["moe_layers"] * run["slots"] * model["expert_bytes"]
        assert run["slots"] == 3 and 0 < fixed < run["planned_gpu_bytes"], run
    assert runs["specter"]["planned_gpu_bytes"] == runs["ondemand"]["planned_gpu_bytes"]  # one runtime, its draft in both
    rows = {row["system"]: row for row in results["summary"]}
    for system, run in runs.items():
        unused = run["unused_draft_bytes"]
        assert rows[system]["planned_gib"] == round((run["planned_gpu_bytes"] - unused) / 2**30, 2)
        assert rows[system]["peak_allocated_gib"] == round((allocated - unused) / 2**30, 2)
        assert rows[system]["peak_inactive_split_gib"] == 0.13
    assert runs["ondemand"]["unused_draft_bytes"] > 0 == runs["specter"]["unused_draft_bytes"]
    assert (rows["specter"]["peak_allocated_gib"], rows["ondemand"]["peak_allocated_gib"]) == (0.76, 0.75)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_allocators_figures_on_cuda_sit_inside_its_reserve():
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    blocks = [torch.empty(48 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    del blocks[0]  # a freed block the allocator keeps in its reserve
    parts, reserved = protocol.gpu_memory_parts(), protocol.peak_gpu_bytes()
    assert 96 * 2**20 <= parts["peak_gpu_allocated_bytes"] <= reserved, (parts, reserved)
    assert 0 <= parts["peak_gpu_inactive_split_bytes"] <= reserved - 48 * 2**20, (parts, reserved)


def test_a_run_into_a_folder_of_an_earlier_one_leaves_none_of_its_plots(tmp_path):
    """Only the plots a run drew were rewritten: an earlier run's speedup.png, of systems and links the new results do
    not have, stayed beside them (after a stop too, which draws none)."""
    from specter.bench.plots import PLOT_FILES

    out = tmp_path / "out"
    out.mkdir()
    for name in PLOT_FILES:
        (out / name).write_bytes(b"an earlier run's plot")
    assert cli.main(["--model", "tiny", "--systems", "resident", "--max-new-tokens", "2", "--warmup-tokens", "1",
                     "--no-plots", "--no-progress", "--out", str(out)]) == 0
    assert not [name for name in PLOT_FILES if (out / name).exists()]
    assert json.loads((out / "results.json").read_text())["complete"] is True


@pytest.mark.parametrize("argv", [["--out", ""], ["--merge", "", "--out", "merged"], ["--placement-profile", " "],
                                  ["--residents", "6,,4"], ["--systems", "ondemand,"], ["--budget", ",1GiB"]])
def test_an_empty_path_or_list_value_is_refused_before_anything_runs(argv, tmp_path, monkeypatch, capsys):
    """`--out ''` (an unset variable in a script) wrote into the current directory, moving its results.* aside, and
    `--merge ''` merged it; `--residents 6,,4` ran as 6,4: a value may have been lost at the doubled comma."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main([*QUICK, *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "empty path" in err or "an empty value in" in err, err
    assert list(tmp_path.iterdir()) == []
