"""The command line as a user runs it: JSON output, built-in model, errors on stderr with non-zero exit."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specter.cli import main
from tests.hf_models import hf_model, save_hf


def test_generate_json_is_stable(capsys, tmp_path):
    path = save_hf(hf_model("olmoe"), tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"tokens", "stats"}
    assert len(out["tokens"]) == 5 and all(isinstance(t, int) for t in out["tokens"])
    assert out["stats"]["new_tokens"] == 5 and out["stats"]["prompt_tokens"] == 3


def test_generate_json_prints_one_object_when_the_prompts_pass_fails(capsys, tmp_path, monkeypatch):
    """--json promises one object at the end: a request that failed before its first token printed nothing on stdout
    (the error went to stderr), so a script reading the object got no JSON at all."""
    from specter.engine import Runtime
    from specter.errors import CheckpointError

    async def fails(self, prompt, params, stats):
        raise CheckpointError("the model's logits at position 3 are not finite (inf or nan)")

    monkeypatch.setattr(Runtime, "_prefill", fails)
    path = save_hf(hf_model("olmoe"), tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["tokens"] == [] and out["text"] == "" and out["finish_reason"] == "error"
    assert "not finite" in out["error"] and "not finite" in captured.err and out["stats"]["new_tokens"] == 0


def test_generate_matches_library_greedy(capsys, tmp_path):
    from specter.config import EngineConfig
    from specter.decode import greedy_decode, run_sync
    from specter.build import load_resident

    path = save_hf(hf_model("mixtral"), tmp_path / "m")
    main(["generate", "--model", str(path), "--prompt-ids", "4,5,6", "--max-new-tokens", "6", "--json", "--device", "cpu"])
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    loaded = load_resident(path, EngineConfig(device="cpu"))
    assert tokens == run_sync(greedy_decode(loaded.model, loaded.experts, [4, 5, 6], 6))


def test_generate_scout_counts_scouted_rounds(capsys, tmp_path):
    path = save_hf(hf_model("mixtral"), tmp_path / "m")
    args = ["generate", "--model", str(path), "--prompt-ids", "4,5,6", "--max-new-tokens", "6", "--json", "--device", "cpu",
            "--residents", "2", "--k", "0"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--scout"]) == 0
    scouted = json.loads(capsys.readouterr().out)
    assert scouted["tokens"] == plain["tokens"]
    assert plain["stats"]["scouted_rounds"] == 0 and scouted["stats"]["scouted_rounds"] == scouted["stats"]["rounds"] == 5


def test_builtin_model_by_subprocess(tmp_path):
    env = {"SPECTER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "specter", "generate", "--max-new-tokens", "4", "--json"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["tokens"]) == 4


def test_errors_exit_nonzero_with_message(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert "not a directory" in capsys.readouterr().err
    path = save_hf(hf_model("olmoe"), tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,999", "--device", "cpu"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


# ---- the full generate command on the built-in model ---------------------------------------------------
from safetensors import safe_open  # noqa: E402

from specter.builtin import builtin_path  # noqa: E402
from specter.cli import build_parser, engine_config  # noqa: E402


def test_prompt_text_streams_and_summarises(capsys):
    assert main(["generate", "--prompt", "hello", "--residents", "2", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert main(["generate", "--prompt", "hello", "--residents", "2", "--max-new-tokens", "8", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert captured.out == out["text"] + "\n" and len(out["tokens"]) == 8
    note, summary = captured.err.splitlines()  # the built-in model's one note, then the statistics
    assert "random weights" in note
    assert summary.startswith("[8 tokens, TTFT ") and "acceptance" in summary and "H2D" in summary
    assert {"ttft_s", "tpot_s", "acceptance_rate", "mean_accepted_length", "hit_rate", "h2d_bytes", "stall_s"} <= set(out["stats"])


def test_every_engine_option_reaches_the_engine(capsys, tmp_path):
    from specter import Engine, GenerationConfig
    from specter.kernel import run

    trace = tmp_path / "routes.trace"
    argv = ["generate", "--prompt-ids", "7,8,9", "--max-new-tokens", "6", "--json", "--device", "cpu", "--dtype", "float32",
            "--max-context", "128", "--residents", "2", "--eviction", "lru", "--prefetch", "topm-frequency", "--lookahead", "fixed",
            "--k", "3", "--k-max", "5", "--quant", "int8", "--sampling", "rejection", "--temperature", "0.7", "--top-k", "40",
            "--top-p", "0.9", "--seed", "11", "--link", "gen4", "--trace", str(trace), "--tune", "cache.lead_relay=false",
            "--tune", "verify.routing_poll_s=0.0005"]
    assert main(argv) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    config = engine_config(build_parser().parse_args(argv))
    assert (config.residents, config.eviction, config.draft.k, config.draft.k_max, config.draft.quant, config.draft.sampling,
            config.link, config.max_context) == (2, "lru", 3, 5, "int8", "rejection", "gen4", 128)
    assert (config.tuning.cache.lead_relay, config.tuning.verify.routing_poll_s) == (False, 0.0005)
    generation = GenerationConfig(max_new_tokens=6, temperature=0.7, top_k=40, top_p=0.9, seed=11)

    async def library():
        async with Engine.from_pretrained("tiny", config) as engine:
            return (await engine.complete([7, 8, 9], generation)).token_ids

    assert tokens == run(library())
    assert trace.stat().st_size > 0


def test_budget_option_and_its_errors(capsys):
    assert main(["generate", "--budget", "1MiB", "--device", "cpu"]) == 2
    assert "short of the minimum" in capsys.readouterr().err
    assert main(["generate", "--budget", "lots", "--device", "cpu"]) == 2
    assert "is not a size" in capsys.readouterr().err
    from specter.config import EngineConfig
    from specter.errors import ConfigError

    with pytest.raises(ConfigError, match="either budget or residents"):  # the command line refuses the pair itself
        EngineConfig(budget="1GiB", residents=2)
    assert main(["generate", "--eviction", "nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no eviction plug-in named 'nope'" in err and "lru" in err


def test_text_prompt_without_tokenizer_is_a_clear_error(capsys, tmp_path):
    path = save_hf(hf_model("olmoe"), tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "has no tokenizer.json to read it" in capsys.readouterr().err


def test_info_matches_the_files(capsys):
    assert main(["info", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    with safe_open(str(builtin_path("tiny") / "model.safetensors"), "pt") as handle:
        on_disk = sum(_numel(handle.get_slice(name).get_shape()) for name in handle.keys())
    assert info["parameters"] == on_disk
    expert = 3 * 128 * 256
    assert info["active_parameters"] == on_disk - 4 * (16 - 2) * expert and info["expert_bytes"] == expert * 4
    assert (info["family"], info["layers"], info["experts"]) == ("qwen2_moe", 4, 16)
    assert info["minimum_budget"] < info["resident_budget"]
    assert info["resident_budget"] - info["minimum_budget"] == 4 * (16 - 2) * expert * 4
    assert main(["info", "tiny"]) == 0
    text = capsys.readouterr().out
    assert "minimum budget" in text and "full residency" in text and "qwen2_moe" in text


def test_info_under_an_allow_list_without_all_and_auto_shows_what_it_may(capsys, monkeypatch):
    """info shows `all` and `auto` beside the placement asked for: an allow-list that leaves them out made info fail
    though neither was asked for; now their figures are left out. The one asked for must still be allowed."""
    monkeypatch.setenv("SPECTER_PLUGINS", "lru,topm-keep,plan-protect,fixed,cpu,off")
    assert main(["info", "tiny", "--residents", "6", "--no-measure", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["auto_host_experts"] is None and set(info["predicted_ms_per_token"]) == {"off"}
    assert main(["info", "tiny", "--residents", "6", "--no-measure"]) == 0
    assert "SPECTER_PLUGINS does not allow the placement 'auto'" in capsys.readouterr().out
    assert main(["info", "tiny", "--residents", "6", "--no-measure", "--cpu-experts", "all"]) == 2
    assert "does not allow it" in capsys.readouterr().err


def test_info_at_a_budget_gives_the_slots_with_and_without_the_draft(capsys):
    """`info --budget`: the slots per layer the budget leaves speculating (the draft's bytes taken first) and without a
    draft (what `--k-max 0` loads with), each as the engine's memory plan splits that budget; the placement is made for
    the first. Below the minimum with the draft only: the second alone; below both, or a size without a unit: exit 2
    with the reason, nothing printed on stdout."""
    import torch

    from specter.builtin import resolve_model
    from specter.config import EngineConfig, parse_bytes
    from specter.memory import plan_memory
    from specter.model.checkpoint import Checkpoint

    spec = Checkpoint(resolve_model("tiny")).spec
    assert main(["info", "tiny", "--json", "--no-measure"]) == 0
    minimum = json.loads(capsys.readouterr().out)["minimum_budget"]
    plain_minimum = plan_memory(spec, torch.float32, EngineConfig(), speculative=False).minimum_budget
    assert plain_minimum < minimum

    def slots(budget: int, speculative: bool) -> int:
        return plan_memory(spec, torch.float32, EngineConfig(budget=budget), speculative=speculative).slots_per_layer

    def total(budget: int, speculative: bool) -> int:  # every layer's slots: one more in some layers
        return plan_memory(spec, torch.float32, EngineConfig(budget=budget), speculative=speculative).total_slots

    budget = minimum + 5 * 2**20
    assert main(["info", "tiny", "--json", "--no-measure", "--budget", str(budget)]) == 0
    info = json.loads(capsys.readouterr().out)
    got = info["budget_slots"]
    assert (got["speculating"], got["without_draft"]) == (slots(budget, True), slots(budget, False))
    assert spec.top_k <= got["speculating"] < got["without_draft"] < spec.num_experts
    assert info["placement_slots"] == got["speculating"] and info["speculates"] is True
    assert main(["info", "tiny", "--no-measure", "--budget", str(budget)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("at budget"))
    for kind in ("speculating", "without_draft"):
        per, extra, layers = got[kind], got[f"{kind}_extra"], got["moe_layers"]
        assert 0 <= extra < layers
        shown = f"{per} ({per + 1} in {extra} of {layers} layers)" if extra else f"{per}"
        assert f"{shown} {'speculating' if kind == 'speculating' else 'without a draft'}" in line

    # the budget beyond the slots (less than one slot), and the budget of one slot more, as the plan splits it
    for kind, speculative in (("speculating", True), ("without_draft", False)):
        plan = plan_memory(spec, torch.float32, EngineConfig(budget=budget), speculative=speculative)
        assert got[f"{kind}_extra"] == plan.extra_slots and plan.total_slots == got[kind] * plan.moe_layers + plan.extra_slots
        assert got[f"{kind}_idle_bytes"] == budget - plan.device_bytes and 0 <= got[f"{kind}_idle_bytes"] < plan.slot_bytes
        nxt = got[f"{kind}_next_budget"]
        assert (total(nxt, speculative), total(nxt - 1, speculative)) == (plan.total_slots + 1, plan.total_slots)
    printed = re.findall(r"idle, ([0-9.]+) (MiB|GiB) for one slot more", line)
    assert len(printed) == 2
    for (size, unit), kind, speculative in zip(printed, ("speculating", "without_draft"), (True, False)):
        at_least = parse_bytes(f"{size}{unit}")  # a budget given as printed gets the slot it promises
        assert at_least >= got[f"{kind}_next_budget"] and total(at_least, speculative) == total(budget, speculative) + 1

    between = (plain_minimum + minimum) // 2
    assert main(["info", "tiny", "--json", "--no-measure", "--budget", str(between)]) == 0
    info = json.loads(capsys.readouterr().out)
    got = info["budget_slots"]
    assert got["speculating"] is None and "short of the minimum" in got["speculating_refused"]
    assert info["speculates"] is False and info["placement_slots"] == got["without_draft"]  # placed as without a draft
    assert got["without_draft"] == slots(between, False) >= spec.top_k

    for budget in (str(plain_minimum - 2**20), "20"):
        assert main(["info", "tiny", "--no-measure", "--budget", budget]) == 2
        out, err = capsys.readouterr()
        assert out == "" and ("short of the minimum" in err or "give a unit" in err)


def test_info_times_the_host_as_the_builder_calibrates(monkeypatch):
    """`info`'s measured host figures: the host path's call with one row routed to top_k experts per job, then jobs of
    one expert (the job's fixed part), as `calibrate` times them at load, each job on experts no other job read (the
    tiny model: top-2)."""
    from specter.cli import checkpoint_summary
    from specter.experts import costs

    timed = []

    async def time_host_expert(kernel, pool, mlp, hidden_size, row_bucket, threads, device, per_job=1, repeats=costs.REPEATS,
                               parallel=False, first_job=0, **_):
        assert not parallel  # the default tuning: one expert after another
        timed.append(costs.cold_groups(pool.num_layers, pool.num_experts, per_job, first_job + repeats + 1)[first_job:])
        return 2e-3 if per_job == 1 else 1.5e-3  # a job of two: 3 ms, of one: 2 ms -> 1 ms an expert + 1 ms a job

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    summary = checkpoint_summary("tiny", residents=2, link="1", measure=True)
    [pairs, singles] = timed
    assert all(len(experts) == 2 for _, experts in pairs) and all(len(experts) == 1 for _, experts in singles)
    read = [(layer, expert) for layer, experts in pairs + singles for expert in experts]
    assert len(read) == len(set(read)) == 3 * (costs.REPEATS + 1)
    assert summary["host_ms_per_expert"] == pytest.approx(1.0) and summary["host_ms_per_job"] == pytest.approx(1.0)


def test_tune_reaches_info_and_a_bad_one_is_refused_before_loading(capsys, monkeypatch):
    """`--tune` on `info` changes how it times the host (host.parallel_experts: one expert per job, one thread); on
    `generate` and `info` an unknown field or a bad value exits 2 naming it, before any checkpoint is read."""
    from specter.experts import costs

    seen = []

    async def time_host_expert(kernel, pool, mlp, hidden_size, row_bucket, threads, device, per_job=1, repeats=costs.REPEATS,
                               parallel=False, **_):
        seen.append((per_job, parallel))
        return 1e-3

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    assert main(["info", "tiny", "--link", "1", "--json"]) == 0
    assert main(["info", "tiny", "--link", "1", "--json", "--tune", "host.parallel_experts=true"]) == 0
    assert seen == [(2, False), (1, False), (1, True)]  # top_k a job, then one a job (its fixed part); parallel: one
    capsys.readouterr()
    monkeypatch.setattr("specter.model.checkpoint.Checkpoint.__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
    for argv in (["info", "tiny", "--tune", "host.parallel=true"], ["generate", "--tune", "host.parallel=true"],
                 ["generate", "--tune", "host.parallel_experts=maybe"], ["info", "tiny", "--tune", "host"],
                 ["serve", "--tune", "host.parallel=true"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err and "host" in err, (argv, err)  # the one message


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def test_logs_are_json_on_request(capsys):
    assert main(["generate", "--max-new-tokens", "2", "--device", "cpu", "--log-json", "--log-level", "info"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert any(line["event"] == "engine.loaded" and line["level"] == "info" for line in lines)
    from specter import log

    log.configure()  # back to the quiet console default for the tests that follow


# ---- issue 25: bad input refused before the model loads, in one line ---------------------------------------
def _refuse_loading(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr("specter.api.Engine.load", no_load)


def test_text_that_is_not_utf8_exits_2_with_one_line(tmp_path):
    env = {"SPECTER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args in (["--prompt", b"ab\xff"], ["--prompt", "hi", "--stop", b"\xfe"]):
        argv = [arg if isinstance(arg, bytes) else arg.encode() for arg in [sys.executable, "-m", "specter", "generate", *args]]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "is not valid Unicode" in result.stderr and "UTF-8" in result.stderr
    assert "--stop 1 is not valid Unicode: character 0 is U+DCFE" in result.stderr


def test_output_paths_are_checked_before_loading(capsys, monkeypatch, tmp_path):
    _refuse_loading(monkeypatch)
    assert main(["generate", "--trace", "/nonexistent/x.trace", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "error: --trace /nonexistent/x.trace: the folder /nonexistent does not exist; create it or choose another path\n"
    assert main(["generate", "--trace", str(tmp_path), "--device", "cpu"]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_bench_out_is_checked_before_any_run(capsys, tmp_path):
    from specter.bench.cli import main as bench_main

    (tmp_path / "file").write_text("")
    assert bench_main(["--out", str(tmp_path / "file" / "results")]) == 2
    assert "cannot write into" in capsys.readouterr().err


def _short_model(tmp_path, positions=64):
    directory = shutil.copytree(builtin_path("tiny"), tmp_path / "short")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"max_position_embeddings": positions}))
    return str(directory)


def test_context_beyond_the_model_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    model = _short_model(tmp_path)
    _refuse_loading(monkeypatch)
    cases = [(["--max-new-tokens", "100"], "prompt of 4 tokens plus max_new_tokens 100 exceeds the maximum context of 64"),
             (["--max-context", "100000"], "max_context 100000 is more than the model's max_position_embeddings 64"),
             (["--prompt-ids", ",".join(["1"] * 100)], "prompt of 100 tokens plus max_new_tokens 32 exceeds")]
    for args, says in cases:
        assert main(["generate", "--model", model, "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1


def test_info_reports_kv_for_the_context_used(capsys, tmp_path):
    assert main(["info", _short_model(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_context"] == 64 and summary["max_position_embeddings"] == 64
    assert summary["kv_bytes"] == 2 * 4 * 2 * 64 * 32 * 4  # K and V, 4 layers, 2 KV heads, 64 tokens, head 32, fp32
    assert main(["info", _short_model(tmp_path / "b"), "--max-context", "65"]) == 2
    assert "max_position_embeddings 64" in capsys.readouterr().err


def test_clamped_settings_are_errors(capsys, monkeypatch):
    _refuse_loading(monkeypatch)
    assert main(["generate", "--k", "8", "--k-max", "2", "--device", "cpu"]) == 2
    assert "k = 8 is above k_max = 2" in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "--k-max", "2", "--threads", "3"])
    assert engine_config(args).draft.k == 2 and engine_config(args).threads == 3  # no --k: the default within --k-max


def test_an_empty_stop_string_is_refused_before_loading(capsys, monkeypatch):
    """`--stop ""` (an unset variable in a script) was dropped, and the run went on without the stop it was given."""
    _refuse_loading(monkeypatch)
    assert main(["generate", "--prompt", "hi", "--stop", "", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "stop string 0 is empty" in err and err.count("\n") == 1, err


def test_info_shows_the_stored_host_figure_the_next_load_takes(monkeypatch, capsys):
    """`info` takes this machine's stored host figure as a load would (and says so), measures and stores one where
    there is none or with --recalibrate; `generate --recalibrate` reaches the engine's config."""
    from specter.cli import build_parser, engine_config
    from specter.experts import costs

    figures = iter([1e-3, 3e-3])

    async def time_host_expert(*args, per_job=1, **kwargs):
        if per_job == 1:  # the jobs of one expert after those of top_k: no fixed part here
            return last[0]
        last[0] = next(figures)
        return last[0]

    last = [None]

    monkeypatch.setattr(costs, "time_host_expert", time_host_expert)
    seen = []
    for argv in (["info", "tiny", "--link", "1", "--json"], ["info", "tiny", "--link", "1", "--json"],
                 ["info", "tiny", "--link", "1", "--json", "--recalibrate"], ["info", "tiny", "--link", "1", "--json"]):
        assert main(argv) == 0
        summary = json.loads(capsys.readouterr().out)
        seen.append((summary["host_ms_per_expert"], summary["host_source"]))
    assert seen == [(1.0, "measured"), (1.0, "stored"), (3.0, "measured"), (3.0, "stored")]
    assert main(["info", "tiny", "--link", "1"]) == 0
    assert "threads, stored)" in capsys.readouterr().out
    assert engine_config(build_parser().parse_args(["generate", "--recalibrate"])).recalibrate
    assert not engine_config(build_parser().parse_args(["generate"])).recalibrate


def test_placement_overlap_reaches_the_engine_and_info(capsys):
    """--placement-overlap is EngineConfig.placement_overlap (auto's overlap: tests/test_hybrid.py), and info prices auto
    with it; out of 0..1 it is a configuration error before anything loads."""
    assert engine_config(build_parser().parse_args(["generate", "--placement-overlap", "1"])).placement_overlap == 1.0
    assert engine_config(build_parser().parse_args(["generate"])).placement_overlap is None
    assert main(["info", "tiny", "--residents", "2", "--link", "1", "--no-measure", "--cpu-experts", "auto",
                 "--placement-overlap", "0.5"]) == 0
    assert "overlap 0.5" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2", "--placement-overlap", "1.5"]) == 2
    assert "--placement-overlap 1.5: Input should be less than or equal to 1" in capsys.readouterr().err


# ---- outputs that fail, and inputs refused before loading --------------------------------------------------
def _specter(*args: str, env: dict | None = None, **options) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specter", *args], stderr=subprocess.PIPE, text=True,
                            env=env, **options)


