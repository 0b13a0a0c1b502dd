"""Bad input and faults: each a clear SpecterError subclass, refused before work, and the engine still usable."""

from __future__ import annotations

import pytest
import torch

from policies.eviction import LRU
from specter import DraftConfig, Engine, EngineConfig, GenerationConfig, plugins
from specter.decode import greedy_decode, run_sync
from specter.engine import CheckpointWeights
from specter.errors import BudgetError, ConfigError, PluginError, PromptError
from specter.kernel import run
from specter.build import load_resident
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
        for bad in (None, 5, {1, 2, 3}, (token for token in PROMPT)):  # were TypeError, or taken as ids unordered
            with pytest.raises(PromptError, match="a prompt is a str"):
                await engine.complete(bad)
        with pytest.raises(PromptError, match="wrap the one message"):
            await engine.complete({"role": "user", "content": "hi"})
        assert (await engine.complete(torch.tensor(PROMPT), max_new_tokens=6)).token_ids == expected  # a vector: ids
        assert (await engine.complete(tuple(PROMPT), max_new_tokens=6)).token_ids == expected
        assert engine.encode(range(5, 9)) == [5, 6, 7, 8]  # any Sequence of ints, as the Prompt type says

    assert with_engine(tiny, OFFLOADED, check) == expected


def test_the_engines_config_and_tokenizer_are_checked_before_the_weights_load(tiny, expected):
    async def load(config=None, tokenizer=None):
        async with Engine.from_pretrained(tiny, config, tokenizer=tokenizer) as engine:
            return (await engine.complete(PROMPT, max_new_tokens=6)).token_ids

    assert run(load({"device": "cpu", "residents": 2, "max_context": 64})) == expected  # a dict, as generate takes
    with pytest.raises(ConfigError, match="residents"):
        run(load({"device": "cpu", "residents": "two"}))
    with pytest.raises(ConfigError, match="must be an EngineConfig"):
        run(load(["cpu"]))
    with pytest.raises(ConfigError, match="Tokenizer.from_dir"):
        run(load(OFFLOADED, tokenizer=str(tiny)))


@pytest.mark.parametrize("settings, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"max_tokens": 5}, "max_tokens"), ({"seed": 2**63}, "seed"), ({"seed": -1}, "seed"),
])
def test_invalid_generation_settings(tiny, expected, settings, field):
    async def check(engine):
        with pytest.raises(ConfigError, match=f"GenerationConfig.{field}"):
            await engine.complete(PROMPT, **settings)  # as keyword overrides
        with pytest.raises(ConfigError, match=f"GenerationConfig.{field}"):
            await engine.complete(PROMPT, settings)  # as a dict

    assert with_engine(tiny, OFFLOADED, check) == expected


def test_a_large_seed_samples_with_the_rejection_rule(tiny, expected):
    """The rejection rule's generator is seeded from (seed, position); a seed near 2**63 must not overflow it."""
    config = EngineConfig(device="cpu", residents=2, draft=DraftConfig(sampling="rejection"))

    async def check(engine):
        result = await engine.complete(PROMPT, max_new_tokens=6, temperature=1.0, seed=2**63 - 1)
        assert len(result.token_ids) == 6

    assert with_engine(tiny, config, check) == expected


def test_top_p_one_is_allowed(tiny):
    """top_p=1.0 keeps every token: the same tokens as no top-p at all."""
    async def check(engine):
        result = await engine.complete(PROMPT, GenerationConfig(max_new_tokens=6, temperature=0.7, top_p=1.0, seed=3))
        unfiltered = await engine.complete(PROMPT, GenerationConfig(max_new_tokens=6, temperature=0.7, top_p=None, seed=3))
        assert len(result.token_ids) == 6 and result.token_ids == unfiltered.token_ids

    with_engine(tiny, OFFLOADED, check)


