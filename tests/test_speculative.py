"""The exactness contract: speculative output equals the target-only baseline, token for token.

Hypothesis draws the model family, prompt, memory budget (minimum slots to all resident), every installed
eviction, prefetch and lookahead policy, k, and greedy or seeded sampling.
"""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specter import plugins
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.model.checkpoint import Checkpoint
from tests.hf_models import FAMILIES, hf_model, save_hf

# The same tests run on the GPU machine with SPECTER_TEST_DEVICE=cuda (benchmarks/reproduce.sh gpu-tests).
DEVICE = os.environ.get("SPECTER_TEST_DEVICE", "cpu")
EXAMPLES = int(os.environ.get("SPECTER_TEST_EXAMPLES", "35"))  # fewer where each example costs more (graph captures)
REFERENCE_EVICTION = ["lru", "lfu", "plan-protect", "belady-lookahead"]
REFERENCE_PREFETCH = ["none", "topm-frequency", "topm-keep"]
REFERENCE_LOOKAHEAD = ["fixed", "profiled", "roofline"]


EXTRA_VARIANTS = ("phimoe-longrope", "deepseek-v2", "deepseek-lite")  # tests/test_families_extra.py
ALL_MODELS = FAMILIES + EXTRA_VARIANTS


@functools.cache
def checkpoint(family: str, root: str) -> str:
    from pathlib import Path

    if family in EXTRA_VARIANTS:
        from tests.test_families_extra import hf_variant

        return str(save_hf(hf_variant(family, seed=7), Path(root) / family))
    return str(save_hf(hf_model(family, seed=7), Path(root) / family))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec"))


def run(path: str, config: EngineConfig, prompt: list[int], generation: GenerationConfig):
    async def go():
        runtime = await Runtime.load(path, config)
        try:
            return await runtime.complete_ids(prompt, generation)
        finally:
            await runtime.aclose()

    return asyncio.run(go())


def baseline(path: str, prompt: list[int], generation: GenerationConfig, residents: int | None = None,
             static_verify: bool | None = None) -> list[int]:
    """The same engine with speculation off, at the same memory setting (the exactness contract)."""
    config = EngineConfig(device=DEVICE, max_context=96, residents=residents, lookahead="fixed", draft=DraftConfig(k=0),
                          static_verify=static_verify)
    return run(path, config, prompt, generation).tokens