def test_a_reader_that_leaves_early_ends_generate_quietly(tiny):
    """`specter generate | head -c 5`: a broken pipe is no error (it was a BrokenPipeError traceback)."""
    process = _specter("generate", "--model", str(tiny), "--max-new-tokens", "200", "--device", "cpu",
                       stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.read(5)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141 and "Traceback" not in err and "error" not in err, err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("where", ["stdout", "trace"])
def test_an_output_that_cannot_be_written_is_one_error_line(tiny, where):
    """A full disk (here /dev/full) under stdout or the trace: exit 2 and one line naming it, not a traceback."""
    args = ["generate", "--model", str(tiny), "--max-new-tokens", "4", "--device", "cpu", "--residents", "4"]
    with open("/dev/full", "w") as full:
        if where == "stdout":
            process = _specter(*args, "--json", stdout=full)
        else:
            process = _specter(*args, "--json", "--trace", "/dev/full", stdout=subprocess.PIPE)
        out, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert process.returncode == 2 and "Traceback" not in err, err
    assert lines == [lines[0]] and "No space left on device" in lines[0]
    assert ("stdout" if where == "stdout" else "routing trace /dev/full") in lines[0]
    if where == "trace":  # the request finished before the trace's last write failed: its answer is printed still
        answer = json.loads(out)
        assert len(answer["tokens"]) == 4 and answer["finish_reason"] == "length" and "TPOT" in err


def test_an_unusable_specter_cache_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = subprocess.run([sys.executable, "-m", "specter", "generate", "--max-new-tokens", "2"], capture_output=True,
                            text=True, env={"SPECTER_CACHE": str(blocker), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "SPECTER_CACHE" in result.stderr and str(blocker) in result.stderr


@pytest.mark.parametrize("args, says", [
    (["--chat", "--prompt-ids", "1,2"], "--chat sends --prompt"),
    (["--temperature", "nan"], "finite"),
    (["--top-p", "nan"], "finite"),
    (["--residents", "2", "--link", "1e-9"], "from 0.001"),
    (["--residents", "2", "--link", "inf"], "from 0.001"),
])
def test_inputs_refused_before_loading_with_a_short_message(capsys, monkeypatch, args, says):
    import specter.api

    monkeypatch.setattr(specter.api.Engine, "load", lambda *a, **k: pytest.fail("loaded before refusing"))
    assert main(["generate", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert len(err) < 400, err  # one short message, not the whole configuration


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1"])
def test_prompt_ids_with_an_empty_item_are_refused(capsys, ids):
    with pytest.raises(SystemExit) as refused:
        main(["generate", "--prompt-ids", ids])
    assert refused.value.code == 2 and "comma-separated integers" in capsys.readouterr().err


def test_info_refuses_residents_below_top_k_as_generate_does(capsys):
    assert main(["info", "tiny", "--residents", "1"]) == 2
    assert "expected 2..16 slots per MoE layer" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use_before_loading(monkeypatch, capsys):
    import socket

    import specter.server.cli

    monkeypatch.setattr(specter.server.cli, "serve", lambda *a: pytest.fail("loaded before refusing"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


# ---- what info prints about a budget, as the engine loads it ---------------------------------------------------
def _info(capsys, *args: str) -> dict:
    assert main(["info", "tiny", "--no-measure", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _loaded_slots(budget: str, **draft) -> tuple[int, ...]:
    from specter.builtin import builtin_path
    from specter.config import EngineConfig
    from specter.engine import Runtime
    from specter.kernel import run

    async def load():
        runtime = await Runtime.load(builtin_path("tiny"), EngineConfig(device="cpu", budget=budget, draft=draft))
        try:
            return tuple(runtime.cache.layer_slots) if runtime.cache is not None else ()
        finally:
            await runtime.aclose()

    return run(load())


def test_the_minimum_and_full_residency_info_prints_work_when_typed_back(capsys):
    """They were printed rounded down: `--budget 46.7MiB`, as printed, was refused as '0.0 MiB short of 46.7 MiB'."""
    from specter.memory import fmt

    summary = _info(capsys)
    printed_minimum = fmt(summary["minimum_budget"], round_up=True).replace(" ", "")
    printed_full = fmt(summary["resident_budget"], round_up=True).replace(" ", "")
    assert len(set(_loaded_slots(printed_minimum))) >= 1  # loads: the minimum as printed suffices
    assert _loaded_slots(printed_full) == ()  # every expert resident: no cache
    assert main(["generate", "--device", "cpu", "--budget", str(summary["minimum_budget"] - 1)]) == 2
    assert " 0.1 MiB short of the minimum" in capsys.readouterr().err  # a byte short is not "0.0 MiB short"


def test_info_at_a_budget_counts_the_extra_slots_and_k_max_as_the_engine_does(capsys):
    """`--cpu-experts all` counted host experts at the fewest slots in every layer (24 where the engine placed 21),
    and a deeper --k-max, which takes workspace from the slots, could not be given to info at all."""
    summary = _info(capsys, "--budget", "60MiB", "--cpu-experts", "all")
    loaded = _loaded_slots("60MiB")
    assert summary["host_experts"] == sum(16 - slots for slots in loaded) and len(set(loaded)) == 2
    deep = _info(capsys, "--budget", "60MiB", "--k-max", "32")["budget_slots"]
    assert (deep["speculating"], deep["speculating_extra"]) == (min(_loaded_slots("60MiB", k_max=32)),
                                                                sum(_loaded_slots("60MiB", k_max=32)) - 4 * deep["speculating"])


def test_an_engine_without_a_draft_sizes_its_verify_for_one_row_block():
    """k = 0 with a k_max of 32 builds no draft, yet sized its workspace for 33 verify rows: 7 slots fewer."""
    assert _loaded_slots("60MiB", k=0, k_max=32) == _loaded_slots("60MiB", k_max=0)


# ---- --placement-profile and --trace: checked whatever the run does with them ---------------------------------
def _trace_header(path: Path, layers: int, experts: int) -> Path:
    path.write_text(json.dumps({"format": "specter-trace", "version": 1, "model": "other", "num_layers": layers,
                                "num_experts": experts, "expert_bytes": 64, "top_k": 2, "slots_per_layer": 2}) + "\n")
    return path


@pytest.mark.parametrize("cpu_experts", ["off", "all"])
def test_a_placement_profile_is_checked_whatever_places(capsys, tmp_path, cpu_experts):
    """A gzip file or another model's trace was accepted with rc 0 and no note under the default --cpu-experts off
    (never read), and refused under `all`: it is refused at load under both, with the same message."""
    import gzip

    packed = tmp_path / "run.trace.gz"
    packed.write_bytes(gzip.compress(b'{"format": "specter-trace"}\n'))
    other = _trace_header(tmp_path / "other.trace", 3, 6)  # tiny is 4 MoE layers x 16 experts
    base = ["generate", "--device", "cpu", "--residents", "4", "--max-new-tokens", "2", "--cpu-experts", cpu_experts]
    assert main([*base, "--placement-profile", str(packed)]) == 2
    assert f"{packed} is not a routing trace (not UTF-8 text" in capsys.readouterr().err
    assert main([*base, "--placement-profile", str(other)]) == 2
    assert (f"placement_profile {other}: a trace of 3 MoE layers x 6 experts (other) for a model of 4 x 16"
            in capsys.readouterr().err)
    assert main([*base[:3], "--max-new-tokens", "2", "--placement-profile", str(other)]) == 2  # every expert resident
    assert "a trace of 3 MoE layers x 6 experts" in capsys.readouterr().err


def test_a_placement_profile_under_cpu_experts_off_is_said_unused(capsys, tmp_path):
    profile = _trace_header(tmp_path / "tiny.trace", 4, 16)
    assert main(["generate", "--device", "cpu", "--residents", "4", "--max-new-tokens", "2",
                 "--placement-profile", str(profile)]) == 0
    assert "with --cpu-experts off every expert stays on the device path" in capsys.readouterr().err
    assert main(["generate", "--device", "cpu", "--residents", "4", "--max-new-tokens", "2", "--cpu-experts", "all",
                 "--placement-profile", str(profile)]) == 0
    assert "--cpu-experts off" not in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    ([], "every expert is resident (no --budget or --residents keeps them all)"),
    (["--residents", "16"], "every expert is resident (--residents holds all 16 per layer)"),
    (["--budget", "1GiB"], "every expert is resident (--budget holds all 16 per layer)"),
    (["--residents", "4", "--k", "0"], "--k 0 makes every round plain, and only speculative rounds are recorded"),
    (["--residents", "4", "--k", "0", "--scout"], "--k 0 makes every round plain (scouted)"),
    (["--residents", "4", "--k-max", "0"], "--k-max 0 turns speculation off"),
])
def test_a_trace_that_would_record_no_round_is_refused_before_loading(capsys, monkeypatch, tmp_path, args, says):
    """These runs wrote a header-only trace and said nothing; its replay is a vacuous hit rate of 1."""
    _refuse_loading(monkeypatch)
    trace = tmp_path / "run.trace"
    assert main(["generate", "--device", "cpu", "--max-new-tokens", "2", *args, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --trace {trace}: this engine would record no round: ") and says in err, err
    assert not trace.exists()


def test_a_trace_of_an_offloaded_speculating_engine_is_recorded(capsys, tmp_path):
    trace = tmp_path / "run.trace"
    assert main(["generate", "--device", "cpu", "--max-new-tokens", "8", "--residents", "4", "--trace", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) > 1


def test_an_empty_trace_path_is_refused(capsys, monkeypatch):
    """`--trace ''` (an unset variable in a script) was taken as no --trace: nothing recorded, nothing said."""
    _refuse_loading(monkeypatch)
    assert main(["generate", "--device", "cpu", "--residents", "4", "--trace", ""]) == 2
    assert capsys.readouterr().err == ("error: --trace: empty path; give the file to write the routing trace to, or "
                                       "leave --trace out\n")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_trace_onto_a_file_of_the_checkpoint_is_refused_before_loading(capsys, monkeypatch, tmp_path, name):
    """`--trace MODEL/model.safetensors` truncated the weights (a float32 run then died of SIGBUS reading its mapped
    file, output lost) and `--trace MODEL/config.json` left a trace in its place: both destroyed the model."""
    _refuse_loading(monkeypatch)
    model = shutil.copytree(builtin_path("tiny"), tmp_path / "model")
    before = (model / name).read_bytes()
    link = tmp_path / "elsewhere.trace"
    link.symlink_to(model / name)  # the same file by another name
    for target in (model / name, link):
        assert main(["generate", "--model", str(model), "--device", "cpu", "--residents", "4", "--max-new-tokens", "2",
                     "--trace", str(target)]) == 2
        err = capsys.readouterr().err
        assert f"is {name}, a file of the checkpoint {model}" in err and "choose another path" in err, err
    assert (model / name).read_bytes() == before
    from specter.paths import check_not_an_input

    check_not_an_input(model / "new.trace", model, "--trace")  # a new file beside the checkpoint's is no harm
    for earlier in ("old.trace", "trace.json", "sub/report.json"):  # nor another one there: an earlier output
        (model / earlier).parent.mkdir(exist_ok=True)
        (model / earlier).write_text("an earlier output")
        check_not_an_input(model / earlier, model, "--trace")


def test_a_trace_onto_a_file_of_the_built_in_model_is_refused(capsys, monkeypatch):
    """`--model tiny` names the built-in model by name: its folder in the cache was not checked, and a trace written
    over its config.json broke it for good (it is rebuilt only when config.json is missing)."""
    _refuse_loading(monkeypatch)
    config = builtin_path("tiny") / "config.json"
    before = config.read_bytes()
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--residents", "4", "--trace", str(config)]) == 2
    assert "is config.json, a file of the checkpoint" in capsys.readouterr().err
    assert config.read_bytes() == before


def test_a_trace_onto_the_placement_profile_it_reads_is_refused(capsys, monkeypatch, tmp_path):
    """`--placement-profile prof.trace --trace prof.trace` replaced the profile with the run's own trace, rc 0."""
    _refuse_loading(monkeypatch)
    profile = tmp_path / "prof.trace"
    profile.write_text('{"format": "specter-trace"}\n')
    before = profile.read_bytes()
    link = tmp_path / "same.trace"
    link.symlink_to(profile)
    for target in (profile, link):
        assert main(["generate", "--device", "cpu", "--residents", "4", "--cpu-experts", "auto",
                     "--placement-profile", str(profile), "--trace", str(target)]) == 2
        assert (f"--trace {target}: is the --placement-profile this run reads; writing it would replace it; choose "
                "another path") in capsys.readouterr().err
    assert profile.read_bytes() == before


def _without_tokenizer(tmp_path) -> str:
    directory = shutil.copytree(builtin_path("tiny"), tmp_path / "ids-only")
    (directory / "tokenizer.json").unlink()
    return str(directory)


def test_text_the_checkpoint_cannot_read_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    """A text prompt or --stop without tokenizer.json, --chat without a chat template and a text prompt longer than the
    context are known from the tokenizer files: refused before a load that on a large model takes minutes."""
    _refuse_loading(monkeypatch)
    ids_only = _without_tokenizer(tmp_path)
    cases = [(["--model", ids_only, "--prompt", "hello"], "--prompt is text, and the checkpoint at"),
             (["--model", ids_only, "--prompt-ids", "1,2", "--stop", "x"], "--stop is text, and the checkpoint at"),
             (["--prompt", "hello", "--chat"], "has no chat template"),
             (["--model", _short_model(tmp_path), "--prompt", "hello world " * 40, "--max-new-tokens", "4"],
              "exceeds the maximum context of 64")]
    for args, says in cases:
        assert main(["generate", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and err.startswith("error: "), err


def test_a_text_prompt_is_tokenized_once_and_decodes_as_the_api_does(capsys):
    """The CLI hands the engine the ids it checked the context with: the same tokens as the Python API's text prompt."""
    from specter import EngineConfig, SyncEngine

    assert main(["generate", "--device", "cpu", "--prompt", "hello world", "--max-new-tokens", "6", "--k", "2",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    with SyncEngine(builtin_path("tiny"), EngineConfig(device="cpu", draft={"k": 2})) as engine:
        expected = engine.complete("hello world", max_new_tokens=6, temperature=0)
    assert printed["tokens"] == expected.token_ids and printed["text"] == expected.text


def test_output_stdout_cannot_encode_is_escaped_not_a_traceback(tmp_path):
    """stdout in ASCII (LANG=C, a redirected cp1252 console): the characters it lacks come out escaped, with one note;
    the rest of the output is all there and the status is 0."""
    env = {"SPECTER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "ascii"}
    script = ("import sys; from specter.exits import run_tool\n"
              "def main():\n    print('before'); print('caf\\u00e9 \\u4e2d'); print('after'); return 0\n"
              "sys.exit(run_tool(main))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                            cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\ncaf\\xe9 \\u4e2d\nafter\n"
    assert "Traceback" not in result.stderr and result.stderr.count("note: stdout's encoding (ascii)") == 1


@pytest.mark.parametrize("argv, says", [
    (["generate", "--model", ""], "error: the model path is empty; give a checkpoint directory or a built-in model's "
                                  "name (tiny)\n"),  # was "config.json: missing" (Path('') is the current directory)
    (["info", ""], "error: the model path is empty"),
    (["generate", "--model", "TINY"], "TINY: not a directory; pass the checkpoint directory holding config.json and "
                                      "*.safetensors (or a built-in model's name: tiny)"),
    (["generate", "--cpu-experts", "auto", "--placement-profile", ""], "--placement-profile '': empty path; give a "
                                                                         "routing trace file"),  # was "'.' is not a file"
])
def test_an_empty_or_unknown_model_or_profile_path_says_so(argv, says, capsys, monkeypatch):
    _refuse_loading(monkeypatch)
    assert main([*argv, "--device", "cpu"] if argv[0] == "generate" else argv) == 2
    assert says in capsys.readouterr().err


def test_an_empty_trace_path_to_replay_says_so(capsys):
    from specter.replay import main as replay_main

    assert replay_main([""]) == 2
    assert "the trace path is empty; give a routing trace file" in capsys.readouterr().err


def test_an_empty_specter_cache_is_the_default_not_the_current_directory(monkeypatch, tmp_path):
    """SPECTER_CACHE="" wrote the 27 MB built-in model into the current directory."""
    from specter.builtin import cache_dir

    monkeypatch.setenv("SPECTER_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "specter"


@pytest.mark.parametrize("model", [None, 5])
def test_the_python_api_names_a_model_of_the_wrong_type(model):
    from specter import Engine, EngineConfig
    from specter.errors import ConfigError
    from specter.kernel import run

    with pytest.raises(ConfigError, match=r"the model must be a checkpoint directory \(a str or Path\) or a built-in "
                                          rf"model's name \(tiny\), got {type(model).__name__}"):
        run(Engine.load(model, EngineConfig(device="cpu")))
    with pytest.raises(ConfigError, match="got EngineConfig"):  # SyncEngine(EngineConfig()): the config as the model
        run(Engine.load(EngineConfig(), None))


@pytest.mark.parametrize("argv, says", [
    (["--max-context", "0"], "error: invalid configuration: --max-context 0: Input should be greater than or equal to 8\n"),
    (["--k-max", "40"], "--k-max 40: Input should be less than or equal to 32"),
    (["--k", "16"], "the draft's options (--k, --k-max, --quant, --sampling, --scout, --overlap): k = 16 is above k_max = 15"),
    (["--placement-overlap", "nan"], "--placement-overlap nan: Input should be a finite number"),  # was "<= 1"
    (["--temperature", "nan"], "--temperature nan: Input should be a finite number"),
    (["--top-p", "2"], "--top-p 2.0: Input should be less than or equal to 1"),
])
def test_a_bad_option_is_named_as_typed_not_as_its_config_field(argv, says, capsys, monkeypatch):
    """The CLI's errors named Python fields (`EngineConfig.max_context = 0`) and dumped the draft's whole dict."""
    _refuse_loading(monkeypatch)
    assert main(["generate", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "EngineConfig." not in err and "GenerationConfig." not in err, err


def test_info_names_a_bad_option_as_typed_too(capsys):
    assert main(["info", "tiny", "--k-max", "40"]) == 2
    err = capsys.readouterr().err
    assert "--k-max 40: Input should be less than or equal to 32" in err and "EngineConfig." not in err, err


def test_the_python_apis_errors_keep_the_field_names():
    from specter import EngineConfig
    from specter.errors import ConfigError

    with pytest.raises(ConfigError, match=r"EngineConfig\.max_context = 0: Input should be greater than or equal to 8"):
        EngineConfig(max_context=0)


@pytest.mark.parametrize("argv, says", [
    (["--k", "7", "--lookahead", "roofline"], "note: --k sets the fixed lookahead's depth; --lookahead roofline chooses k"),
    (["--cpu-threads", "3", "--recalibrate"], "note: --cpu-threads, --recalibrate set how the host expert path runs or "
                                              "is placed; with --cpu-experts off no expert is computed on the host, so "
                                              "they are not used"),
    (["--top-p", "0.9"], "note: --top-p shape sampling; at --temperature 0 (the default) decoding is greedy"),
])
def test_an_option_the_others_leave_unused_is_noted(argv, says, capsys, monkeypatch):
    """These ran with rc 0 and no word, as if they had been used."""
    _refuse_loading(monkeypatch)
    with pytest.raises(AssertionError, match="the model was loaded"):  # said before the load, which the test stops
        main(["generate", "--device", "cpu", "--residents", "4", *argv])
    assert says in capsys.readouterr().err


def test_options_that_are_used_are_not_noted():
    from specter.cli import generation_config, unused_options

    args = build_parser().parse_args(["generate", "--k", "3", "--lookahead", "fixed", "--temperature", "0.7", "--top-p",
                                      "0.9", "--cpu-experts", "auto", "--cpu-threads", "2"])
    assert unused_options(args, engine_config(args), generation_config(args)) == []


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_budget_and_residents_together_are_refused_in_the_options_words(capsys, command):
    """Both name the device's expert memory: the command line refuses the pair by its options (argparse's usage
    error, exit 2, nothing loaded), where the configuration's rule names its fields."""
    with pytest.raises(SystemExit) as refused:
        main([command, "--budget", "1GiB", "--residents", "4"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "argument --residents: not allowed with argument --budget" in err, err
    assert "[--budget SIZE | --residents N]" in err  # the usage line shows them as alternatives


def test_plugins_lists_every_group_with_where_each_comes_from(capsys, monkeypatch):
    """A policy author's first question, which plug-ins are installed and under which names, had no answer but a
    wrong name's error. `specter plugins` lists each group's plug-ins with distribution, object, the default and
    what SPECTER_PLUGINS hides."""
    assert main(["plugins", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert set(groups) == {"specter.eviction", "specter.prefetch", "specter.lookahead", "specter.placement", "specter.backends"}
    eviction = {row["name"]: row for row in groups["specter.eviction"]["plugins"]}
    assert groups["specter.eviction"]["default"] == "plan-protect" and eviction["plan-protect"]["default"]
    assert eviction["lru"]["object"] == "policies.eviction:LRU" and eviction["lru"]["allowed"]
    assert eviction["dummy-random"]["dist"] == "specter-dummy-policy"  # the tests' third-party package
    assert groups["specter.prefetch"]["default"] == "topm-keep"
    monkeypatch.setenv("SPECTER_PLUGINS", "lru,cpu")
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "dummy-random" in text and "(not allowed by SPECTER_PLUGINS)" in text
    assert [line for line in text.splitlines() if line.strip().startswith("lru ")][0].endswith("policies.eviction:LRU")
    assert "SPECTER_PLUGINS=lru,cpu: only the plug-ins it names may load" in text
