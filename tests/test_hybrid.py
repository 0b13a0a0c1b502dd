"""Host experts inside the engine (issue 29): the exactness contract with a placement (speculative output equals the
same placement's k = 0 output), `all` copying nothing after load, and cancellation while the host computes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specter import build, plugins, verify
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.experts.host import HostExperts
from specter.experts.transfer import LinkEmulation
from specter.model.checkpoint import Checkpoint
from specter.placement import Placement, PlacementState
from tests.test_speculative import ALL_MODELS, DEVICE, REFERENCE_EVICTION, REFERENCE_LOOKAHEAD, REFERENCE_PREFETCH, checkpoint

EXAMPLES = int(os.environ.get("SPECTER_TEST_EXAMPLES", "20"))


class RandomPlacement:
    """A test-only placement policy: each layer's host experts a seeded random subset (any size, all or none too); a
    prompt of at least `threshold` rows computes a seeded random choice of layers' host experts on the device."""

    name = "random"

    def __init__(self, seed: int, threshold: int | None = None) -> None:
        self.seed, self.threshold = seed, threshold

    def place(self, state: PlacementState) -> Placement:
        rng = random.Random(self.seed)
        return Placement.of([[e for e in range(state.num_experts) if rng.random() < rng.random()] for _ in range(state.num_layers)],
                            state.num_layers, state.num_experts)

    def place_prefill(self, state: PlacementState, decode: Placement, rows: int) -> Placement:
        if self.threshold is None or rows < self.threshold:
            return decode
        rng = random.Random(self.seed + 1)
        return Placement(tuple(host if rng.random() < 0.3 else frozenset() for host in decode.host), decode.num_experts)


@contextlib.contextmanager
def placed_by(policy):
    """Runtimes built inside use `policy` as their placement plug-in (through the builder's one place that loads it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "placement_policy", lambda config: plugins.guarded(policy, "placement"))
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hybrid"))


def run(path: str, config: EngineConfig, prompt: list[int], generation: GenerationConfig):
    async def go():
        async with await Runtime.load(path, config) as runtime:
            result = await runtime.complete_ids(prompt, generation)
            return result, runtime.experts.host.placement if runtime.experts.host is not None else None

    return asyncio.run(go())


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    family=st.sampled_from(ALL_MODELS),
    prompt=st.lists(st.integers(0, 95), min_size=1, max_size=10),
    residents=st.sampled_from([2, 3, 4]),
    placement_seed=st.integers(0, 2**31 - 1),
    eviction=st.sampled_from(REFERENCE_EVICTION),
    prefetch=st.sampled_from(REFERENCE_PREFETCH),
    lookahead=st.sampled_from(REFERENCE_LOOKAHEAD),
    k=st.integers(1, 12),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    seed=st.integers(0, 2**31 - 1),
    scout=st.booleans(),
    overlap=st.sampled_from([0, 3]),
    static=st.sampled_from([None, None, True]),
    threshold=st.sampled_from([None, 1, 4, 8]),
)
def test_speculative_equals_k0_with_the_same_placement(root, family, prompt, residents, placement_seed, eviction, prefetch,
                                                       lookahead, k, temperature, seed, scout, overlap, static, threshold):
    """The contract with host experts: a random placement fixed for the engine's life, the same placement's target-only
    run (k = 0) is the baseline, greedy and seeded sampling, eager and segmented verify; prompts above a random
    threshold run under a placement of their own (`place_prefill`), those below it under decoding's."""
    path = checkpoint(family, root)
    residents = max(residents, Checkpoint(path).spec.top_k)
    generation = GenerationConfig(max_new_tokens=12, temperature=temperature, top_p=0.9 if temperature else None, seed=seed)
    common = dict(device=DEVICE, max_context=96, residents=residents, static_verify=static, cpu_threads=1)
    with placed_by(RandomPlacement(placement_seed, threshold)):
        expected, placement = run(path, EngineConfig(**common, lookahead="fixed", draft=DraftConfig(k=0)), prompt, generation)
        config = EngineConfig(**common, eviction=eviction, prefetch=prefetch, lookahead=lookahead,
                              draft=DraftConfig(k=k, k_max=12, quant="int8", scout=scout, overlap=overlap))
        result, same = run(path, config, prompt, generation)
    assert same == placement  # the placement is the engine's, not the request's
    assert result.tokens == expected.tokens
    if placement is None:
        assert result.stats.host_computed_experts == expected.stats.host_computed_experts == 0


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek-v2"])
@pytest.mark.parametrize("static", [None, True])
def test_all_copies_nothing_after_load_and_computes_the_rest_on_the_host(root, family, static):
    path = checkpoint(family, root)
    residents = Checkpoint(path).spec.top_k
    generation = GenerationConfig(max_new_tokens=10)
    common = dict(device=DEVICE, max_context=96, residents=residents, static_verify=static, cpu_experts="all", cpu_threads=1)
    plain, placement = run(path, EngineConfig(**common, draft=DraftConfig(k=0)), [3, 1, 4], generation)
    spec = Checkpoint(path).spec
    assert placement.counts() == [spec.num_experts - residents] * len(spec.moe_layers)
    speculative, _ = run(path, EngineConfig(**common, draft=DraftConfig(k=4, quant="int8")), [3, 1, 4], generation)
    assert speculative.tokens == plain.tokens
    for stats in (plain.stats, speculative.stats):
        assert stats.h2d_bytes == 0 and stats.misses == 0, stats.as_dict()
        assert stats.host_computed_experts > 0 and stats.host_compute_s > 0 and stats.hits > 0, stats.as_dict()
        # the prompt's host work is kept apart (at most every non-resident expert of each layer once)
        assert 0 < stats.host_prefill_experts <= len(spec.moe_layers) * (spec.num_experts - residents), stats.as_dict()
        assert 0 < stats.host_prefill_s <= stats.host_compute_s
    # plain decoding's tokens after the first route top-k each: at most that many host experts per layer per token
    decoded = plain.stats.host_computed_experts - plain.stats.host_prefill_experts
    assert 0 < decoded <= (plain.stats.new_tokens - 1) * len(spec.moe_layers) * spec.top_k, plain.stats.as_dict()


