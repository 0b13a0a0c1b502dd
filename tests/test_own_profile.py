"""An engine that speculates and places with `auto` records its own routing trace at load where no placement profile
is given (`EngineConfig.self_profile_tokens`, `Runtime.own_routing_profile`): `auto` then prices its misses from the
rounds of that trace instead of placing it `off`, the engine is left as a fresh one, and its tokens equal the same
placement's k = 0 run. The bench's speculating hybrids do the same, once per model."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from structlog.testing import capture_logs

from specter import log
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.model.checkpoint import Checkpoint
from specter.placement import Placement, PlacementState
from tests.test_hybrid import placed_by
from tests.test_speculative import DEVICE, checkpoint

SLOW_LINK = "0.001"
"""GB/s: an expert's copy costs seconds, so `auto` sends the non-residents that its pricing sees used to the host."""
SLOW_PROFILE_S = 8.0
"""Seconds an own trace is made to take in the bench's test: far above a tiny cell's own time."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("own-profile"))


def config(**fields) -> EngineConfig:
    base = dict(device=DEVICE, max_context=96, residents=2, cpu_threads=1, cpu_experts="auto", link=SLOW_LINK,
                draft=DraftConfig(k=3, quant="int8"))
    return EngineConfig(**{**base, **fields})


def events(logs: list[dict], name: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] == name]


def loaded(path: str, engine: EngineConfig, prompt: list[int] | None = None, generation: GenerationConfig | None = None):
    """Load, note what the load left, and run `prompt`: (placement or None, KV length, loads in flight, whether the
    acceptance estimates are the prior's, result or None)."""

    async def go():
        async with await Runtime.load(path, engine) as runtime:
            host = runtime.experts.host
            fresh = not any(runtime.estimates.acceptance_seen) and runtime.estimates.draft_step_s is None
            state = (host.placement if host is not None else None, runtime.kv.length, runtime.loads_in_flight(), fresh)
            result = await runtime.complete_ids(prompt, generation) if prompt is not None else None
            return (*state, result)

    return asyncio.run(go())


def test_auto_places_a_speculating_engine_from_its_own_trace(root):
    """Without a trace `auto` placed a speculating engine `off` (its misses unpriced); with its own trace it prices
    them: over a link this slow, experts go to the host, and the load logs the trace it decoded."""
    path = checkpoint("mixtral", root)
    log.configure(level="INFO")  # the decision record is an info event (`logging_as_found` restores the level)
    with capture_logs() as logs:
        placement, kv_length, in_flight, fresh, _ = loaded(path, config())
    [own] = events(logs, "placement.own_profile")
    [decided] = events(logs, "placement.decided")
    assert own["tokens"] > 1 and own["rounds"] > 0
    assert decided["routing"] == "sequence" and not events(logs, "placement.needs_trace")
    assert placement is not None and placement.total == decided["host_experts"] > 0
    assert kv_length == 0 and in_flight == 0 and fresh  # a fresh engine: its own decoding left nothing behind

    with capture_logs() as logs:
        placement, *_ = loaded(path, config(self_profile_tokens=0))
    assert placement is None and not events(logs, "placement.own_profile") and events(logs, "placement.needs_trace")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_self_placed_engine_equals_its_placements_k0_run(root, temperature):
    """Placed after its own decoding (the cache full of experts that are now the host's, the KV used): its tokens equal
    a target-only run (k = 0) under the same placement, greedy and seeded sampling."""
    path = checkpoint("qwen2_moe", root)
    prompt, generation = [5, 17, 3, 60, 2], GenerationConfig(max_new_tokens=16, temperature=temperature, seed=3,
                                                             top_p=0.9 if temperature else None)
    placement, *_, speculative = loaded(path, config(residents=Checkpoint(path).spec.top_k), prompt, generation)
    assert placement is not None and placement.total > 0

    class Fixed:
        name = "fixed"

        def place(self, state: PlacementState) -> Placement:
            return placement

    with placed_by(Fixed()):
        same, *_, plain = loaded(path, config(residents=Checkpoint(path).spec.top_k, draft=DraftConfig(k=0, k_max=0)),
                                 prompt, generation)
    assert same == placement
    assert speculative.tokens == plain.tokens and speculative.stats.host_computed_experts > 0


@pytest.mark.parametrize("fields", [
    {"link": None},  # the CPU without an emulated link: the copy is not measured, so nothing could be priced
    {"cpu_experts": "all"},  # `all` needs no trace: it prices nothing
    {"draft": DraftConfig(k=0, k_max=0)},  # no draft: nothing to record a round with
])
def test_no_own_trace_where_it_would_not_be_priced(root, fields):
    path = checkpoint("mixtral", root)
    log.configure(level="INFO")
    with capture_logs() as logs:
        loaded(path, config(**fields))
    assert not events(logs, "placement.own_profile") and events(logs, "engine.loaded")


def test_the_own_trace_drafts_k_max_every_round_whatever_the_lookahead(root, monkeypatch):
    """A depth chosen from timings (`roofline`) would cut the text into other rounds at each load, and the placement
    priced from them could differ from load to load: the own trace runs every round at k_max (the last cut to the
    tokens left), and the engine's own lookahead is back afterwards."""
    from specter import engine
    from specter.trace import read_trace

    depths, read = [], engine.routing_profile

    def spy(path, *shape):
        depths.append([(trace_round.k, trace_round.accepted) for trace_round in read_trace(path)[1]])
        return read(path, *shape)

    monkeypatch.setattr(engine, "routing_profile", spy)
    path = checkpoint("mixtral", root)

    async def go():
        async with await Runtime.load(path, config(cpu_experts="off", lookahead="roofline",
                                                   draft=DraftConfig(k=2, k_max=5, quant="int8"))) as runtime:
            before = runtime.lookahead
            own = await runtime.own_routing_profile()
            return own, runtime.lookahead is before

    own, restored = asyncio.run(go())
    [rounds] = depths
    assert restored and own.rounds >= len(rounds) > 1 and own.route_sequence is not None
    assert all(k == 5 for k, _ in rounds[:-1]) and 1 <= rounds[-1][0] <= 5


def test_a_short_context_bounds_the_own_trace(root):
    """The prompt and the tokens decoded fit max_context: half of it for the prompt, the rest decoded."""
    path = checkpoint("mixtral", root)
    log.configure(level="INFO")
    with capture_logs() as logs:
        loaded(path, config(max_context=20))
    [own] = events(logs, "placement.own_profile")
    assert 1 < own["tokens"] <= 10


def test_the_bench_places_its_speculating_hybrids_from_one_own_trace(root, tmp_path, monkeypatch):
    """`specter-hybrid` without --placement-profile: its cells place from the engine's own trace (`profile` "own",
    routing "sequence"), recorded once for the model's runtime; `ondemand-hybrid` (k = 0) from uniform routing; each
    cell's tokens equal its placement's own k = 0 run; the report says where the placement came from."""
    from specter.bench.cli import main

    path = checkpoint("mixtral", root)
    out = tmp_path / "bench"
    decoded, own = [], Runtime.own_routing_profile

    async def counted(runtime):
        decoded.append(runtime)
        return await own(runtime)

    monkeypatch.setattr(Runtime, "own_routing_profile", counted)
    code = main(["--model", path, "--device", DEVICE, "--residents", "2", "--link", f"{SLOW_LINK},gen4",
                     "--systems", "ondemand,specter-hybrid,ondemand-hybrid", "--max-new-tokens", "8", "--k", "3",
                     "--quant", "int8", "--no-plots", "--no-hf", "--no-progress", "--out", str(out)])
    assert code == 0 and len(decoded) == 1
    payload = json.loads((out / "results.json").read_text())
    placed = {(cell["system"], cell["link"]): cell["placement"] for cell in payload["cells"] if cell["status"] == "ok"}
    for link in (SLOW_LINK, "gen4"):
        assert placed[("specter-hybrid", link)]["profile"] == "own" and placed[("specter-hybrid", link)]["routing"] == "sequence"
        assert placed[("ondemand-hybrid", link)]["profile"] is None and placed[("ondemand-hybrid", link)]["routing"] == "uniform"
    assert placed[("specter-hybrid", SLOW_LINK)]["host_experts"] > 0
    assert payload["runs"] and all(run["tokens_equal"] for run in payload["runs"])
    assert "own routing trace" in (out / "results.md").read_text()


def test_the_own_trace_leaves_the_engine_as_a_fresh_one(root):
    """Over a link this fast `auto` places nothing, so no placement reloads the cache: what the own decoding left must be
    undone by itself. Against an engine that decoded none: the cache's residents and counters, the use history, the
    link's bandwidth estimate and the stage counters alike."""
    path = checkpoint("mixtral", root)

    async def state(engine: EngineConfig):
        async with await Runtime.load(path, engine) as runtime:
            assert runtime.experts.host is None
            cache = runtime.cache
            return (cache.snapshot().layers, cache.stats.total().bytes_loaded, runtime.uses.clock,
                    cache.transfer.bandwidth_bytes_per_s, runtime.stages.by_stage)

    log.configure(level="INFO")
    with capture_logs() as logs:
        profiled = asyncio.run(state(config(link="1000")))
    assert events(logs, "placement.own_profile")
    assert profiled == asyncio.run(state(config(link="1000", self_profile_tokens=0)))


def test_a_gptq_draft_is_placed_from_the_cache_as_loaded(root):
    """The GPTQ calibration decodes before the placement and fills the cache: `all` keeps the same experts on the device
    as with an int8 draft (the lowest ids of an empty cache), not the calibration's last ones."""
    path = checkpoint("mixtral", root)
    placed = {quant: loaded(path, config(cpu_experts="all", draft=DraftConfig(k=2, quant=quant)))[0]
              for quant in ("int8", "gptq4")}
    assert placed["gptq4"] == placed["int8"] is not None

    async def state(quant: str):  # without a placement too: the first request is served as by an int8 engine
        async with await Runtime.load(path, config(cpu_experts="off", draft=DraftConfig(k=2, quant=quant))) as runtime:
            cache = runtime.cache
            return cache.snapshot().layers, cache.stats.total().bytes_loaded, runtime.uses.clock, cache.transfer.bandwidth_bytes_per_s

    assert asyncio.run(state("gptq4")) == asyncio.run(state("int8")) == (((),) * 3, 0, 0, None)


def test_a_fixed_lookahead_is_profiled_at_its_own_depth(root, monkeypatch):
    """The engine that drafts k tokens a round is priced from rounds of k, not k_max: a host expert is computed once a
    round, so the rounds' length is what the placement weighs."""
    from specter import engine
    from specter.trace import read_trace

    depths, read = [], engine.routing_profile

    def spy(path, *shape):
        depths.append([trace_round.k for trace_round in read_trace(path)[1]])
        return read(path, *shape)

    monkeypatch.setattr(engine, "routing_profile", spy)
    loaded(checkpoint("mixtral", root), config(lookahead="fixed", draft=DraftConfig(k=2, k_max=6, quant="int8")))
    [rounds] = depths
    assert len(rounds) > 1 and set(rounds[:-1]) == {2} and rounds[-1] <= 2


def test_the_bench_keeps_the_own_trace_out_of_its_cells_time(root, tmp_path, monkeypatch):
    """The cell that records the runtime's one own trace does not count its time: the longest cell sets the time
    budget, and a slow own trace would skip later cells."""
    from specter.bench.cli import main

    own = Runtime.own_routing_profile

    async def slow(runtime):
        await asyncio.sleep(SLOW_PROFILE_S)
        profile = await own(runtime)
        return dataclasses.replace(profile, seconds=profile.seconds + SLOW_PROFILE_S)

    monkeypatch.setattr(Runtime, "own_routing_profile", slow)
    out = tmp_path / "bench"
    assert main(["--model", checkpoint("mixtral", root), "--device", DEVICE, "--residents", "2", "--link", SLOW_LINK,
                 "--systems", "specter-hybrid", "--max-new-tokens", "4", "--k", "3", "--quant", "int8", "--no-plots",
                 "--no-hf", "--no-progress", "--out", str(out)]) == 0
    [cell] = json.loads((out / "results.json").read_text())["cells"]
    assert cell["placement"]["profile"] == "own" and 0 < cell["seconds"] < SLOW_PROFILE_S
