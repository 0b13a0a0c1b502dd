"""Placements replayed from a routing trace (`specter.replay.replay_placements`, `python -m specter.replay --placement`):
the device path's misses and bytes, the host path's computations and a modelled time per token, on synthetic traces."""

from __future__ import annotations

import json
import random

import pytest

from policies.placement import Auto
from specter.placement import Placement
from specter.replay import main, replay, replay_placements, trace_placement_state
from specter.trace import LayerRoutes, TraceHeader, TraceRound, TraceWriter

EXPERT_BYTES = 10_000_000  # 10 ms at 1 GB/s
HEADER = TraceHeader(model="toy", num_layers=2, num_experts=8, expert_bytes=EXPERT_BYTES, top_k=2, slots_per_layer=2)


def random_rounds(count: int, k: int = 0, seed: int = 0) -> list[TraceRound]:
    """Rounds whose k + 1 rows each route to 2 of 8 experts, uniformly at random, at both layers."""
    rng = random.Random(seed)
    rounds = []
    for index in range(count):
        layers = []
        for _ in range(HEADER.num_layers):
            used = list(dict.fromkeys(e for _ in range(k + 1) for e in rng.sample(range(8), 2)))
            layers.append(LayerRoutes(predicted={}, used=used))
        rounds.append(TraceRound(round=index, k=k, accepted=k, draft_step_s=0.001, layers=layers))
    return rounds


def test_off_is_the_plain_replay():
    rounds = random_rounds(50)
    [off] = replay_placements(HEADER, rounds, ["off"], 1.0, eviction="lru", prefetch="none")
    plain = replay(HEADER, rounds, "lru", "none", 1.0)
    assert off.result.misses == plain.misses and off.result.host_computed == 0
    assert off.result.modelled_s == pytest.approx(plain.stall_s) and off.result.tokens == 50
    assert off.placement == Placement.device_only(2, 8)


def test_all_copies_nothing_and_computes_every_other_use_on_the_host():
    rounds = random_rounds(50)
    [every] = replay_placements(HEADER, rounds, ["all"], 1.0, host_block_s=0.004, eviction="lru", prefetch="none")
    result = every.result
    host_uses = sum(1 for r in rounds for routes in r.layers for e in routes.used if e not in (0, 1))
    assert result.misses == 0 and result.h2d_bytes == 0 and result.host_computed == host_uses
    assert result.host_s == pytest.approx(host_uses * 0.004) and result.modelled_s == pytest.approx(result.host_s)


def test_auto_beats_both_where_link_and_host_cost_the_same_and_run_at_once():
    """Copy 10 ms, host 10 ms per block, uniform routing, the two paths fully overlapped (overlap 1, the first version's
    model): off pays every miss on the link, all every use on the host; auto splits them between the two paths."""
    rounds = random_rounds(300, seed=1)
    off, every, auto = replay_placements(HEADER, rounds, ["off", "all", Auto(overlap=1.0)], 1.0, host_block_s=0.010,
                                         eviction="lru", prefetch="none", overlap=1.0)
    assert auto.result.placement == "auto"
    assert 0 < auto.placement.total < every.placement.total
    assert auto.result.per_token_s < min(off.result.per_token_s, every.result.per_token_s)
    assert auto.predicted_token_s < min(off.predicted_token_s, every.predicted_token_s)
    assert auto.result.misses < off.result.misses and auto.result.host_computed < every.result.host_computed