def test_off_builds_no_host_path(root):
    result, placement = run(checkpoint("olmoe", root), EngineConfig(device=DEVICE, max_context=64, residents=2),
                            [1, 2], GenerationConfig(max_new_tokens=4))
    assert placement is None and result.stats.host_computed_experts == 0 and result.stats.h2d_bytes > 0


def test_a_request_cancelled_while_the_host_computes_leaves_nothing_behind(root, monkeypatch):
    """Cancel mid-request while a host expert is running: the engine stays usable, its host thread goes idle, nothing
    stays pinned, and the next request gives the same tokens as on a fresh engine."""
    path = checkpoint("mixtral", root)
    config = EngineConfig(device=DEVICE, max_context=96, residents=2, cpu_experts="all", cpu_threads=1, draft=DraftConfig(k=2))
    generation = GenerationConfig(max_new_tokens=8)
    compute, slow = HostExperts.compute, {"on": False, "running": 0}

    def maybe_slow(self, *args, **kwargs):
        if slow["on"]:
            slow["running"] += 1
            time.sleep(0.05)
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(HostExperts, "compute", maybe_slow)

    async def go():
        async with await Runtime.load(path, config) as runtime:
            fresh = (await runtime.complete_ids([5, 6, 7], generation)).tokens
            slow["on"] = True
            task = asyncio.create_task(runtime.complete_ids([5, 6, 7], GenerationConfig(max_new_tokens=32)))
            while slow["running"] == 0:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            slow["on"] = False
            host = runtime.experts.host
            deadline = time.monotonic() + 5
            while not host.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert host.idle
            cache = runtime.cache
            assert all(not cache.pinned_experts(layer) and not cache.protected_experts(layer) for layer in range(cache.num_layers))
            again = await runtime.complete_ids([5, 6, 7], generation)
            assert again.tokens == fresh and again.stats.h2d_bytes == 0
            thread = host.thread.thread
        assert not thread.is_alive()  # the runtime's close stopped the host thread

    asyncio.run(go())


