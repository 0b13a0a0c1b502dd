"""specter.bench.realism: each metric on hand-made sequences whose answer is known, the draft match of the target
against itself, and the report of a tiny checkpoint (its keys, ranges, JSON and CLI)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specter.bench import realism
from specter.config import EngineConfig
from specter.decode import run_sync
from specter.engine import Runtime
from tests.hf_models import hf_model, save_hf

E, K = 8, 2


def routes(*rows: list[int]) -> list[np.ndarray]:
    return [np.array(rows)]


def test_repeated_4grams_on_known_token_lists():
    assert realism.repeated_ngram_share([1, 2, 3, 4, 5, 6, 7]) == 0.0  # 4 distinct 4-grams
    assert realism.repeated_ngram_share([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)  # 9 4-grams, the first 4 are new
    assert realism.repeated_ngram_share([7] * 10) == pytest.approx(6 / 7)  # one 4-gram seven times
    assert realism.repeated_ngram_share([1, 2, 3]) == 0.0  # no 4-gram at all


def test_same_experts_for_every_token():
    same = routes(*[[3, 5]] * 10)
    assert realism.usage_entropy(same, E) == pytest.approx(math.log(2) / math.log(E))  # two experts, evenly
    assert realism.usage_entropy(routes(*[[3]] * 10), E) == 0.0  # one expert: entropy 0
    assert realism.consecutive_overlap(same) == 1.0
    assert realism.window_reuse(same) == 1.0


def test_round_robin_is_uniform_and_has_no_locality():
    robin = routes(*[[(2 * t) % E, (2 * t + 1) % E] for t in range(4 * E)])  # tokens t, t+1 never share; 4 apart they do
    assert realism.usage_entropy(robin, E) == pytest.approx(1.0)
    assert realism.consecutive_overlap(robin) == 0.0
    reuse = realism.window_reuse(robin)  # token t reuses what token t-4 chose once t >= 4: 4 of the first tokens cannot
    assert reuse == pytest.approx((len(robin[0]) - 4) / (len(robin[0]) - 1))
    assert realism.window_reuse(robin, window=3) == 0.0


def test_half_overlap_and_a_window_of_eight():
    assert realism.consecutive_overlap(routes([0, 1], [1, 2], [2, 3])) == 0.5
    far = routes([0, 1], *[[2 + t % 6, 2 + (t + 1) % 6] for t in range(8)], [0, 1])  # [0, 1] again 9 tokens later
    assert realism.window_reuse(far, window=9) > realism.window_reuse(far)  # only a window of 9 sees it again
    assert realism._shared(far[0][-1], far[0][-9:-1]) == 0.0
    assert realism._shared(far[0][-1], far[0][-10:-1]) == 1.0


def test_set_match_counts_shared_experts_per_token():
    target = routes([0, 1], [2, 3], [4, 5], [6, 7])
    assert realism.set_match(target, target) == (1.0, 1.0)
    assert realism.set_match(routes([1, 0], [3, 2], [4, 6], [0, 1]), target) == (pytest.approx(0.625), pytest.approx(0.5))


def test_layer_summary_flags_unbalanced_layers():
    rows = realism.layer_metrics({0: routes(*[[0, 1]] * 8), 1: routes(*[[(2 * t) % E, (2 * t + 1) % E] for t in range(8)])}, E)
    summary = realism.summarise(rows)
    assert summary["low_entropy_layers"] == [0]
    assert summary["min_entropy"] == rows[0]["entropy"] < realism.BALANCED_ENTROPY <= rows[1]["entropy"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, one_thread) -> Path:
    path = save_hf(hf_model("qwen2_moe"), tmp_path_factory.mktemp("realism") / "qwen")
    (path / "prompts.json").write_text(json.dumps({"kinds": {"code": [[5, 6, 7, 8, 9, 10]], "prose": [[40, 41, 42, 43]]}}))
    (path / "held_out.json").write_text(json.dumps({"windows": [list(range(10, 30)), list(range(60, 76))]}))
    return path


def test_draft_match_of_the_target_against_itself_is_one(checkpoint):
    async def both() -> tuple:
        async with await Runtime.build(realism.weight_source(checkpoint, None), realism_config()) as runtime:
            sequence = [5, 6, 7, 8, 9, 10, 11, 12]
            one, _ = await realism.teacher_forced(runtime.model, runtime.experts, sequence, runtime.kv)
            two, loss = await realism.teacher_forced(runtime.model, runtime.experts, sequence, runtime.kv, want_loss=True)
            return one, two, loss, runtime.spec

    one, two, loss, spec = run_sync(both())
    assert sorted(one) == spec.moe_layers and all(one[layer].shape == (8, spec.top_k) for layer in one)
    assert all(realism.set_match([one[layer]], [two[layer]]) == (1.0, 1.0) for layer in one)
    assert 0 < loss < 2 * math.log(spec.vocab_size)


def realism_config() -> EngineConfig:
    return realism.realism_config("cpu", "int8", max_context=64)


def test_report_of_a_tiny_checkpoint(checkpoint, tmp_path):
    report = realism.realism_report(checkpoint, new_tokens=10, config=realism_config())
    assert set(report) >= {"model", "family", "num_layers", "moe_layers", "num_experts", "top_k", "held_out", "repetition",
                           "routing", "draft", "flags"}
    assert report["held_out"]["tokens"] == 19 + 15 and 0 < report["held_out"]["loss"] < 10
    assert set(report["repetition"]) >= {"greedy_4gram_repeat", "sampled_4gram_repeat", "temperature", "seed"}
    layers = report["routing"]["layers"]
    assert [row["layer"] for row in layers] == [0, 2]  # the fixture's layer 1 is dense (mlp_only_layers)
    for row in layers + report["held_out"]["routing"]["layers"]:
        assert set(row) == {"layer", "entropy", "overlap", "reuse8", "draft_match", "draft_exact"}
        assert all(0.0 <= row[key] <= 1.0 for key in row if key != "layer")
    draft = report["draft"]
    assert draft["quant"] == "int8" and draft["drafted_greedy"] > 0 and 0 <= draft["acceptance_greedy"] <= 1
    assert json.loads(json.dumps(report)) == report  # JSON-ready as it is
    assert "entropy" in realism.format_report(report)
    unmeasured = report | {"held_out": report["held_out"] | {"loss": None, "tokens": 0}}  # a checkpoint without held-out text
    assert "held-out loss: not measured" in realism.format_report(unmeasured)  # was "loss None nats/token over 0 tokens"


def test_cli_prints_the_table_and_writes_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "realism.json"
    assert realism.main(["--model", str(checkpoint), "--new-tokens", "6", "--device", "cpu", "--quant", "int8",
                         "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| layer | entropy |" in printed and "held-out loss" in printed
    assert json.loads(out.read_text())["new_tokens"] == 6


def test_no_prompts_is_refused(checkpoint):
    async def empty() -> None:
        async with await Runtime.build(realism.weight_source(checkpoint, None), realism_config()) as runtime:
            await realism.realism_async(runtime, [])

    with pytest.raises(realism.ConfigError, match="at least one prompt"):
        run_sync(empty())


@pytest.mark.parametrize(("name", "content", "says"), [
    ("prompts.json", "{not json", "prompts.json: expected {\"kinds\": {KIND: [[token ids], ...]}}"),
    ("prompts.json", '{"kinds": {"code": [[1, "x"]]}}', "every entry must be a list of token ids"),
    ("prompts.json", '{"kind": {}}', "(no 'kinds')"),
    ("prompts.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("prompts.json", '{"kinds": [[1, 2, 3]]}', "('kinds' is a list)"),
    ("held_out.json", '{"windows": {"w": [[1, 2, 3, 4, 5]]}}', "('windows' is a dict)"),
    ("held_out.json", '{"windows": [[1, 2], 3]}', "held_out.json: expected {\"windows\": [[token ids], ...]}"),
    ("held_out.json", '{"windows": [[1, -2]]}', "every entry must be a list of token ids (integers >= 0)"),
])
def test_a_trainers_malformed_prompt_file_is_named(checkpoint, tmp_path, capsys, name, content, says):
    """prompts.json and held_out.json beside a checkpoint were read unchecked: a traceback (KeyError, ValueError,
    RecursionError), after a load of minutes for the bench."""
    import shutil

    from specter.bench.protocol import checkpoint_prompts
    from specter.errors import CheckpointError

    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    (copy / name).write_text(content)
    assert realism.main(["--model", str(copy), "--new-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and str(copy / name) in err, err
    if name == "prompts.json":
        with pytest.raises(CheckpointError, match="prompts.json"):
            checkpoint_prompts(copy, 512, 1)


def test_a_report_onto_a_file_of_the_checkpoint_is_refused_before_decoding(checkpoint, tmp_path, capsys, monkeypatch):
    import shutil

    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    before = (copy / "config.json").read_bytes()
    monkeypatch.setattr(realism, "realism_report", lambda *a, **k: pytest.fail("decoded before checking --json"))
    assert realism.main(["--model", str(copy), "--device", "cpu", "--json", str(copy / "config.json")]) == 2
    assert "is config.json, a file of the checkpoint" in capsys.readouterr().err
    assert (copy / "config.json").read_bytes() == before
