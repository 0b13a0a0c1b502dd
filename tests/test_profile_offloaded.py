"""benchmarks/profile_offloaded.py on a trained narrow checkpoint read widened, one prompt kind, sampled: what the
next GPU run profiles (docs/BENCHMARKS.md, "What is not measured yet"), here on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_of_a_widened_checkpoint_sampled_on_one_prompt_kind(tmp_path, monkeypatch, capsys):
    model, out = tmp_path / "narrow", tmp_path / "profile"
    assert load("reference_model").main(["--tiny", "--out", str(model), "--max-steps", "2", "--log-every", "1"]) == 0
    docs = json.loads((model / "prompts.json").read_text())["kinds"]["docs"][0][:16]
    profile = load("profile_offloaded")
    monkeypatch.setattr(sys, "argv", ["profile_offloaded.py", "--model", str(model), "--widen", "2", "--residents", "2",
                                      "--k", "2", "--prompt-kind", "docs", "--temperature", "0.7", "--top-p", "0.9",
                                      "--tokens", "4", "--device", "cpu", "--top", "3", "--out", str(out)])
    profile.main()
    printed = capsys.readouterr().out
    assert f"{model} x2 residents=2 k=2" in printed and "prompt=docs temperature=0.7 top_p=0.9" in printed
    assert profile.PROMPT == docs  # the kind asked for, not the first
    assert "4 tokens in" in printed and (out / "cprofile_tottime.txt").read_text().count("ncalls") == 1


@pytest.mark.parametrize("argv, message", [(["--widen", "2"], "--widen needs --model"),
                                           (["--prompt-kind", "docs"], "--prompt-kind needs --model")])
def test_profile_refuses_options_without_a_checkpoint(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_offloaded.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit):
        load("profile_offloaded").main()
    assert message in capsys.readouterr().err