def test_auto_computes_a_short_prompt_on_the_host_and_copies_a_long_ones_experts(root, monkeypatch):
    """`auto` with costs fixed (host 1 ms per block, copy 1.2 ms): decoding puts the non-residents on the host (all
    of them: with the two paths' times adding up, a host block cheaper than a copy wins for each); a prompt of up to
    64 rows runs them there (one block each), a longer one copies them (two blocks cost more than a copy). Both kinds of prompt: speculative equals k = 0, TTFT reported, and no host-path expert left in the
    cache once decoding starts."""
    from specter.experts.costs import Calibration

    async def fixed(kernel, pool, mlp, state, hidden_size, device, profile=None, parallel=False, store=None, fresh=False):
        return Calibration({state.row_bucket: 1e-3}, pool.expert_bytes / 1.2e-3, None)

    monkeypatch.setattr(build, "calibrate", fixed)
    # Without a trace `auto` places nothing for an engine that speculates (tests/test_placement_auto.py); this test is
    # about a placement's prompts and exactness under it, so the costs above decide for every engine here.
    from policies.placement import Auto
    monkeypatch.setattr(Auto, "prices_misses", lambda self, state: True)
    path = checkpoint("mixtral", root)
    spec = Checkpoint(path).spec
    placements = []

    async def go(prompt, k):
        config = EngineConfig(device=DEVICE, max_context=96, residents=spec.top_k, cpu_experts="auto", cpu_threads=1,
                              draft=DraftConfig(k=k, quant="int8"))
        async with await Runtime.load(path, config) as runtime:
            host, cache = runtime.experts.host, runtime.cache
            place = cache.place
            monkeypatch.setattr(cache, "place", lambda host_path: (placements.append(sum(map(len, host_path))), place(host_path))[1])
            result = await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=8))
            stray = [(layer, e) for layer, experts in enumerate(cache.snapshot().layers) for e in experts
                     if e in cache.host_path[layer]]
            return result, host.decode, host.prompt(len(prompt)), stray

    for prompt in ([3, 1, 4], [(7 * i) % 90 + 1 for i in range(80)]):
        placements.clear()
        plain, decode, prompted, stray = asyncio.run(go(prompt, 0))
        assert decode.active and not stray
        if len(prompt) > 64:
            assert prompted.total == 0 and placements[:2] == [0, decode.total]  # the prompt's, then decoding's again
        else:
            assert prompted == decode and placements == []
        speculative, *_ = asyncio.run(go(prompt, 3))
        assert speculative.tokens == plain.tokens and plain.stats.ttft_s > 0 and speculative.stats.ttft_s > 0


def test_placement_overlap_reaches_auto_and_splits_a_layer_the_sum_leaves_on_the_device(root, monkeypatch):
    """EngineConfig.placement_overlap is `auto`'s overlap. With a host block (1 ms) dearer than a copy (0.8 ms) the sum
    (the default, 0) keeps every expert on the device path; priced at the longer of the two paths (1) a layer's least
    used experts go to the host beside the copies. Under that placement speculative output equals k = 0 output; a
    placement plug-in without an `overlap` is refused at load, naming the option."""
    from specter.errors import PluginError
    from specter.experts.costs import Calibration

    async def fixed(kernel, pool, mlp, state, hidden_size, device, profile=None, parallel=False, store=None, fresh=False):
        return Calibration({state.row_bucket: 1e-3}, pool.expert_bytes / 0.8e-3, None)

    monkeypatch.setattr(build, "calibrate", fixed)
    from policies.placement import Auto
    monkeypatch.setattr(Auto, "prices_misses", lambda self, state: True)  # no trace: let the costs above decide
    path = checkpoint("mixtral", root)
    prompt = [3, 1, 4, 1, 5]

    async def go(k, overlap, cpu_experts="auto"):
        config = EngineConfig(device=DEVICE, max_context=96, residents=2, cpu_experts=cpu_experts, cpu_threads=1,
                              placement_overlap=overlap, draft=DraftConfig(k=k, quant="int8"))
        async with await Runtime.load(path, config) as runtime:
            host = runtime.experts.host
            placed = 0 if host is None else host.decode.total
            return placed, (await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=8))).tokens

    assert asyncio.run(go(0, None))[0] == 0
    assert asyncio.run(go(0, 0.0))[0] == 0
    placed, plain = asyncio.run(go(0, 1.0))
    layers, experts = len(Checkpoint(path).spec.moe_layers), Checkpoint(path).spec.num_experts
    assert 0 < placed < layers * (experts - 2), placed  # a split: some non-residents on the host, not all
    placed_k, speculative = asyncio.run(go(3, 1.0))
    assert placed_k == placed and speculative == plain
    with pytest.raises(PluginError, match="placement_overlap.*'all'"):
        asyncio.run(go(0, 1.0, cpu_experts="all"))


