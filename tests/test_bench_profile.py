"""The bench's `--placement-profile TRACE`: a routing trace every engine it builds places from (auto's cost model then
replays its rounds, not uniform routing), checked before anything loads; a trace of the narrow checkpoint serves its
widened model (`--widen`). On the CPU with the built-in tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specter import cli as specter_cli
from specter.bench import cli, report, systems
from specter.trace import TraceHeader, TraceRound, TraceWriter

RUN = ["--max-new-tokens", "6", "--warmup-tokens", "2", "--no-progress", "--no-plots", "--no-hf"]
TINY_MOE_LAYERS, TINY_EXPERTS = 4, 16  # the built-in tiny model's routing shape


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A routing trace of tiny as a user records one: `specter generate --trace`, offloaded (4 of 16 experts resident)
    and speculating (generate's default depth)."""
    path = tmp_path_factory.mktemp("profile") / "placement-trace.jsonl"
    assert specter_cli.main(["generate", "--model", "tiny", "--device", "cpu", "--residents", "4", "--max-new-tokens", "24",
                             "--prompt-ids", "5,6,7,8", "--json", "--trace", str(path)]) == 0
    return path


def write_trace(path: Path, layers: int, experts: int, rounds: int) -> Path:
    header = TraceHeader(model="t", num_layers=layers, num_experts=experts, expert_bytes=64, top_k=2, slots_per_layer=2)
    with TraceWriter(path, header) as writer:
        for index in range(rounds):
            used = [[index % experts, (index + 1) % experts]] * layers
            writer.write_round(TraceRound.from_arrays(index, 1, 1, 1e-3, np.zeros((layers, experts)), used))
    return path