def test_budget_below_minimum_is_refused_before_allocation(tiny, monkeypatch, expected):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before refusing the budget")

    monkeypatch.setattr(CheckpointWeights, "dense", no_allocation)
    monkeypatch.setattr("specter.build.load_backend", no_allocation)
    minimum = plan_memory(Checkpoint(tiny).spec, torch.float32, EngineConfig(device="cpu")).minimum_budget
    budget = minimum - 3 * 2**20
    config = EngineConfig(device="cpu", budget=budget)
    with pytest.raises(BudgetError, match="short of the minimum") as error:
        run(Engine.load(tiny, config))
    assert f"budget {fmt(budget)} is 3.0 MiB short of the minimum {fmt(minimum, round_up=True)}" in str(error.value)
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
    ("lookahead", "lookahead", "fixed"), ("backend", "backends", "cpu"), ("cpu_experts", "placement", "all"),
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


# ---- issue 25: text that is not Unicode, the model's context, clamped settings, output paths ----------------
import json  # noqa: E402
import shutil  # noqa: E402

from specter.errors import SpecterError  # noqa: E402
from specter.memory import with_model_context  # noqa: E402


def checkpoint_with_positions(tiny, folder, positions: int):
    """The tiny checkpoint with another max_position_embeddings (the weights do not depend on it)."""
    directory = shutil.copytree(tiny, folder)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"max_position_embeddings": positions}))
    return directory


@pytest.fixture(scope="module")
def short_model(tiny, tmp_path_factory):
    return checkpoint_with_positions(tiny, tmp_path_factory.mktemp("short") / "m", 64)


@pytest.mark.parametrize("prompt, where", [
    ("a\udcff", "character 1 is U+DCFF"), ("\ud800 hi", "character 0 is U+D800"),
    ([{"role": "user", "content": "ok \udcfe"}], "chat message 0's 'content' is not valid Unicode: character 3"),
])
def test_text_that_is_not_unicode_is_a_prompt_error(tiny, expected, prompt, where):
    async def check(engine):
        engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        with pytest.raises(PromptError, match="not valid Unicode") as error:
            await engine.complete(prompt, max_new_tokens=2)
        assert where in str(error.value) and "UTF-8" in str(error.value) and "\n" not in str(error.value)
        with pytest.raises(ConfigError, match=r"stop string 1 is not valid Unicode: character 2 is U\+DCFF"):
            await engine.complete(PROMPT, max_new_tokens=2, stop_strings=("ok", "ab\udcff"))
        with pytest.raises(PromptError, match=r"not bytes; decode the bytes first"):
            await engine.complete(b"\xff\xfe")  # would otherwise be token ids 255, 254

    assert with_engine(tiny, OFFLOADED, check) == expected


def test_context_follows_the_models_positions(tiny, short_model):
    spec64 = Checkpoint(short_model).spec
    assert with_model_context(EngineConfig(), spec64).max_context == 64  # min(2048, 64)
    assert with_model_context(EngineConfig(), Checkpoint(tiny).spec).max_context == 2048
    assert with_model_context(EngineConfig(max_context=32), spec64).max_context == 32
    with pytest.raises(ConfigError, match=r"max_context 100000 is more than the model's max_position_embeddings 64; use "
                                          r"max_context \(--max-context\) 64 or less"):  # the field, for an API user
        run(Engine.load(short_model, EngineConfig(device="cpu", max_context=100_000)))
    assert plan_memory(spec64, torch.float32, EngineConfig()).kv_bytes * 32 == plan_memory(
        Checkpoint(tiny).spec, torch.float32, EngineConfig()).kv_bytes  # KV for 64 tokens, not 2048


@pytest.mark.parametrize("length, new", [(100, 4), (4, 100), (30, 35)])
def test_requests_beyond_the_models_positions_are_refused(short_model, length, new):
    async def main():
        async with Engine.from_pretrained(short_model, EngineConfig(device="cpu", residents=2)) as engine:
            assert engine.config.max_context == 64
            with pytest.raises(PromptError) as error:
                engine.generate([1] * length, max_new_tokens=new)
            assert engine.runtime.kv.length == 0
            return str(error.value)

    message = run(main())
    assert f"prompt of {length} tokens plus max_new_tokens {new} exceeds the maximum context of 64 tokens" in message
    assert "max_position_embeddings is 64" in message and "raise" not in message  # no advice that cannot work