def test_a_placement_that_takes_the_overlap_and_drops_it_is_refused(monkeypatch):
    """A plug-in whose constructor swallows options (**kwargs) would silently ignore placement_overlap: refused."""
    from types import SimpleNamespace

    from specter.errors import PluginError

    monkeypatch.setattr(plugins, "load_policy", lambda group, name, **options: SimpleNamespace(name=name))
    with pytest.raises(PluginError, match="does not keep it as its `overlap`"):
        build.placement_policy(EngineConfig(cpu_experts="swallows", placement_overlap=1.0))
    assert build.placement_policy(EngineConfig(cpu_experts="swallows")).name == "swallows"  # no overlap asked: as before


def test_a_prompt_cancelled_under_its_own_placement_leaves_decodings_placement(root, monkeypatch):
    """Cancel a prompt that runs under a placement of its own (all layers on the device) mid-forward: the cache and
    the host path are back on decoding's placement at once, the experts the prompt loaded leave at the next prompt, and
    the next request gives a fresh engine's tokens."""
    from specter.verify import OffloadedExperts

    path = checkpoint("mixtral", root)
    config = EngineConfig(device=DEVICE, max_context=96, residents=2, cpu_threads=1, draft=DraftConfig(k=2, quant="int8"))
    generation = GenerationConfig(max_new_tokens=6)
    prompt = [5, 6, 7, 8, 9, 10]
    run_layer, block = OffloadedExperts.run, {"on": False, "reached": 0}

    async def maybe_blocked(self, layer, *args, **kwargs):
        if block["on"] and layer == self_layers[-1]:
            block["reached"] += 1
            await asyncio.sleep(30)
        return await run_layer(self, layer, *args, **kwargs)

    async def go():
        async with await Runtime.load(path, config) as runtime:
            fresh = (await runtime.complete_ids(prompt, generation)).tokens
            host, cache = runtime.experts.host, runtime.cache
            assert host.prompt(len(prompt)).total == 0 < host.decode.total
            block["on"] = True
            task = asyncio.create_task(runtime.complete_ids(prompt, generation))
            while block["reached"] == 0:
                await asyncio.sleep(0.005)
            assert cache.host_path == (host.placement.host) == tuple(frozenset() for _ in range(cache.num_layers))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            block["on"] = False
            assert host.placement == host.decode and cache.host_path == host.decode.host
            again = await runtime.complete_ids(prompt, generation)
            stray = [(layer, e) for layer, experts in enumerate(cache.snapshot().layers) for e in experts
                     if e in cache.host_path[layer]]
            return fresh, again.tokens, stray

    class DevicePrompts(RandomPlacement):
        def place_prefill(self, state, decode, rows):
            return Placement.device_only(state.num_layers, state.num_experts)

    self_layers = Checkpoint(path).spec.moe_layers
    monkeypatch.setattr(OffloadedExperts, "run", maybe_blocked)
    with placed_by(DevicePrompts(3)):
        fresh, again, stray = asyncio.run(go())
    assert again == fresh and not stray


HOST_S = COPY_S = 0.08  # one host expert, one expert's copy: large against a loaded 2-core machine's noise
CHUNKS = 100  # chunks per expert copy: 0.8 ms each, under TIMER_SLACK_S, as a 16 MiB chunk at Gen4 (0.84 ms)