def test_reference_policies_are_installed():
    for group, names in (("eviction", REFERENCE_EVICTION), ("prefetch", REFERENCE_PREFETCH), ("lookahead", REFERENCE_LOOKAHEAD)):
        assert set(names) <= set(plugins.installed(group)), group


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    family=st.sampled_from(ALL_MODELS),
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=10),
    residents=st.sampled_from([2, 3, 4, None]),
    eviction=st.sampled_from(REFERENCE_EVICTION),
    prefetch=st.sampled_from(REFERENCE_PREFETCH),
    lookahead=st.sampled_from(REFERENCE_LOOKAHEAD),
    k=st.integers(0, 16),
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.5]),
    top_k=st.sampled_from([None, 5]),
    top_p=st.sampled_from([None, 0.9]),
    seed=st.integers(0, 2**31 - 1),
    quant=st.sampled_from(["int4", "int8", "int2"]),
    scout=st.booleans(),
    overlap=st.sampled_from([0, 0, 3, 16]),
    static=st.sampled_from([None, None, True]),
)
def test_speculative_equals_baseline(root, family, prompt, residents, eviction, prefetch, lookahead, k, temperature, top_k, top_p, seed, quant,
                                     scout, overlap, static):
    """static: the segmented static verify (the default on CUDA, with the lead over the routing) on the CPU too."""
    path = checkpoint(family, root)
    if residents is not None:  # the minimum is one token's experts per layer
        residents = max(residents, Checkpoint(path).spec.top_k)
    generation = GenerationConfig(max_new_tokens=14, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    expected = baseline(path, prompt, generation, residents, static)
    config = EngineConfig(device=DEVICE, max_context=96, residents=residents, eviction=eviction, prefetch=prefetch,
                          lookahead=lookahead, draft=DraftConfig(k=k, k_max=16, quant=quant, scout=scout, overlap=overlap),
                          static_verify=static)
    result = run(path, config, prompt, generation)
    assert result.tokens == expected
    if residents is not None and residents < 6:  # experts do not all fit (6 or 8 per layer): bytes were actually moved
        assert result.stats.h2d_bytes > 0 and result.stats.misses > 0


@pytest.mark.parametrize("family", ALL_MODELS)
def test_speculation_accepts_drafts_and_predicts_routes(root, family):
    """With an int8 draft the draft agrees often and its routes cover most of what verify used."""
    path = checkpoint(family, root)
    generation = GenerationConfig(max_new_tokens=24)
    config = EngineConfig(device=DEVICE, max_context=96, residents=3, draft=DraftConfig(k=4, quant="int8"))
    result = run(path, config, [1, 2, 3], generation)
    assert result.tokens == baseline(path, [1, 2, 3], generation, residents=3)
    stats = result.stats
    assert stats.drafted > 0 and stats.acceptance_rate > 0.3, stats.as_dict()
    assert stats.window_recall > 0.5, stats.as_dict()
    assert stats.rounds < 24


@pytest.mark.parametrize("family", ["mixtral", "deepseek-v2"])
def test_scout_prefetches_plain_rounds_from_one_draft_step(root, family):
    """k = 0 with a scout: the same tokens as plain decoding, every round scouted, its routes predict the
    verify's experts, and experts it prefetched are hits where plain decoding had misses."""
    path = checkpoint(family, root)
    generation = GenerationConfig(max_new_tokens=16, temperature=0.8, seed=5)
    expected = baseline(path, [4, 5, 6], generation, residents=3)
    plain = run(path, EngineConfig(device=DEVICE, max_context=96, residents=3, draft=DraftConfig(k=0, quant="int8")),
                [4, 5, 6], generation).stats
    result = run(path, EngineConfig(device=DEVICE, max_context=96, residents=3, draft=DraftConfig(k=0, quant="int8", scout=True)),
                 [4, 5, 6], generation)
    assert result.tokens == expected
    stats = result.stats
    assert stats.drafted == 0 and stats.scouted == stats.rounds == plain.rounds == 15
    assert stats.scout_recall > 0.9 and stats.recall_total == 0, stats.as_dict()  # kept apart from the window's recall
    assert plain.scouted == 0 and plain.scout_recall is None
    from specter.build import may_speculate  # all resident: nothing to prefetch, so no draft is built for a scout
    assert not may_speculate(EngineConfig(draft=DraftConfig(k=0, scout=True)))
    assert may_speculate(EngineConfig(residents=3, draft=DraftConfig(k=0, scout=True)))

    async def built(config: EngineConfig):
        async with await Runtime.load(path, config) as runtime:
            await runtime.complete_ids([4, 5, 6], GenerationConfig(max_new_tokens=4))
            return runtime.draft, runtime.estimates, runtime._lookahead_state().scout_s
    # a budget (or residents) that holds every expert leaves nothing to scout for: no draft is built
    every = Checkpoint(path).spec.num_experts  # (more residents than experts is refused)
    draft, _, charged = asyncio.run(built(EngineConfig(device=DEVICE, max_context=96, residents=every, draft=DraftConfig(k=0, scout=True))))
    assert draft is None and charged == 0.0
    draft, estimates, charged = asyncio.run(built(EngineConfig(device=DEVICE, max_context=96, residents=3, draft=DraftConfig(k=0, scout=True))))
    # the scout's time is the plain rounds' own: measured apart, not a depth-1 draft in the draft fit
    assert draft is not None and estimates.scout_s > 0 and charged == estimates.scout_s and estimates.draft_step_s is None
    assert stats.misses < plain.misses, (stats.as_dict(), plain.as_dict())


def test_rejection_sampling_runs_and_differs_in_rule(root, monkeypatch):
    """The rejection rule: reproducible for a seed, other tokens than the coupled rule's (which are the baseline's)
    after the first (the prompt's sample, the same in both), and fresh uniforms each round: its generator is seeded
    by the request's seed and the round's position."""
    import torch

    from specter import engine

    uniforms: list[float] = []
    verdict = engine.rejection_verdict

    def first_uniform(drafts, draft_probs, target_probs, generator):
        peek = torch.Generator(device=generator.device)
        peek.set_state(generator.get_state())
        uniforms.append(torch.rand(1, generator=peek, device=generator.device, dtype=target_probs.dtype).item())
        return verdict(drafts, draft_probs, target_probs, generator)

    monkeypatch.setattr(engine, "rejection_verdict", first_uniform)
    path = checkpoint("mixtral", root)
    generation = GenerationConfig(max_new_tokens=10, temperature=1.0, seed=3)
    config = EngineConfig(device=DEVICE, max_context=96, draft=DraftConfig(k=3, sampling="rejection"))
    tokens = run(path, config, [4, 5], generation).tokens
    rounds = list(uniforms)
    assert len(tokens) == 10 and all(0 <= t < 96 for t in tokens)
    assert len(rounds) >= 2 and len(set(rounds)) == len(rounds), rounds  # each round its own draws
    uniforms.clear()
    assert run(path, config, [4, 5], generation).tokens == tokens and uniforms == rounds
    coupled = run(path, EngineConfig(device=DEVICE, max_context=96, draft=DraftConfig(k=3)), [4, 5], generation).tokens
    assert coupled == baseline(path, [4, 5], generation)
    assert tokens[0] == coupled[0] and tokens != coupled


def test_rejection_sampling_draws_each_token_from_the_targets_distribution(root):
    """Over many seeds, the first token a rejection round commits follows the target's distribution for its position
    (chi-square over the top-4 tokens). The prompt's own token comes from the seeded Gumbel noise, so the seeds taken
    are those whose first token is the likeliest one: the second token is then drawn from one known distribution."""
    import torch

    from specter.build import load_resident
    from specter.decode import run_sync
    from specter.sampling import SamplingParams, probs, sample

    path, prompt, temperature, top_k = checkpoint("mixtral", root), [4, 5], 1.5, 4
    loaded = load_resident(path, EngineConfig(device=DEVICE, max_context=96))

    def last_logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=loaded.model.device)
        return loaded.model.logits(run_sync(loaded.model.forward(ids, 0, loaded.model.new_kv(), loaded.experts))[-1:])

    logits = last_logits(prompt)
    position = torch.tensor([len(prompt)], device=logits.device)
    firsts = [int(sample(logits, position, SamplingParams(temperature, top_k, None, seed))) for seed in range(1500)]
    first = max(set(firsts), key=firsts.count)
    seeds = [seed for seed, token in enumerate(firsts) if token == first][:300]
    target = probs(last_logits(prompt + [first]), SamplingParams(temperature, top_k))[0].double().cpu()
    assert len(seeds) == 300 and int((target > 0).sum()) == top_k

    async def second_tokens() -> list[int]:
        config = EngineConfig(device=DEVICE, max_context=96, draft=DraftConfig(k=1, quant="int8", sampling="rejection"))
        async with await Runtime.load(path, config) as runtime:
            seconds = []
            for seed in seeds:
                generation = GenerationConfig(max_new_tokens=3, temperature=temperature, top_k=top_k, seed=seed)
                result = await runtime.complete_ids(prompt, generation)
                assert result.stats.drafted >= 1, (seed, result.stats.as_dict())
                if result.tokens[0] == first:  # all of them on the CPU; elsewhere rounding may flip a near tie
                    seconds.append(result.tokens[1])
            return seconds

    seconds = asyncio.run(second_tokens())
    assert len(seconds) >= 0.95 * len(seeds)
    observed = torch.bincount(torch.tensor(seconds), minlength=target.numel()).double()
    assert observed[target == 0].sum() == 0  # never a token top-k leaves out
    expected = target * len(seconds)
    kept = target > 0
    chi_square = (((observed - expected)[kept] ** 2) / expected[kept]).sum().item()
    assert chi_square < 21.108, (chi_square, observed[kept].tolist(), expected[kept].tolist())  # alpha 1e-4, 3 dof