def test_a_context_the_memory_cannot_hold_is_refused_before_allocation(tiny, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before refusing the context")

    monkeypatch.setattr(CheckpointWeights, "dense", no_allocation)
    monkeypatch.setattr("specter.build.available_host_bytes", lambda: 8 * 2**20)
    with pytest.raises(BudgetError) as error:
        run(Engine.load(tiny, EngineConfig(device="cpu", max_context=4096)))
    message = str(error.value)
    assert "the host's available memory is 8.0 MiB" in message and "KV for max_context 4096 tokens 8.0 MiB" in message
    assert "lower max_context (--max-context" in message


@pytest.mark.parametrize("residents", [None, 2])
def test_on_the_cpu_the_memory_refusal_does_not_advise_offloading(tiny, monkeypatch, residents):
    """On the CPU the cache's slots and the experts' host copy are both host memory, so --residents or --budget adds
    to what is needed; the advice said to give them (with --residents already given, too)."""
    monkeypatch.setattr("specter.build.available_host_bytes", lambda: 20 * 2**20)
    with pytest.raises(BudgetError) as error:
        run(Engine.load(tiny, EngineConfig(device="cpu", residents=residents, max_context=64)))
    message = str(error.value)
    assert "lower max_context (--max-context" in message and "run on a machine with more memory" in message, message
    assert "--residents" not in message and "--budget" not in message, message


def test_a_budget_the_hosts_memory_cannot_hold_on_the_cpu_is_refused_before_allocation(tiny, monkeypatch):
    """On the CPU the budget's part and the experts' host copy are both host memory: with --budget the check was
    skipped, and a run the host could not hold failed late, in its allocations."""
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before refusing the budget")

    monkeypatch.setattr(CheckpointWeights, "dense", no_allocation)
    monkeypatch.setattr("specter.build.available_host_bytes", lambda: 8 * 2**20)
    with pytest.raises(BudgetError) as error:
        run(Engine.load(tiny, EngineConfig(device="cpu", budget="60MiB")))
    message = str(error.value)
    assert "the host's available memory is 8.0 MiB" in message and "the experts' host copy" in message, message
    assert "lower budget (--budget), or run on a machine with more memory" in message


@pytest.mark.parametrize("residents, says", [
    (0, "below this model's minimum of 2"), (1, "below this model's minimum of 2"), (999, "more than this model's 16 experts"),
])
def test_residents_outside_the_model_are_refused_with_one_minimum(tiny, residents, says):
    with pytest.raises(BudgetError, match=says) as error:
        run(Engine.load(tiny, EngineConfig(device="cpu", residents=residents)))
    # a Python API user set the field `residents`, a CLI user --residents: the remedy names both
    assert "use residents (--residents) 2 or more" in str(error.value) or "use residents (--residents) 16 or less" in str(error.value)


def test_k_above_k_max_is_an_error_and_the_default_k_follows_k_max():
    from specter.config import DraftConfig

    with pytest.raises(ConfigError, match="k = 8 is above k_max = 2"):
        EngineConfig.build(draft=dict(k=8, k_max=2))
    assert DraftConfig(k_max=2).k == 2 and DraftConfig().k == 4 and DraftConfig(k_max=0).k == 0
    assert DraftConfig(k=3, k_max=3).k == 3


def test_an_unwritable_trace_path_is_a_config_error(tiny, tmp_path):
    async def check(engine):
        for path, says in [(tmp_path / "missing" / "x.trace", "does not exist"), (tmp_path, "is a directory")]:
            with pytest.raises(ConfigError, match=says) as error:
                engine.runtime.record_trace(path)
            assert isinstance(error.value, SpecterError)

    with_engine(tiny, OFFLOADED, check)


def test_a_failed_build_leaves_no_thread_behind(tiny, monkeypatch):
    """A build that fails after the backend and kernel exist (here: the graph capture) closes them, so a server
    or notebook that retries does not collect stream and waiter threads."""
    import threading

    from specter.engine import Runtime

    def ours() -> set[str]:
        return {thread.name for thread in threading.enumerate() if thread.name.startswith("specter")}

    def broken_capture(self):
        self.backend.copy_h2d(torch.zeros(1), torch.ones(1), self.backend.copy_stream).wait()  # the threads run
        raise RuntimeError("capture failed")

    monkeypatch.setattr(Runtime, "capture_graphs", broken_capture)
    before = ours()
    with pytest.raises(RuntimeError, match="capture failed"):
        run(Engine.from_pretrained(tiny, OFFLOADED).__aenter__())
    assert ours() == before


def test_a_checkpoint_whose_logits_are_nan_is_refused_not_decoded_as_token_0(tiny, tmp_path):
    """NaN weights made every logit NaN and greedy's argmax token 0, forever, with exit 0."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specter.errors import CheckpointError

    broken = shutil.copytree(tiny, tmp_path / "nan")
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, str(broken / "model.safetensors"))

    async def main():
        async with Engine.from_pretrained(broken, OFFLOADED) as engine:
            with pytest.raises(CheckpointError, match="not finite"):
                await engine.complete(PROMPT, max_new_tokens=6)

    run(main())


def test_closing_after_a_part_failed_still_closes_every_other_part(tiny, tmp_path, monkeypatch):
    """A CPU stream's failed work is raised by every later wait, the transfer engine's last one at close included;
    the close went no further, so the host, waiter and stream threads stayed up and the trace stayed open."""
    import threading

    async def main():
        engine = await Engine.load(tiny, OFFLOADED)
        engine.runtime.record_trace(tmp_path / "run.trace")
        await engine.complete(PROMPT, max_new_tokens=4)
        transfer = engine.runtime.cache.transfer

        async def failing_close():
            raise RuntimeError("work on the copy stream failed before this event: OverflowError()")

        monkeypatch.setattr(transfer, "aclose", failing_close)
        with pytest.raises(RuntimeError, match="copy stream failed"):
            await engine.aclose()
        return engine

    before = {thread.name for thread in threading.enumerate()}
    engine = run(main())
    left = [t.name for t in threading.enumerate() if t.name.startswith("specter-") and t.is_alive() and t.name not in before]
    assert left == [], left
    writers = [observer.writer for observer in engine.runtime.observers if hasattr(observer, "writer")]
    assert writers and all(writer._file.closed for writer in writers)
    assert (tmp_path / "run.trace").read_text().count("\n") >= 2  # the header and the rounds were flushed


def test_a_sync_call_whose_loop_thread_has_ended_raises_instead_of_hanging(tiny):
    """A KeyboardInterrupt or SystemExit raised on the loop thread (a plug-in's, say) ends run_forever and the thread:
    every later SyncEngine call then waited forever on a future no loop would run."""
    import threading

    from specter import SyncEngine

    engine = SyncEngine(tiny, OFFLOADED)
    engine._loop.call_soon_threadsafe(engine._loop.stop)  # the loop ends as it does on such an exception
    engine._thread.join(10)
    assert not engine._thread.is_alive()
    done, outcome = threading.Event(), []

    def call():
        try:
            engine.complete(PROMPT, max_new_tokens=2)
        except BaseException as error:  # noqa: BLE001 - the test wants whatever ends the call
            outcome.append(error)
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(20), "SyncEngine.complete still waits on a loop that has ended"
    assert isinstance(outcome[0], RuntimeError) and "event-loop thread has ended" in str(outcome[0])
    engine.close()  # returns, the engine closed on its loop run again (test_api_lifecycle: its threads stop)