class SplitPlacement:
    """Experts 2, 3 and 4 of every layer on the host, the others on the device path (2 slots: some of them miss)."""

    name = "split"

    def place(self, state: PlacementState) -> Placement:
        return Placement.of([[2, 3, 4]] * state.num_layers, state.num_layers, state.num_experts)


@pytest.mark.parametrize("static", [None, True])
def test_the_host_path_computes_while_the_emulated_link_copies(root, monkeypatch, static):
    """Issue 29: a layer whose forward both loads misses and computes host experts costs about the longer of the two
    paths, not their sum. The H200's link: a host-paced emulation (the CUDA engine's `LinkEmulation`, set on the CPU
    backend's transfer engine after load) whose chunks are shorter than TIMER_SLACK_S; one copy takes COPY_S, one host
    expert HOST_S (a sleep, which releases the GIL as torch's ops do). Per layer-forward with m misses and h host
    experts: at most the longer of m x COPY_S and h x HOST_S plus half the shorter, most of the host's time
    counted as hidden (`host_hidden_s`), and the loop thread idle while the link copies. The order of a layer's work
    was right before (the host job goes out before the misses' copies and is awaited once the device path is
    launched): the first two checks held then; the third did not, the pump spun through every copy (the loop thread's
    CPU time ~0.95 of the copies'), a core and the GIL taken from a host path that needs them (torch's ops)."""
    path = checkpoint("mixtral", root)
    compute, run_layer = HostExperts.compute, verify.OffloadedExperts.run
    routed_experts = verify._routed_experts

    def slow(self, *args, **kwargs):
        time.sleep(HOST_S)
        return compute(self, *args, **kwargs)

    layers = []  # (misses, host experts, wall s, hidden s, loop thread CPU s) per layer-forward

    async def timed(record, work):
        misses, hosted, hidden = record.misses, record.host_computed, record.host_hidden_s
        cpu, started = time.thread_time(), time.perf_counter()
        out = await work
        layers.append((record.misses - misses, record.host_computed - hosted, time.perf_counter() - started,
                       record.host_hidden_s - hidden, time.thread_time() - cpu))
        return out

    monkeypatch.setattr(HostExperts, "compute", slow)
    monkeypatch.setattr(verify.OffloadedExperts, "run", lambda self, *args: timed(self.record, run_layer(self, *args)))
    monkeypatch.setattr(verify, "_routed_experts", lambda *args: timed(args[6], routed_experts(*args)))

    async def go():
        config = EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, static_verify=static,
                              draft=DraftConfig(k=0))
        async with await Runtime.load(path, config) as runtime:
            transfer = runtime.cache.transfer
            expert_bytes = runtime.cache.pool.expert_bytes
            transfer.link = LinkEmulation(expert_bytes / COPY_S / 1e9, mode="host")
            transfer.chunk_bytes = expert_bytes // CHUNKS
            layers.clear()
            result = await runtime.complete_ids([5, 6, 7], GenerationConfig(max_new_tokens=4))
            return result.stats

    with placed_by(SplitPlacement()):
        stats = asyncio.run(go())
    both = [layer for layer in layers if layer[0] and layer[1]]
    assert len(both) >= 2, layers  # this checkpoint and prompt route some layers to both paths
    for misses, hosted, wall, hidden, _cpu in both:
        longer, shorter = max(misses * COPY_S, hosted * HOST_S), min(misses * COPY_S, hosted * HOST_S)
        assert longer - 0.01 <= wall <= longer + 0.5 * shorter, (misses, hosted, wall, layers)  # the sum: + shorter
        assert hidden >= 0.5 * shorter, (misses, hosted, hidden, layers)
    copying = sum(layer[0] for layer in both) * COPY_S
    assert sum(layer[4] for layer in both) <= 0.4 * copying, f"loop thread CPU {[round(l[4], 3) for l in both]} s"
    assert 0 < stats.host_hidden_s <= stats.host_compute_s