def test_speculation_stops_at_a_stop_token_inside_an_accepted_run(root):
    """Runtime.complete_ids (the bench's entry) with stop_token_ids and k > 0: the output ends exactly at the first
    stop token, as the baseline's does, though the round that committed it accepted tokens past it."""
    path = checkpoint("mixtral", root)
    free = baseline(path, [1, 2, 3], GenerationConfig(max_new_tokens=24), residents=3)
    stops = [token for index, token in enumerate(free) if index > 0 and token not in free[:index]]
    assert len(stops) >= 3, free

    async def go() -> list[list[int]]:
        config = EngineConfig(device=DEVICE, max_context=96, residents=3, draft=DraftConfig(k=4, quant="int8"))
        async with await Runtime.load(path, config) as runtime:
            return [(await runtime.complete_ids([1, 2, 3], GenerationConfig(max_new_tokens=24, stop_token_ids=(stop,)))).tokens
                    for stop in stops]

    for stop, tokens in zip(stops, asyncio.run(go())):
        assert tokens == free[: free.index(stop) + 1], stop


def test_the_runtime_records_the_experts_each_forward_used_in_its_use_history(root, monkeypatch):
    """Offloaded with LRU: every forward's record (the prompt's, each verify's) goes into the use history the eviction
    policy reads: per layer, how often each expert was used, and the last forward's experts the most recent."""
    from specter.verify import OffloadedExperts

    records = []
    start_record = OffloadedExperts.start_record

    def kept(self):
        records.append(start_record(self))
        return records[-1]

    monkeypatch.setattr(OffloadedExperts, "start_record", kept)
    path = checkpoint("mixtral", root)

    async def go():
        config = EngineConfig(device=DEVICE, max_context=96, residents=2, eviction="lru", draft=DraftConfig(k=3, quant="int8"))
        async with await Runtime.load(path, config) as runtime:
            await runtime.complete_ids([1, 2, 3], GenerationConfig(max_new_tokens=12))
            return runtime.spec.moe_layers, [runtime.uses.history(index) for index in range(len(runtime.spec.moe_layers))]

    moe_layers, histories = asyncio.run(go())
    assert len(records) >= 3  # the prompt and at least two rounds
    for index, layer in enumerate(moe_layers):
        counts: dict[int, int] = {}
        for record in records:
            for expert in record.used[layer]:
                counts[expert] = counts.get(expert, 0) + 1
        history = histories[index]
        assert history.use_count == counts, layer
        last = set(records[-1].used[layer])
        older = set(history.last_use) - last
        assert min(history.last_use[e] for e in last) > max((history.last_use[e] for e in older), default=-1), layer


