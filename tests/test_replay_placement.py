"""Placements replayed from a routing trace (`specter.replay.replay_placements`, `python -m specter.replay --placement`):
the device path's misses and bytes, the host path's computations and a modelled time per token, on synthetic traces."""

from __future__ import annotations

import json
import random

import pytest

from policies.placement import Auto
from specter.placement import Placement
from specter.replay import main, replay, replay_placements
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