@pytest.mark.parametrize("static", [None, True])
def test_the_waits_split_a_host_bound_token(root, monkeypatch, static):
    """`routing_wait_s` and `host_wait_s` (VerifyRecord, RequestStats, the bench's wait columns), with `all` at k = 0:
    each routing read is slowed by `read_s` (a sleep inside the awaited read) and each host expert by HOST_S. Every MoE
    layer's forward reads its routing once, so the routing wait holds at least READ_S per read, the prompt's and the
    decode rounds' (the segmented verify's too, with `static`) apart; the device path of a layer is a few resident
    experts, so the verify waits for nearly all of every host job after launching it: host_wait_s covers at least 0.8
    of the host's seconds, prompt and decode apart. The verify awaits one thing at a time, so the waits stay within
    the wall time together."""
    path = checkpoint("mixtral", root)
    compute, read = HostExperts.compute, verify.host_values
    read_s, reads = 0.004, []

    def slow(self, *args, **kwargs):
        time.sleep(HOST_S)
        return compute(self, *args, **kwargs)

    async def slow_read(*args, **kwargs):
        values = await read(*args, **kwargs)
        if values and isinstance(values[0], list) and len(values[0]) == top_k:  # a router's ids (rows x top_k), not a token
            reads.append(time.perf_counter())
            await asyncio.sleep(read_s)
        return values

    monkeypatch.setattr(HostExperts, "compute", slow)
    monkeypatch.setattr(verify, "host_values", slow_read)
    config = EngineConfig(device=DEVICE, max_context=64, residents=2, cpu_threads=1, static_verify=static,
                          cpu_experts="all", draft=DraftConfig(k=0))
    layers, top_k = len(Checkpoint(path).spec.moe_layers), Checkpoint(path).spec.top_k

    async def go():
        async with await Runtime.load(path, config) as runtime:
            reads.clear()
            started = time.perf_counter()
            result = await runtime.complete_ids([5, 6, 7], GenerationConfig(max_new_tokens=3))
            return result.stats, time.perf_counter() - started

    stats, wall = asyncio.run(go())
    assert len(reads) >= 3 * layers and len(reads) % layers == 0, (len(reads), layers)  # whole forwards
    assert stats.routing_wait_s >= len(reads) * read_s, stats.as_dict()
    assert stats.routing_wait_prefill_s >= layers * read_s, stats.as_dict()  # at least one forward for the prompt
    assert stats.routing_wait_s - stats.routing_wait_prefill_s >= 2 * layers * read_s, stats.as_dict()
    assert stats.host_computed_experts > stats.host_prefill_experts > 0, stats.as_dict()
    for total, prompt in ((stats.host_wait_s, stats.host_wait_prefill_s), (stats.host_compute_s, stats.host_prefill_s)):
        assert 0 < prompt < total, stats.as_dict()
    assert stats.host_wait_prefill_s >= 0.8 * stats.host_prefill_s, stats.as_dict()
    assert stats.host_wait_s - stats.host_wait_prefill_s >= 0.8 * (stats.host_compute_s - stats.host_prefill_s)
    assert stats.routing_wait_s + stats.host_wait_s <= wall, (stats.as_dict(), wall)


def test_parallel_host_experts_keep_the_tokens(root):
    """tuning.host.parallel_experts with `all`: speculative equals k = 0, and both equal the sequential host path at one
    torch thread (a one-thread expert's bits are the same wherever it runs)."""
    from specter.config import TuningConfig

    path = checkpoint("mixtral", root)
    residents = Checkpoint(path).spec.top_k
    generation = GenerationConfig(max_new_tokens=10)
    parallel = TuningConfig().with_overrides(["host.parallel_experts=true"])
    common = dict(device=DEVICE, max_context=96, residents=residents, cpu_experts="all")
    sequential, _ = run(path, EngineConfig(**common, cpu_threads=1, draft=DraftConfig(k=0)), [3, 1, 4], generation)
    plain, placement = run(path, EngineConfig(**common, cpu_threads=3, tuning=parallel, draft=DraftConfig(k=0)),
                           [3, 1, 4], generation)
    speculative, _ = run(path, EngineConfig(**common, cpu_threads=3, tuning=parallel, draft=DraftConfig(k=4, quant="int8")),
                         [3, 1, 4], generation)
    assert placement.total > 0 and plain.stats.host_computed_experts > 0
    assert speculative.tokens == plain.tokens == sequential.tokens