@pytest.mark.parametrize("widen", [[], ["--widen", "2"]], ids=["tiny", "tiny-x2-from-the-narrow-trace"])
def test_every_engine_gets_the_profile_and_auto_places_from_its_rounds(tmp_path, monkeypatch, trace, widen, capsys):
    """Every runtime the bench builds has the trace as EngineConfig.placement_profile, and the hybrid's placement is
    decided from its rounds in order ('sequence' in the cell's `placement` record; without the option: 'uniform').
    Widened x2, tiny keeps its 4 MoE layers of 16 experts and routes as tiny does, so tiny's trace places it."""
    configs = []
    build = systems.BenchRuntime.build.__func__

    async def spy(cls, source, config=None):
        configs.append(config)
        return await build(cls, source, config)

    monkeypatch.setattr(systems.BenchRuntime, "build", classmethod(spy))
    out = tmp_path / "out"
    code = cli.main([*RUN, "--model", "tiny", *widen, "--systems", "resident,ondemand,specter-hybrid", "--link", "gen4",
                     "--placement-profile", str(trace), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert all(row["tokens_equal"] for row in results["summary"]), results["summary"]
    assert len(configs) == 2 and all(config.placement_profile == trace for config in configs)  # resident, offloaded
    cells = {cell["system"]: cell for cell in results["cells"]}
    assert cells["specter-hybrid"]["placement"]["routing"] == "sequence", cells["specter-hybrid"]
    assert cells["ondemand"]["placement"] is None
    assert results["options"]["placement_profile"] == results["args"]["placement_profile"] == str(trace)
    assert f"placement from the routing trace `{trace}`" in (out / "results.md").read_text()


def test_the_longer_priced_hybrid_runs_beside_the_summed_one_in_one_process(tmp_path, trace, capsys):
    """`specter-hybrid-longer` places with auto's overlap 1 whatever --placement-overlap says (its own), while
    `specter-hybrid` takes --placement-overlap (default: auto's 0): both in one process, each cell's `placement`
    record naming the overlap it was decided with, each held to its own placement's k = 0 run."""
    for given, summed in ((None, 0.0), ("0.5", 0.5)):
        out = tmp_path / f"out-{given}"
        code = cli.main([*RUN, "--model", "tiny", "--systems", "ondemand,specter-hybrid,specter-hybrid-longer", "--link",
                         "gen4", "--placement-profile", str(trace), "--out", str(out),
                         *(["--placement-overlap", given] if given else [])])
        assert code == 0, capsys.readouterr().err
        results = json.loads((out / "results.json").read_text())
        assert all(row["tokens_equal"] for row in results["summary"]), results["summary"]
        cells = {cell["system"]: cell for cell in results["cells"]}
        assert cells["specter-hybrid"]["placement"]["overlap"] == summed
        assert cells["specter-hybrid-longer"]["placement"]["overlap"] == 1.0


@pytest.mark.parametrize("own_tokens, routing", [(None, "sequence"), (0, "uniform")])
def test_without_a_profile_auto_prices_the_engines_own_trace_or_assumes_uniform_routing(tmp_path, own_tokens, routing):
    """The contrast the option exists for: without it the speculating hybrid places from the runtime's own trace, and
    the protocol line says so; with none of its own either (--self-profile-tokens 0), from uniform routing, and the
    protocol line says nothing of a trace."""
    out = tmp_path / "out"
    own = [] if own_tokens is None else ["--self-profile-tokens", str(own_tokens)]
    assert cli.main([*RUN, "--model", "tiny", "--systems", "ondemand,specter-hybrid", "--link", "gen4", *own,
                     "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    cell = next(cell for cell in results["cells"] if cell["system"] == "specter-hybrid")
    assert cell["placement"]["routing"] == routing and results["options"]["placement_profile"] is None
    assert cell["placement"]["profile"] == ("own" if own_tokens is None else None)
    said = "the engine's own routing trace (256 tokens of its text" in (out / "results.md").read_text()
    assert said == (own_tokens is None) and ("placement from the routing trace" not in (out / "results.md").read_text())


def bad_profiles(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file that is no profile of tiny, what the one-line error says of it)."""
    (tmp_path / "binary.trace").write_bytes(b"\xff\xfe\x00\x01 not text")
    (tmp_path / "results.json").write_text(json.dumps({"runs": [], "cells": []}, indent=1))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "dir").mkdir()
    return {
        "missing": (tmp_path / "absent.jsonl", "cannot read trace"),
        "directory": (tmp_path / "dir", "cannot read trace"),
        "binary": (tmp_path / "binary.trace", "is not a routing trace (not UTF-8 text"),
        "not a trace": (tmp_path / "results.json", "line 1: "),
        "empty file": (tmp_path / "empty.jsonl", "empty file"),
        "another model's layers": (write_trace(tmp_path / "deeper.jsonl", TINY_MOE_LAYERS + 1, TINY_EXPERTS, 2),
                                   f"a trace of {TINY_MOE_LAYERS + 1} MoE layers x {TINY_EXPERTS} experts (t) for a model "
                                   f"of {TINY_MOE_LAYERS} x {TINY_EXPERTS}"),
        "another model's experts": (write_trace(tmp_path / "wider.jsonl", TINY_MOE_LAYERS, 8, 2), "for a model of 4 x 16"),
        "no rounds": (write_trace(tmp_path / "rounds.jsonl", TINY_MOE_LAYERS, TINY_EXPERTS, 0), "the trace has no rounds"),
    }


@pytest.mark.parametrize("name", ["missing", "directory", "binary", "not a trace", "empty file", "another model's layers",
                                  "another model's experts", "no rounds"])
def test_a_bad_profile_is_a_one_line_error_before_anything_loads(tmp_path, monkeypatch, capsys, name):
    async def refuse(cls, source, config=None):
        raise AssertionError("a bad profile must be refused before any runtime is built")

    monkeypatch.setattr(systems.BenchRuntime, "build", classmethod(refuse))
    path, message = bad_profiles(tmp_path)[name]
    out = tmp_path / "out"
    assert cli.main([*RUN, "--model", "tiny", "--systems", "ondemand,specter-hybrid", "--link", "gen4",
                     "--placement-profile", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --placement-profile") and message in err and err.count("\n") == 1, err
    assert not (out / "results.json").exists()  # refused before the run's first write


def test_a_profile_is_of_one_model(tmp_path, capsys, trace):
    """A trace records one model's routing: a run of two models is refused (each gets a run and a trace of its own)."""
    code = cli.main([*RUN, "--model", "tiny", "--model", "qwen1.5-moe-a2.7b", "--layers", "2", "--placement-profile",
                     str(trace), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --placement-profile {trace}: a routing trace is of one model, and this run benches 2 "
                          "(tiny, qwen1.5-moe-a2.7b[L=2/24])") and "--merge" in err


def test_the_narrow_checkpoints_trace_is_a_profile_of_its_widened_model(trace):
    """Widening keeps the MoE layers and experts (and the routing function), so the profile check passes the narrow
    trace for every factor, and still refuses one of another shape."""
    for factor in ("2", "3"):
        targets, _ = cli.targets_from_args(cli.build_parser().parse_args(["--model", "tiny", "--widen", factor]))
        (target,) = targets
        assert (len(target.spec.moe_layers), target.spec.num_experts, target.widen) == (TINY_MOE_LAYERS, TINY_EXPERTS, int(factor))
        cli.check_placement_profile(trace, targets)
        other = write_trace(trace.with_name(f"other-x{factor}.jsonl"), TINY_MOE_LAYERS, 8, 1)
        with pytest.raises(cli.ConfigError, match="for a model of 4 x 16"):
            cli.check_placement_profile(other, targets)


def test_a_merge_names_each_parts_trace():
    """A merge keeps its first part's options; the protocol line names every part's trace (one per model's part)."""
    options = {"placement_profile": "a.jsonl"}
    assert report._profile_text({"options": options}) == "; placement from the routing trace `a.jsonl`"
    assert report._profile_text({"options": {"placement_profile": None}}) == ""
    merged = {"options": options, "merged_from": [{"placement_profile": "a.jsonl"}, {"placement_profile": None}, {}]}
    assert report._profile_text(merged) == "; placement from the merged parts' routing traces: `a.jsonl`, none (uniform routing)"
    # a part without a trace whose speculating hybrid placed from the engine's own: said so, with its own tokens
    merged_own = merged | {"merged_from": [{"placement_profile": "a.jsonl", "self_profile_tokens": 0},
                                           {"placement_profile": None, "self_profile_tokens": 128},
                                           {"placement_profile": None, "self_profile_tokens": 0}],
                           "cells": [{"placement": {"profile": "own"}}, {"placement": None}]}
    assert report._profile_text(merged_own) == ("; placement from the merged parts' routing traces: `a.jsonl`, none (the "
                                                "speculating hybrids from the engine's own routing trace (128 tokens of its "
                                                "text, recorded once per model))")
