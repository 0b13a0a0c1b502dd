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