def test_where_the_paths_add_up_auto_at_equal_costs_moves_nothing_and_the_replay_sums_them():
    """The default (overlap 0): a layer costs its copies plus its host blocks, so at equal costs and uniform use the
    host path gains nothing (auto places nothing), and a split placement's replayed time is the sum of its two paths'.
    (With the trace's own, slightly uneven, counts as the profile the cache's churn can make `all` worth it.)"""
    rounds = random_rounds(100, seed=2)
    [auto] = replay_placements(HEADER, rounds, ["auto"], 1.0, host_block_s=0.010, eviction="lru", prefetch="none",
                               profile=[[1] * 8] * 2)
    assert auto.placement.total == 0
    split = Placement.of([[2, 3, 4]] * 2, 2, 8)
    summed = replay(HEADER, rounds, "lru", "none", 1.0, placement=split, placement_name="split", host_block_s=0.010)
    longer = replay(HEADER, rounds, "lru", "none", 1.0, placement=split, placement_name="split", host_block_s=0.010,
                    overlap=1.0)
    assert summed.modelled_s == pytest.approx(summed.misses * 0.010 + summed.host_s)
    assert summed.misses == longer.misses and longer.modelled_s < summed.modelled_s


def test_a_speculative_round_pays_a_host_expert_once_for_its_rows():
    rounds = random_rounds(20, k=3)
    [every] = replay_placements(HEADER, rounds, ["all"], 1.0, host_block_s=0.004, eviction="lru", prefetch="none")
    assert every.result.tokens == 80
    assert every.result.host_computed == sum(1 for r in rounds for routes in r.layers for e in routes.used if e not in (0, 1))


def test_a_host_placement_needs_the_hosts_cost():
    with pytest.raises(Exception, match="--host-ms"):
        replay_placements(HEADER, random_rounds(3), ["all"], 1.0)


