"""The command line as a user runs it: JSON output, built-in model, errors on stderr with non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

from specter.cli import main
from tests.hf_models import hf_model, save_hf


def test_generate_json_is_stable(capsys, tmp_path):
    path = save_hf(hf_model("olmoe"), tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"tokens", "stats"}
    assert len(out["tokens"]) == 5 and all(isinstance(t, int) for t in out["tokens"])
    assert out["stats"]["new_tokens"] == 5 and out["stats"]["prompt_tokens"] == 3


def test_generate_matches_library_greedy(capsys, tmp_path):
    from specter.config import EngineConfig
    from specter.decode import greedy_decode, run_sync
    from specter.loader import load_resident

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
            "--top-p", "0.9", "--seed", "11", "--link", "gen4", "--trace", str(trace)]
    assert main(argv) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    config = engine_config(build_parser().parse_args(argv))
    assert (config.residents, config.eviction, config.draft.k, config.draft.k_max, config.draft.quant, config.draft.sampling,
            config.link, config.max_context) == (2, "lru", 3, 5, "int8", "rejection", "gen4", 128)
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
    assert main(["generate", "--budget", "1GiB", "--residents", "2", "--device", "cpu"]) == 2
    assert "either budget or residents" in capsys.readouterr().err
    assert main(["generate", "--eviction", "nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no eviction plug-in named 'nope'" in err and "lru" in err


def test_text_prompt_without_tokenizer_is_a_clear_error(capsys, tmp_path):
    path = save_hf(hf_model("olmoe"), tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err


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
