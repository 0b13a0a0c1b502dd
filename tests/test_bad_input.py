"""Bad input and faults: each a clear SpecterError subclass, refused before work, and the engine still usable."""

from __future__ import annotations

import pytest
import torch

from policies.eviction import LRU
from specter import Engine, EngineConfig, GenerationConfig, plugins
from specter.decode import greedy_decode, run_sync
from specter.engine import CheckpointWeights
from specter.errors import BudgetError, ConfigError, PluginError, PromptError
from specter.kernel import run
from specter.loader import load_resident
from specter.memory import fmt, plan_memory
from specter.model.checkpoint import Checkpoint

OFFLOADED = EngineConfig(device="cpu", residents=2, max_context=64)
PROMPT = [5, 17, 300, 42]


@pytest.fixture(scope="module")
def expected(tiny):
    loaded = load_resident(tiny, EngineConfig(device="cpu"))
    return run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 6))


def with_engine(tiny, config, check):
    """Load, run `check(engine)` (async), then prove the engine still serves a request correctly."""
    async def main():
        async with Engine.from_pretrained(tiny, config) as engine:
            await check(engine)
            return (await engine.complete(PROMPT, max_new_tokens=6)).token_ids

    return run(main())


def untouched(engine: Engine) -> tuple:
    cache = engine.runtime.cache
    return engine.runtime.kv.length, cache.stats.total().bytes_loaded, cache.stats.total().misses


@pytest.mark.parametrize("prompt", [[], ""], ids=["no-ids", "empty-text"])
def test_empty_prompt(tiny, expected, prompt):
    async def check(engine):
        with pytest.raises(PromptError, match="empty"):
            await engine.complete(prompt)

    assert with_engine(tiny, OFFLOADED, check) == expected


@pytest.mark.parametrize("length, new", [(60, 10), (80, 1)])
def test_prompt_longer_than_context_is_refused_before_work(tiny, expected, length, new):
    async def check(engine):
        before = untouched(engine)
        with pytest.raises(PromptError) as error:
            engine.generate([1] * length, max_new_tokens=new)  # refused when called, before queueing
        assert f"{length} tokens" in str(error.value) and "64 tokens" in str(error.value) and f"max_new_tokens {new}" in str(error.value)
        assert untouched(engine) == before

    assert with_engine(tiny, OFFLOADED, check) == expected


@pytest.mark.parametrize("bad", [[-1], [512], [3, 10_000]])
def test_token_ids_outside_the_vocabulary(tiny, expected, bad):
    async def check(engine):
        with pytest.raises(PromptError, match=r"outside the vocabulary 0\.\.511"):
            await engine.complete(bad)

    assert with_engine(tiny, OFFLOADED, check) == expected


def test_malformed_prompts(tiny, expected):
    async def check(engine):
        with pytest.raises(PromptError, match="list of int token ids"):
            await engine.complete([1.5, 2])
        with pytest.raises(ConfigError, match="no chat template"):
            await engine.complete([{"role": "user", "content": "hi"}])
        with pytest.raises(PromptError, match="needs a tokenizer"):
            await Engine(engine.runtime, tokenizer=None).complete("hello")

    assert with_engine(tiny, OFFLOADED, check) == expected


@pytest.mark.parametrize("settings, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"max_tokens": 5}, "max_tokens"),
])
def test_invalid_generation_settings(tiny, expected, settings, field):
    async def check(engine):
        with pytest.raises(ConfigError, match=f"GenerationConfig.{field}"):
            await engine.complete(PROMPT, **settings)  # as keyword overrides
        with pytest.raises(ConfigError, match=f"GenerationConfig.{field}"):
            await engine.complete(PROMPT, settings)  # as a dict

    assert with_engine(tiny, OFFLOADED, check) == expected


def test_top_p_one_is_allowed(tiny):
    async def check(engine):
        result = await engine.complete(PROMPT, GenerationConfig(max_new_tokens=3, temperature=0.7, top_p=1.0, seed=3))
        assert len(result.token_ids) == 3

    with_engine(tiny, OFFLOADED, check)


def test_budget_below_minimum_is_refused_before_allocation(tiny, monkeypatch, expected):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before refusing the budget")

    monkeypatch.setattr(CheckpointWeights, "dense", no_allocation)
    monkeypatch.setattr("specter.engine.load_backend", no_allocation)
    minimum = plan_memory(Checkpoint(tiny).spec, torch.float32, EngineConfig(device="cpu")).minimum_budget
    budget = minimum - 3 * 2**20
    config = EngineConfig(device="cpu", budget=budget)
    with pytest.raises(BudgetError, match="short of the minimum") as error:
        run(Engine.load(tiny, config))
    assert f"budget {fmt(budget)} is 3.0 MiB short of the minimum {fmt(minimum)}" in str(error.value)
    monkeypatch.undo()
    assert with_engine(tiny, OFFLOADED, _nothing) == expected  # nothing was lost: the next load works


async def _nothing(engine: Engine) -> None:
    return None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_budget_above_free_gpu_memory(tiny):
    with pytest.raises(BudgetError, match="free memory"):
        run(Engine.load(tiny, EngineConfig(device="cuda", budget="100TiB")))


@pytest.mark.parametrize("field, group, known", [
    ("eviction", "eviction", "lru"), ("prefetch", "prefetch", "topm-frequency"),
    ("lookahead", "lookahead", "fixed"), ("backend", "backends", "cpu"),
])
def test_unknown_plugin_names_list_the_installed_ones(tiny, expected, field, group, known):
    with pytest.raises(PluginError) as error:
        run(Engine.load(tiny, EngineConfig(device="cpu", residents=2, **{field: "no-such-plugin"})))
    message = str(error.value)
    assert "'no-such-plugin'" in message and known in message and group in message
    assert with_engine(tiny, OFFLOADED, _nothing) == expected


class FlakyEviction:
    """LRU that raises inside victims() while armed: a third-party plug-in failing mid-decision."""

    def __init__(self) -> None:
        self.name = "flaky"
        self.armed = True
        self.calls = 0
        self._lru = LRU()

    def victims(self, layer, residents, protected, count, history, plan):
        self.calls += 1
        if self.armed:
            raise RuntimeError("flaky policy lost its marbles")
        return self._lru.victims(layer=layer, residents=residents, protected=protected, count=count, history=history, plan=plan)


def test_plugin_raising_inside_a_decision(tiny, monkeypatch, expected):
    flaky = FlakyEviction()
    original = plugins.load_policy

    def load_policy(group, name, **options):
        if group == "eviction":
            return plugins.guarded(flaky, "eviction", plugins.PluginOrigin("eviction", "flaky", "flaky-policies", "0.1"))
        return original(group, name, **options)

    monkeypatch.setattr(plugins, "load_policy", load_policy)

    async def check(engine):
        with pytest.raises(PluginError, match=r"eviction plug-in 'flaky' \(dist flaky-policies 0.1\): victims\(\) raised") as error:
            await engine.complete(PROMPT, max_new_tokens=12)
        assert "lost its marbles" in str(error.value) and flaky.calls > 0
        runtime = engine.runtime
        assert runtime.kv.length == 0 and all(not runtime.cache.protected_experts(l) for l in range(runtime.cache.num_layers))
        flaky.armed = False

    assert with_engine(tiny, OFFLOADED, check) == expected
    assert flaky.calls > 1  # the next request went through the same plug-in