def test_the_cli_compares_placements(tmp_path, capsys):
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        for trace_round in random_rounds(40, k=2, seed=3):
            writer.write_round(trace_round)
    assert main([str(path), "--placement", "off,all,auto", "--host-ms", "10", "--link", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["placement"] for row in report["results"]] == ["off", "all", "auto"]
    assert report["results"][0]["host_experts"] == 0 and report["results"][1]["host_experts"] == 12
    assert all(row["per_token_s"] > 0 and row["predicted_token_s"] > 0 for row in report["results"])
    assert main([str(path), "--placement", "off,auto", "--host-ms", "10", "--link", "1", "--profile", str(path)]) == 0
    table = capsys.readouterr().out
    assert "auto" in table and "link+host ms/tok" in table
    assert main([str(path), "--placement", "all"]) == 2  # no host cost given
    assert "--host-ms" in capsys.readouterr().err
    assert main([str(path), "--placement", "all", "--host-ms", "10", "--overlap", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overlap"] == 1.0
    with pytest.raises(SystemExit):
        main([str(path), "--placement", "all", "--host-ms", "10", "--overlap", "2"])


@pytest.fixture
def own_plugins(monkeypatch):
    """specter's own policies as entry points (pyproject.toml's), whatever else the environment has installed."""
    from importlib.metadata import EntryPoint

    from specter import plugins

    own = {"eviction": {"lru": "LRU", "lfu": "LFU", "plan-protect": "PlanProtect"},
           "prefetch": {"none": "NoPrefetch", "topm-keep": "TopMKeep"}, "placement": {"off": "Off", "all": "All", "auto": "Auto"}}
    fake = {f"specter.{group}": [EntryPoint(name, f"policies.{group}:{cls}", f"specter.{group}") for name, cls in named.items()]
            for group, named in own.items()}
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV, raising=False)
    monkeypatch.setattr(plugins, "entry_points", lambda group: fake.get(group, []))
    plugins.refresh()
    yield
    plugins.refresh()


@pytest.fixture
def toy_trace(tmp_path, own_plugins):
    path = tmp_path / "toy.jsonl"
    with TraceWriter(path, HEADER) as writer:
        for trace_round in random_rounds(40, k=2, seed=3):
            writer.write_round(trace_round)
    return path


def test_a_profile_without_rounds_is_uniform_routing_not_the_replayed_traces(toy_trace, tmp_path, capsys):
    """As the engine reads such a --placement-profile (`routing_profile`: (None, None), uniform): the replay fell back
    to the replayed trace's own rounds, so it and `specter info` disagreed. A speculating engine without a trace to
    price its misses is placed off by auto."""
    empty = tmp_path / "empty.jsonl"
    with TraceWriter(empty, HEADER):
        pass
    argv = [str(toy_trace), "--placement", "off,auto", "--host-ms", "1", "--link", "1", "--json"]
    assert main(argv) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["results"][1]["host_experts"] > 0  # placed from the replayed trace's own rounds, it puts some on the host
    assert main([*argv, "--profile", str(empty)]) == 0
    captured = capsys.readouterr()
    given = json.loads(captured.out)
    assert [row["host_experts"] for row in given["results"]] == [0, 0]
    assert f"note: the profile {empty} holds no rounds: the placements assume uniform routing" in captured.err
    assert (own["routing"], given["routing"], given["profile"]) == ("replayed trace", "uniform", str(empty))
    state = trace_placement_state(HEADER, random_rounds(3, k=2), 1.0, 1e-3, uniform=True)
    assert state.route_counts is None and state.route_sequence is None and state.speculates


def test_every_eviction_and_prefetch_named_is_replayed_with_the_placements(toy_trace, capsys):
    """`--eviction lru,plan-protect` replayed lru alone, silently."""
    argv = [str(toy_trace), "--placement", "off,all", "--host-ms", "1", "--link", "1", "--eviction", "lru,plan-protect",
            "--prefetch", "topm-keep"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(row["eviction"], row["prefetch"], row["placement"]) for row in rows] == [
        ("lru", "topm-keep", "off"), ("lru", "topm-keep", "all"),
        ("plan-protect", "topm-keep", "off"), ("plan-protect", "topm-keep", "all")]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "lru x topm-keep:" in table and "plan-protect x topm-keep:" in table


def test_the_text_says_when_no_host_cost_was_given(toy_trace, capsys):
    assert main([str(toy_trace), "--placement", "off"]) == 0
    out = capsys.readouterr().out
    assert "no host cost given (--host-ms)" in out and "None" not in out


@pytest.mark.parametrize("slots", ["1", "9"])
def test_placements_refuse_slots_the_engine_would_refuse(toy_trace, capsys, slots):
    assert main([str(toy_trace), "--placement", "off", "--slots", slots]) == 2
    assert f"error: --slots {slots}: expected 2..8 slots per MoE layer" in capsys.readouterr().err


def test_the_cost_models_replay_holds_only_the_recording_prefetch_to_the_traces_plans():
    """A profile recorded with `--prefetch none` has rounds whose checkpoints are empty: auto's replay of the engine's
    own prefetch (topm-keep) over them planned nothing, pricing the device path as if nothing were prefetched. The
    header names the recording plug-in, and only that one is held to the recorded plans."""
    import dataclasses

    import numpy as np

    from specter.placement import prefetch_misses
    from specter.replay import layer_prefetch_costs

    rounds = []
    for r in range(6):  # three pairs in turn through 2 slots, each predicted by the draft: a prefetch has work
        pair = [2 * (r % 3), 2 * (r % 3) + 1]
        counts = np.zeros((2, 8))
        counts[:, pair] = 3.0
        rounds.append(TraceRound.from_arrays(r, 4, 4, 0.01, counts, [pair, pair], checkpoints=[]))

    def state(recorder):
        header = dataclasses.replace(HEADER, extra={} if recorder is None else {"prefetch": recorder})
        return trace_placement_state(header, rounds, 1.0, 1e-3, slots_per_layer=2, eviction="lru", prefetch="topm-keep")

    by_none, by_keep = state("none"), state("topm-keep")
    assert by_none.route_sequence.recorded_prefetch == "none"
    planned = layer_prefetch_costs(by_none, 0, frozenset(), "lru", "topm-keep")
    held = layer_prefetch_costs(by_keep, 0, frozenset(), "lru", "topm-keep")
    assert sum(loaded for loaded, _ in planned) > 0 == sum(loaded for loaded, _ in held)
    assert prefetch_misses(by_none, 0) <= prefetch_misses(by_keep, 0)