def test_gptq_draft_is_calibrated_and_exact(root):
    path = checkpoint("qwen3_moe", root)
    generation = GenerationConfig(max_new_tokens=16)
    config = EngineConfig(device=DEVICE, max_context=96, residents=3, draft=DraftConfig(k=4, quant="gptq4", group_size=16))
    result = run(path, config, [9, 8, 7], generation)
    assert result.tokens == baseline(path, [9, 8, 7], generation, residents=3)
    assert result.stats.drafted > 0 and result.stats.acceptance_rate > 0.3


def test_draft_shares_the_targets_non_expert_tensors(root):
    """Every non-expert tensor of the draft is the target's own storage, not a copy; experts are quantized."""

    async def go():
        path = checkpoint("qwen2_moe", root)
        runtime = await Runtime.load(path, EngineConfig(device=DEVICE, max_context=64, residents=3, draft=DraftConfig(k=2)))
        try:
            target, draft = runtime.model, runtime.draft.model
            assert draft is not target and draft.w.keys() == target.w.keys()
            assert draft.w is target.w  # one dict: every tensor the draft reads is the target's own object
            for name, tensor in target.w.items():
                assert draft.w[name].untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr(), name
            for layer in range(target.spec.num_layers):  # the draft's packed products read the target's own storage
                weight, _, _ = draft._packed_qkv(layer)
                q = target.w[f"{target.spec.layer_prefix(layer)}.self_attn.q_proj.weight"]
                assert weight.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
                if layer in target.spec.moe_layers:
                    packed, _ = runtime.draft.model.packed_ffn_input(layer)
                    router = target.w[target.spec.router_name(layer)]
                    assert packed.untyped_storage().data_ptr() == router.untyped_storage().data_ptr()
            assert not any(".experts." in name for name in draft.w)
            quantized = runtime.draft.experts.layers
            assert set(quantized) == set(runtime.spec.moe_layers)
            assert all(q.bits == 4 for q in quantized.values())
        finally:
            await runtime.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_static_verify_offloaded_equals_resident_static(root, family, monkeypatch):
    """With static_verify the offloaded verify shares the resident static step's numerics: same tokens, also
    when the verify starts each layer's predicted misses before reading its routing (VerifyTuning.lead_misses)."""
    from specter.experts.cache import ExpertCache

    lead, started = ExpertCache.lead, []

    def spy(self, *args, **kwargs):
        computed, loads = lead(self, *args, **kwargs)
        started.extend(loads)
        return computed, loads

    monkeypatch.setattr(ExpertCache, "lead", spy)
    path = checkpoint(family, root)
    generation = GenerationConfig(max_new_tokens=16, temperature=0.8, seed=5)
    resident = run(path, EngineConfig(device=DEVICE, max_context=96, static_verify=True, draft=DraftConfig(k=0)), [3, 1, 4], generation)
    for residents, k in ((2, 0), (3, 4)):
        config = EngineConfig(device=DEVICE, max_context=96, static_verify=True, residents=residents, draft=DraftConfig(k=k))
        result = run(path, config, [3, 1, 4], generation)
        assert result.tokens == resident.tokens
        assert result.stats.h2d_bytes > 0
    assert started, "no verify started a predicted miss early"


def test_a_plugin_failing_in_the_transfer_stage_surfaces_as_plugin_error(root, monkeypatch):
    """An error inside the round's task group reaches the caller as itself (a SpecterError), not a group."""
    from policies.prefetch import TopMFrequency
    from specter.errors import PluginError

    def broken_plan(self, **_):
        raise RuntimeError("boom")

    monkeypatch.setattr(TopMFrequency, "plan", broken_plan)
    path = checkpoint("mixtral", root)
    config = EngineConfig(device=DEVICE, max_context=96, residents=2, draft=DraftConfig(k=4))
    with pytest.raises(PluginError, match="topm-keep"):  # the default prefetch, a TopMFrequency
        run(path, config, [1, 2, 3], GenerationConfig(max_new_tokens=8))


def test_a_closed_runtime_refuses_requests(root):
    from specter.errors import RequestCancelled

    async def go():
        runtime = await Runtime.load(checkpoint("olmoe", root), EngineConfig(device=DEVICE, max_context=64, residents=2))
        await runtime.aclose()
        with pytest.raises(RequestCancelled, match="closed"):
            await runtime.complete_ids([1, 2], GenerationConfig(max_new_tokens=2))

    asyncio.run(go())
