"""The runtime: runs the decode round (docs/ARCHITECTURE.md, "One decode round") over parts that `specter.build` made.

    draft k tokens (prefetching planned experts at checkpoints) -> verify k+1 tokens -> accept -> commit -> adapt

`Runtime.round` is that sentence as code. The draft-ahead beside the verify is `specter.ahead.DraftAhead`; what
the round measures without steering it (copy-busy, recall, traces, the bench's books) are `specter.observers`.
"""

from __future__ import annotations

import asyncio
import inspect
import contextlib
import dataclasses
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from specter import calibrate
from specter.accept import Acceptance, coupled_verdict, greedy_verdict, read_verdict, rejection_verdict
from specter.ahead import Carry, DraftAhead, single_failure  # noqa: F401  (Carry is part of this module's API)
from specter.build import CheckpointWeights, TargetSteps, WeightSource, build_runtime  # noqa: F401  (part of this module's API)
from specter.config import EngineConfig, GenerationConfig, TuningConfig
from specter.decode import check_prompt, greedy_decode
from specter.draft import Draft, DraftExperts
from specter.errors import CheckpointError, ConfigError, RequestCancelled
from specter.experts.cache import CacheSnapshot, CacheStats, ExpertCache, LayerStats
from specter.experts.costs import routing_profile
from specter.kernel import Kernel, StageCounters, stage
from specter.log import get_logger
from specter.memory import MemoryPlan
from specter.metrics import Estimates, RequestStats
from specter.model.checkpoint import Checkpoint
from specter.model.resident import ResidentExperts
from specter.model.spec import ModelSpec
from specter.model.transformer import ExpertProvider, Transformer
from specter.placement import PlacementState, RouteSequence
from specter.observers import CopyBusy, RoundClock, RoundObserver, RoundReport, TraceRecorder, WindowRecall
from specter.paths import check_output_file
from specter.policy import LinkTiming, LookaheadState, Plan, RoundOutcome
from specter.sampling import SamplingParams, probs, sample
from specter.steps import make_draft
from specter.trace import TraceHeader, TraceWriter
from specter.verify import OffloadedExperts, to_host
from specter.victims import UseClock, Victims  # noqa: F401  (UseClock is part of this module's API)

log = get_logger(__name__)
Tensor = torch.Tensor


@dataclasses.dataclass
class GenerationResult:
    """The new tokens of one request and its statistics."""

    tokens: list[int]
    stats: RequestStats


class PlanSource(Protocol):
    """A plan made before the draft (the bench's exact-prefetch replays recorded routes this way)."""

    def plan_before_draft(self, k: int) -> Plan | None:
        """Called once per round, after k is chosen and before the draft: experts to protect and prefetch at once
        (None: nothing). The runtime keeps the plan as the round's plan until the transfer stage makes its own."""


@dataclasses.dataclass(frozen=True)
class OwnProfile:
    """The routing trace an engine recorded of its own text (`Runtime.own_routing_profile`), as the cost model reads it."""

    route_counts: list[list[float]] | None
    """Per MoE layer and expert, the rounds whose verify used it (None: no speculative round recorded)."""
    route_sequence: RouteSequence | None
    """The rounds in order (None: none recorded)."""
    tokens: int
    """Tokens decoded (the prompt's first one included)."""
    rounds: int
    """Decoding rounds, speculative or plain."""
    acceptance: float
    """Draft tokens accepted over drafted."""
    seconds: float
    """Wall time of the decoding and the trace's reading."""

    def apply(self, state: PlacementState) -> PlacementState:
        """`state` priced from this trace: its use counts and rounds in place of the state's profile."""
        return dataclasses.replace(state, route_counts=self.route_counts, route_sequence=self.route_sequence)


class _OneDepth:
    """The own profile's lookahead (`Runtime.own_routing_profile`): every round at one depth, from no timing."""

    name = "own-profile"

    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self, state: LookaheadState) -> int:
        return min(self.k, state.k_max)

    def observe(self, outcome: RoundOutcome) -> None:
        return None


class Runtime:
    """One model on one device, serving one request at a time."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model: Transformer, memory: MemoryPlan, backend, kernel: Kernel | None,
                 experts: ExpertProvider, cache: ExpertCache | None, draft: Draft | None, policies: dict, victims: Victims,
                 steps: TargetSteps, observers: Sequence[RoundObserver] = (), plan_source: PlanSource | None = None) -> None:
        """Made by `specter.build.build_runtime` (through `load` or `build`), every part already built; `victims` is
        the cache's victim chooser, whose policy is `policies["eviction"]`. `observers` watch every request and
        round after the runtime's own (copy-busy, recall, trace); `plan_source` plans before each draft."""
        self.config, self.spec, self.model, self.memory = config, spec, model, memory
        self.backend, self.kernel, self.experts, self.cache, self.draft = backend, kernel, experts, cache, draft
        self.victims = victims
        self.prefetch, self.lookahead = policies["prefetch"], policies["lookahead"]
        assert victims.policy is policies["eviction"], "the cache's victim chooser asks the runtime's eviction policy"
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.kv, self.graphed, self.segmented = steps.kv, steps.graphed, steps.segmented
        self.k_max = config.draft.k_max if draft is not None else 0  # calibrate_draft sets it for gptq4
        self.scout = config.draft.scout  # plain rounds prefetch from one draft step's routes (offloaded, with a draft)
        # draft-ahead steps beside each verify (DraftConfig.overlap; None: on with CUDA graphs, off elsewhere)
        self.ahead = DraftAhead(draft, config.draft.overlap_steps(model.device.type, config.cuda_graphs), backend, model.device,
                                config.draft.sampling)
        self.observers: list[RoundObserver] = [CopyBusy(cache.transfer, kernel)] if cache is not None else []
        self.observers += [WindowRecall(), *observers]
        self.plan_source = plan_source
        self.estimates = Estimates(self.k_max)
        self.stages = StageCounters()  # per-stage counts and host wall time (draft, verify), see specter.kernel.stage
        self._counts_host: list[Tensor] = []  # pinned snapshots of the draft's route counters, one per checkpoint (CUDA)
        self._generator: torch.Generator | None = None  # rejection sampling, re-seeded every round
        self._closed = False
        self._lock = asyncio.Lock()

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    async def load(cls, path: str | Path, config: EngineConfig | None = None) -> Runtime:
        """Read a checkpoint directory and build the runtime (see `build`)."""
        return await cls.build(CheckpointWeights(Checkpoint(path)), config)

    @classmethod
    async def build(cls, source: WeightSource, config: EngineConfig | None = None) -> Runtime:
        """Plan memory (refusing a budget below the minimum before allocating), then load from `source`."""
        return await build_runtime(cls, source, config)

    # the eviction policy, the use history and the round's plan live in the cache's victim chooser
    eviction = property(lambda self: self.victims.policy, lambda self, policy: setattr(self.victims, "policy", policy))
    uses = property(lambda self: self.victims.uses, lambda self, uses: setattr(self.victims, "uses", uses))
    plan = property(lambda self: self.victims.plan, lambda self, plan: setattr(self.victims, "plan", plan))

    async def calibrate_draft(self, prompts: Sequence[list[int]] | None = None, new_tokens: int = calibrate.DEFAULT_NEW_TOKENS) -> None:
        """Build a GPTQ draft: record expert inputs while the target decodes `prompts`, then quantize per layer."""
        spec = self.spec
        recorder = calibrate.RecordingExperts(self.experts)
        prompts = prompts or calibrate.default_prompts(spec.vocab_size)
        # The target decodes them into the engine's own KV: in a short context (max_context may be as small as 8), a
        # prompt keeps at most half of it, so that some tokens are decoded after it too.
        limit = self.config.max_context
        prompts = [list(prompt)[: max(1, limit // 2)] for prompt in prompts]
        new_tokens = max(1, min(new_tokens, limit - max(len(p) for p in prompts)))
        await calibrate.calibrate(lambda p: greedy_decode(self.model, recorder, p, new_tokens, kv=self.kv), recorder, prompts)
        self._end_request()
        on_host = {}
        for layer in spec.moe_layers:
            inputs, choices = recorder.layer(layer)
            flats = [self._full_expert(layer, e) for e in range(spec.num_experts)]
            # Held on the host until every layer is done: then the Hessians' and GPTQ's temporaries go back to the
            # device whole, and the draft's tensors take segments of their own, as `quantize_layers` allocates the
            # int4 draft's, instead of pinning the temporaries' cached blocks in the reserve beyond the plan.
            on_host[layer] = calibrate.gptq_layer(flats, inputs, choices, spec.hidden_size, spec.expert_intermediate,
                                                  self.config.draft, to="cpu")
        recorder = inputs = choices = flats = None  # the recorded activations are device temporaries too
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        layers = {layer: quantized.to(self.model.device) for layer, quantized in on_host.items()}
        draft_experts = DraftExperts(layers, spec.num_layers, spec.num_experts, self.model.device, tiles=self.config.tuning.kernels.moe)
        self.draft = self.ahead.draft = make_draft(self.model, draft_experts, self.config)
        self.draft.capture(self.kv)
        self.k_max = self.config.draft.k_max
        self.estimates = Estimates(self.k_max)

    def capture_graphs(self) -> None:
        """Called once by the builder: capture the CUDA graphs at start-up, while the KV is empty, so decoding allocates nothing."""
        if self.graphed is not None:
            self.graphed.prepare()
        if self.segmented is not None:
            self.segmented.prepare()
            assert self.cache is not None, "a segmented verify serves offloaded experts"
            self.segmented.prepare_experts([self.cache.slot_weights(slot) for slot in range(self.cache.weights.shape[0])])
        if self.draft is not None:
            self.draft.capture(self.kv)

    def _full_expert(self, layer: int, expert: int) -> Tensor:
        if isinstance(self.experts, ResidentExperts):
            return self.experts.expert(layer, expert)
        assert self.cache is not None
        return self.cache.pool.host(self.moe_index[layer], expert)

    def loads_in_flight(self) -> int:
        """The expert cache's loads not yet settled (0 without a cache)."""
        return self.cache.loads_in_flight() if self.cache is not None else 0

    async def aclose(self) -> None:
        """Release everything, each part whatever the one before it raised (a CPU stream's failed work is raised by
        every later wait, the transfer engine's last ones included: its threads, pump and trace must still end);
        the first error is raised at the end."""
        self._closed = True
        steps: list[Callable[[], Any]] = [self._finish_deferred]  # reads events of chunks the cache still holds
        if self.cache is not None:
            steps += [self.cache.aclose, self.cache.transfer.aclose]
        steps += self._loop_free_closes()
        first: BaseException | None = None
        for step in steps:
            try:
                if inspect.isawaitable(result := step()):
                    await result
            except Exception as error:
                first = first or error
        if first is not None:
            raise first

    def release_threads(self) -> None:
        """What `aclose` releases that needs no event loop, for a runtime nobody closed (`Engine`'s finalizer): the host
        expert path's thread, the kernel's waiters, the backend's streams, the observers' files; each whatever the one
        before it raised. The loop's own tasks (the transfer pump) ended with their loop."""
        self._closed = True
        for step in self._loop_free_closes():
            try:
                if inspect.isawaitable(result := step()):
                    result.close()  # (a coroutine: nothing runs it now)
            except Exception as error:  # noqa: BLE001 (a finalizer has no caller to raise to)
                log.warning("runtime.release_failed", step=getattr(step, "__qualname__", repr(step)), error=repr(error))

    def _loop_free_closes(self) -> list[Callable[[], Any]]:
        """The closes of the parts that own threads or files, in `aclose`'s order: the host expert path's thread, the
        kernel's waiters, the backend's streams, the observers."""
        steps: list[Callable[[], Any]] = [self.experts.close] if isinstance(self.experts, OffloadedExperts) else []
        steps += [part.close for part in (self.kernel, self.backend) if part is not None]
        return steps + [observer.close for observer in self.observers]

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def retune(self, tuning: TuningConfig) -> None:
        """Take `tuning` from the next request on: the cache, transfer and verify knobs are read at run time (A/B
        runs flip them between the requests of one process). The kernels' are fixed when the graphs are captured, the host
        path's when its threads start."""
        if tuning.kernels != self.config.tuning.kernels:
            raise ConfigError("tuning.kernels is fixed when the runtime is built (its CUDA graphs are captured then); "
                              "build another runtime to change it")
        if tuning.host != self.config.tuning.host:
            raise ConfigError("tuning.host is fixed when the host expert path starts (its threads are set up then); "
                              "build another runtime to change it")
        self.config = self.config.model_copy(update={"tuning": tuning})
        if self.cache is not None:
            self.cache.tuning, self.cache.transfer.tuning = tuning.cache, tuning.transfer
        if isinstance(self.experts, OffloadedExperts):
            self.experts.tuning = tuning.verify

    def record_trace(self, path: str | Path) -> None:
        """Write a routing trace (see specter.trace) of every speculative round from now on."""
        check_output_file(path, "trace path")  # a clear ConfigError instead of an OSError from open()
        # the cache's own counts: the bench may give a cache slots that are not one plan's spread
        slots = self.cache.layer_slots if self.cache is not None else self.memory.layer_slots
        header = TraceHeader(model=self.spec.family, num_layers=len(self.spec.moe_layers), num_experts=self.spec.num_experts,
                             expert_bytes=self.memory.expert_bytes, top_k=self.spec.top_k, slots_per_layer=min(slots),
                             layer_slots=tuple(slots),
                             # whose schedule the rounds' checkpoints are: a replay keeps it for this prefetch only
                             extra={"eviction": self.victims.policy.name, "prefetch": self.prefetch.name})
        self.stop_trace()  # one trace at a time: the latest path
        self.observers.append(TraceRecorder(TraceWriter(path, header)))

    def stop_trace(self) -> None:
        """Stop writing the routing trace `record_trace` started, and close its file (nothing without one)."""
        for old in [observer for observer in self.observers if isinstance(observer, TraceRecorder)]:
            self.observers.remove(old)
            old.close()

    async def own_routing_profile(self) -> OwnProfile:
        """Decode `config.self_profile_tokens` tokens of the model's own text with speculation on, recording their routing
        trace, and return it as the placement's cost model reads one (`costs.routing_profile`: counts and rounds, None
        and None where no speculative round was recorded) with what the decoding took. Called once at load, before any
        request, by `build.place_runtime` where the placement policy needs a trace's rounds and none was given.

        The engine is then left as it was before: the cache's residents as they were (an empty cache at load), its
        counters, the use history, the transfer engine's bandwidth estimate, the stage counters and the acceptance
        estimates afresh, the KV empty (as after any request); the placement then loads what it keeps on the device.

        Every round drafts at one depth, whatever a lookahead chosen from timings (`roofline`) would choose: the fixed
        lookahead's k, else k_max (`own_profile_depth`). Rounds cut by timings would differ from load to load, and the
        placement priced from them with them. The text is the model's own, sampled as a chat user samples (temperature
        0.7, top-p 0.9, seed 0) after a prompt of `calibrate.DEFAULT_PROMPT_LEN` ids drawn from a fixed seed (the GPTQ
        calibration's first prompt): no text of the user's is needed, and the routing is the model's on the text it
        writes. A workload unlike that (code, another language) is profiled better by a trace of it (`generate
        --trace`, given as placement_profile)."""
        started = time.perf_counter()
        limit = self.config.max_context
        prompt = calibrate.default_prompts(self.spec.vocab_size, count=1,
                                           length=max(1, min(calibrate.DEFAULT_PROMPT_LEN, limit // 2)))[0]
        new_tokens = min(self.config.self_profile_tokens, limit - len(prompt))
        if new_tokens < 1:
            return OwnProfile(None, None, 0, 0, 0.0, 0.0)
        generation = GenerationConfig(max_new_tokens=new_tokens, temperature=0.7, top_p=0.9, seed=0)
        before = self.cache.snapshot() if self.cache is not None else None
        lookahead, self.lookahead = self.lookahead, _OneDepth(self.own_profile_depth())
        with tempfile.TemporaryDirectory(prefix="specter-own-profile-") as folder:
            path = Path(folder) / "routing-trace.jsonl"
            self.record_trace(path)
            try:
                result = await self.complete_ids(prompt, generation)
            finally:
                self.stop_trace()
                self.lookahead = lookahead
            counts, sequence = routing_profile(path, len(self.spec.moe_layers), self.spec.num_experts)
        await self.forget_decoding(before)
        return OwnProfile(counts, sequence, len(result.tokens), result.stats.rounds, result.stats.acceptance_rate,
                          time.perf_counter() - started)

    def own_profile_depth(self) -> int:
        """The draft depth of every round of `own_routing_profile`: the fixed lookahead's k (as the engine will draft),
        else k_max (a lookahead that adapts the depth may draft up to it)."""
        return min(self.config.draft.k, self.k_max) if self.config.lookahead == "fixed" else self.k_max

    async def forget_decoding(self, cache: CacheSnapshot | None) -> None:
        """What a decoding at load left (`own_routing_profile`'s, a GPTQ draft's calibration), undone: the cache as
        `cache` (its snapshot before), its and the link's measures, the use history, the stage counters and the
        estimates as a fresh engine's, so that the placement is made, and the first request served, as without it."""
        if self.cache is not None and cache is not None:
            await self.cache.restore(cache)
            self.cache.stats = CacheStats([LayerStats() for _ in range(self.cache.num_layers)])
            self.cache.transfer.forget_bandwidth()
        self.uses = UseClock(len(self.spec.moe_layers))
        self.stages = StageCounters()
        self.estimates = Estimates(self.k_max)

    # ---- requests -----------------------------------------------------------------------------
    async def generate_ids(self, prompt_ids: Sequence[int], generation: GenerationConfig | None = None,
                           stats: RequestStats | None = None) -> AsyncIterator[list[int]]:
        """Yield the tokens committed by each round. One request at a time; others wait their turn."""
        if self._closed:
            raise RequestCancelled("this runtime is closed; load a new one with Runtime.load")
        generation = generation or GenerationConfig()
        prompt_ids = list(prompt_ids)
        check_prompt(prompt_ids, generation.max_new_tokens, self.spec.vocab_size, self.config.max_context)
        stats = stats if stats is not None else RequestStats()
        async with self._lock:
            try:
                async for tokens in self._generate(prompt_ids, generation, stats):
                    yield tokens
            finally:
                self._end_request()

    async def complete_ids(self, prompt_ids: Sequence[int], generation: GenerationConfig | None = None) -> GenerationResult:
        stats = RequestStats()
        tokens: list[int] = []
        async for piece in self.generate_ids(prompt_ids, generation, stats):
            tokens.extend(piece)
        return GenerationResult(tokens, stats)

    def _end_request(self) -> None:
        """Leave the engine consistent whatever happened: no protected slot, no plan, an empty KV, and the
        request's deferred copy-busy reads done (after its last token's time, before its stats are read)."""
        try:
            try:  # observers first (copy-busy stops its chunk log before the round-end loads), but an observer's
                for observer in self.observers:  # error must not leave the cache's pins and loans to the next request
                    observer.request_ended()
            finally:
                if self.cache is not None:
                    self.cache.unprotect_all(self.backend.record_event(self.backend.compute_stream))
        finally:  # whatever the cache or an observer raised, the rest still runs
            self.plan = None
            self.estimates.break_plain_run()
            self.ahead.reset()
            self.ahead.join()
            self.kv.reset()
            self._finish_deferred()  # last: whatever it meets, the engine is consistent already

    async def _generate(self, prompt: list[int], generation: GenerationConfig, stats: RequestStats) -> AsyncIterator[list[int]]:
        params = SamplingParams(generation.temperature, generation.top_k, generation.top_p, generation.seed)
        stats.prompt_tokens = len(prompt)
        stats.h2d_bytes_at_start = self._bytes_loaded()
        started = time.perf_counter()
        for observer in self.observers:
            observer.request_started(stats)
        first = await self._prefill(prompt, params, stats)
        for observer in self.observers:
            observer.prefilled(stats)
        stats.ttft_s = time.perf_counter() - started
        stats.h2d_prefill_bytes = self._bytes_loaded() - stats.h2d_bytes_at_start
        stats.host_prefill_experts, stats.host_prefill_s = stats.host_computed_experts, stats.host_compute_s
        stats.routing_wait_prefill_s, stats.host_wait_prefill_s = stats.routing_wait_s, stats.host_wait_s
        stats.stall_prefill_s = stats.stall_s
        produced = [first]
        stats.token_times.append(time.perf_counter())
        stats.new_tokens = 1
        yield [first]
        stop = set(generation.stop_token_ids)
        while len(produced) < generation.max_new_tokens and produced[-1] not in stop:
            remaining = generation.max_new_tokens - len(produced)
            tokens = await self.round(produced[-1], params, remaining, stats)
            tokens = _until_stop(tokens, stop)
            produced.extend(tokens)
            now = time.perf_counter()
            stats.token_times.extend([now] * len(tokens))
            stats.new_tokens = len(produced)  # kept current: a consumer may stop iterating at any point
            yield tokens

    async def _prefill(self, prompt: list[int], params: SamplingParams, stats: RequestStats) -> int:
        self.kv.reset()
        self.ahead.reset()
        tokens = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
        record = self._start_record()
        async with self._prompt_placement(len(prompt)):  # a long prompt may copy experts decoding computes on the host
            hidden = await self.model.forward(tokens, 0, self.kv, self.experts)
        self.kv.crop(len(prompt))
        logits = self.model.logits(hidden[-1:])
        token = sample(logits, torch.tensor([len(prompt)], device=logits.device), params)
        finite = torch.isfinite(logits).all().view(1).to(token.dtype)  # read with the token: no second sync
        first, ok = (int(value) for value in await to_host(self.kernel, torch.cat([token, finite])))
        self._account(record, stats)  # after the host read: the device-side waits have completed
        if not ok:  # an argmax over NaN is token 0 forever, which would pass for output
            raise CheckpointError("the model's logits for the prompt are not finite (NaN or inf): its weights or "
                                  "config.json (rope_theta, rms_norm_eps, a norm's weights) are broken; check the "
                                  "checkpoint against its source")
        return first

    def _prompt_placement(self, rows: int) -> contextlib.AbstractAsyncContextManager:
        """The prompt's placement (`OffloadedExperts.prompt_placement`); nothing to switch for resident experts."""
        if isinstance(self.experts, OffloadedExperts):
            return self.experts.prompt_placement(rows)
        return contextlib.nullcontext()

    # ---- one decode round (docs/ARCHITECTURE.md) ------------------------------------------------------
    async def round(self, x0: int, params: SamplingParams, remaining: int, stats: RequestStats) -> list[int]:
        """Choose k, draft, plan and prefetch, verify, accept, commit, adapt. Returns the committed tokens (1..k+1).

        The engine loop, one line per step of docs/ARCHITECTURE.md's round. With a draft-ahead (`DraftAhead`) the draft also
        guesses the target's own next token, and the verify runs beside draft steps from that guess.
        """
        start = self.kv.length  # position of x0
        k = self._next_k(remaining)  # 1. choose k
        self._plan_before_draft(k)
        ahead = self.ahead.steps(start, k, remaining, params, self.kv.capacity)  # draft-ahead steps beside the verify (0: none)
        prefix = self.ahead.take(x0, start, k + 1 if ahead else k)  # the last draft-ahead's steps, if they start here
        clock, bytes_at_start = RoundClock(self._gpu_mark, self._stream_mark), self._bytes_loaded()
        x0_tensor = self._device_ids([x0])
        clock.mark_start()
        for observer in self.observers:
            observer.round_started()
        # 2. draft, 3. plan and prefetch beside it
        drafted, draft_logits, guess, scouted = await self._draft_stage(x0_tensor, start, k, ahead, params, prefix)
        clock.drafted()
        block = torch.cat([x0_tensor, drafted]) if k else x0_tensor  # [x0, d1..dk]
        record = self._start_verify_record()
        clock.verify_started()
        try:
            async with stage("verify", counters=self.stages, rows=k + 1):
                logits = await self._verify_stage(block, start, guess, ahead, params)  # 4. verify: [k+1, V]
                clock.verified()
                acceptance, guessed = await self._accept(block[1:], logits, draft_logits, start, params, guess)  # 5. accept
                if record is not None:
                    record.settle()  # the verdict has been read: the verify's device-side waits are complete
        finally:
            self.ahead.join()
        clock.accepted()
        self.kv.crop(start + acceptance.n_accepted + 1)  # 6. commit
        self.ahead.settle(start, k, ahead, acceptance, guessed, stats)
        clock.ended()
        report = self._count_round(k, scouted, acceptance, record, stats, clock, bytes_at_start, k + 1 if ahead and k else k)
        for observer in self.observers:
            observer.round_done(report)
        self._adapt(report, clock)  # 7. adapt
        return acceptance.tokens

    def _next_k(self, remaining: int) -> int:
        if self.draft is None:
            return 0
        k = self.lookahead.next_k(state=self._lookahead_state())
        return max(0, min(k, self.k_max, remaining - 1))

    def _plan_before_draft(self, k: int) -> None:
        """The plan source's plan, if any, protected and prefetched now (offloaded runtimes only)."""
        if self.plan_source is None or self.cache is None:
            return
        plan = self.plan_source.plan_before_draft(k)
        if plan is not None:
            self.plan = plan
            for layer in range(len(self.spec.moe_layers)):
                planned = plan.for_layer(layer)
                self.cache.protect(layer, planned)
                self.cache.prefetch(layer, planned)

    async def _draft_stage(self, x0: Tensor, start: int, k: int, ahead: int, params: SamplingParams,
                           prefix: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None, bool]:
        """Steps 2 and 3: k draft steps (k + 1 with a draft-ahead: the last is its guess), planning and prefetching
        beside them; or, in a plain round with a scout, one step whose token is dropped (its routes for x0 plan the
        prefetch). Returns (drafts [k], their logits (rejection sampling), the guess [1], whether it scouted)."""
        scouted = not k and self._scouting()
        if not (k or scouted):
            return None, None, None, False
        async with stage("draft", counters=self.stages, k=k):
            drafted, draft_logits = await self._draft_and_transfer(x0, start, (k + 1 if ahead else k) or 1, params, prefix)
        if scouted:
            return None, None, None, True
        if not ahead:
            return drafted, draft_logits, None, False
        self.ahead.keep_counts()  # d_{k+1} is not verified: the first token of the draft-ahead
        return drafted[:k], draft_logits, drafted[k:], False

    def _scouting(self) -> bool:
        return self.scout and self.draft is not None and self.cache is not None

    async def _draft_and_transfer(self, x0: Tensor, start: int, k: int, params: SamplingParams,
                                  prefix: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The draft and transfer stages as one task group: at each prefetch checkpoint the draft snapshots its
        route counters (an async D2H copy) and goes on enqueuing steps, while the transfer stage waits for the GPU
        to pass that point, plans, and issues copies. Leaving the group (normally, by error or by cancellation)
        leaves no stage running; a single failure surfaces as itself, not a group."""
        with single_failure():
            async with asyncio.TaskGroup() as stages:
                checkpoints: asyncio.Queue[tuple[int, Tensor, Any] | None] = asyncio.Queue()
                stages.create_task(self._transfer_stage(checkpoints, k), name="specter-transfer-stage")
                drafted = await stages.create_task(self._draft(x0, start, k, params, checkpoints, prefix), name="specter-draft-stage")
                checkpoints.put_nowait(None)
        return drafted

    async def _draft(self, x0: Tensor, start: int, k: int, params: SamplingParams,
                     checkpoints: asyncio.Queue, prefix: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The draft stage: k steps; at each prefetch checkpoint, hand a snapshot of the counters to the transfer stage.

        With a prefix (steps a draft-ahead already took), checkpoints it passed fold into one at its end.
        """
        assert self.draft is not None
        done = 0 if prefix is None else prefix.shape[0]
        planned_at = {max(step, done) for step in self.prefetch.checkpoints(k=k, timing=self._timing())} if self.cache is not None else set()

        taken = 0

        async def after_step(steps_done: int) -> None:
            nonlocal taken
            if steps_done in planned_at:
                checkpoints.put_nowait((steps_done, *self._snapshot_counts(taken)))
                taken += 1
                await asyncio.sleep(0)  # let the transfer stage start waiting on the snapshot

        keep = params.temperature > 0 and self.config.draft.sampling == "rejection"
        return await self.draft.propose(x0, start, k, self.kv, params, after_step, keep_logits=keep, prefix=prefix)

    def _snapshot_counts(self, index: int) -> tuple[Tensor, Any]:
        """Copy the route counters [L_moe, E] to host memory without waiting; the event says when they landed.

        Each checkpoint of a round has its own pinned buffer, so a later snapshot never overwrites one the
        transfer stage has not read yet.
        """
        assert self.draft is not None
        counts = self.draft.route_counts  # [L, E], the whole tensor: a device-side row gather would sync on its index
        if counts.device.type == "cpu":
            return counts.clone(), None
        while len(self._counts_host) <= index:
            self._counts_host.append(torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True))
        return self._counts_host[index], self.backend.copy_d2h(self._counts_host[index], counts, self.backend.compute_stream)

    async def _transfer_stage(self, checkpoints: asyncio.Queue, k: int) -> None:
        """The transfer stage: for each checkpoint, await its counters, plan, protect and issue copies in layer order."""
        while (item := await checkpoints.get()) is not None:
            steps_done, counts, landed = item
            if landed is not None:
                await self.kernel.wait(landed)  # the GPU has passed this draft step; later steps keep running
            self._plan_and_prefetch(counts.numpy()[self.spec.moe_layers].astype(np.float64), steps_done, k)

    def _plan_and_prefetch(self, counts: np.ndarray, steps_done: int, k: int) -> None:
        assert self.cache is not None
        for observer in self.observers:
            observer.planned(steps_done, counts)
        self.plan = self.prefetch.plan(route_counts=self._device_path_counts(counts), resident=self._residency(), steps_done=steps_done, k=k,
                                       timing=self._timing(), slots_per_layer=self.cache.slots_per_layer,
                                       layer_slots=self.cache.layer_slots)
        for layer in range(len(self.spec.moe_layers)):
            planned = self.plan.for_layer(layer)
            self.cache.protect(layer, planned, replace=True)
            self.cache.prefetch(layer, planned)

    def _device_path_counts(self, counts: np.ndarray) -> np.ndarray:
        """The draft's route counts [L, E] as the prefetch policy sees them: host-path experts (the placement's) at 0,
        so a plan's slots go to experts the cache serves (the cache would skip the others anyway)."""
        host_path = self.cache.host_path
        if not any(host_path):
            return counts
        counts = counts.copy()
        for layer, experts in enumerate(host_path):
            counts[layer, list(experts)] = 0
        return counts

    def _start_verify_record(self):
        """The verify's record of hits, misses, stall and experts used (offloaded runtimes; None otherwise)."""
        record = self._start_record()
        if record is not None:  # the segmented verify leads each layer's routing with these (VerifyTuning.lead_misses)
            self.experts.predicted = self._predicted() if self.segmented is not None and self.experts.tuning.lead_misses > 0 else None
        return record

    def _predicted(self) -> dict[int, list[int]] | None:
        """Per cache layer, the experts this round's plan expects the verify to use, likeliest first: the planned
        ones in the plan's order, then the other experts it scores above zero (the draft routed to them), by score.
        None when the round made no plan (it did not draft)."""
        plan = self.plan
        if plan is None:
            return None
        predicted = {}
        for layer in range(len(self.spec.moe_layers)):
            planned = plan.for_layer(layer)
            scores, chosen = plan.scores.get(layer, {}), set(planned)
            rest = sorted((e for e, score in scores.items() if score > 0 and e not in chosen), key=lambda e: (-scores[e], e))
            if planned or rest:
                predicted[layer] = planned + rest
        return predicted

    async def _verify_stage(self, block: Tensor, start: int, guess: Tensor | None, ahead: int, params: SamplingParams) -> Tensor:
        """Step 4, with the draft-ahead's steps beside it when there are any (from the guess, at start + k + 1)."""
        if not ahead:
            return await self._verify(block, start)
        return await self.ahead.beside(lambda: self._verify(block, start), guess, start + block.shape[0], ahead, self.kv, params)

    async def _verify(self, block: Tensor, start: int) -> Tensor:
        """The target over [x0, d1..dk] at positions start..start+k: logits [k+1, V]."""
        if self.segmented is not None:  # offloaded, static_verify: the resident graph's numerics, experts hot first
            return await self.experts.verify_static(self.segmented, block, start)
        if self.graphed is not None:  # resident on CUDA: one R-row graph serves k = 0 and every verify
            return self.graphed.logits(block, start)
        hidden = await self.model.forward(block, start, self.kv, self.experts)
        return self.model.logits(hidden)

    async def _accept(self, drafts: Tensor, logits: Tensor, draft_logits: Tensor | None, start: int,
                      params: SamplingParams, guess: Tensor | None = None) -> tuple[Acceptance, int | None]:
        """Step 5: the verdict, and the draft-ahead's guess (host) in the same copy when there is one."""
        positions = torch.arange(start + 1, start + 2 + drafts.shape[0], device=logits.device)
        if params.greedy:
            verdict = greedy_verdict(drafts, logits)
        elif draft_logits is not None:
            generator = self._rejection_generator(logits.device).manual_seed((params.seed * 1_000_003 + start) % 2**64)
            verdict = rejection_verdict(drafts, probs(draft_logits, params), probs(logits, params), generator)
        else:
            verdict = coupled_verdict(drafts, logits, positions, params)
        size, rows = verdict.shape[0], logits.shape[0]
        finite = torch.isfinite(logits).all(dim=-1).to(verdict.dtype)  # [k+1], read with the verdict: no second sync
        parts = [verdict, finite] + ([guess.to(verdict.dtype)] if guess is not None else [])
        host = await to_host(self.kernel, torch.cat(parts))  # await point: the round's one host sync for acceptance
        acceptance = read_verdict(torch.tensor(host[:size]))
        if not all(host[size : size + acceptance.n_accepted + 1]):  # the rows whose tokens are committed
            # An argmax over NaN is token 0 forever, which would pass for output (the prompt's logits are checked too).
            raise CheckpointError(f"the model's logits at position {start + 1 + host[size : size + rows].index(0)} are "
                                "not finite (NaN or inf): in float16 its activations can overflow, so run it in "
                                "bfloat16 (--dtype bfloat16); otherwise its weights or config.json are broken")
        return acceptance, (host[-1] if guess is not None else None)

    def _rejection_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator

    def _count_round(self, k: int, scouted: bool, acceptance: Acceptance, record, stats: RequestStats, clock: RoundClock,
                     bytes_at_start: int, drafted: int) -> RoundReport:
        """Count the round in the request's stats and the use history; the report the observers get."""
        stats.rounds += 1
        self._account(record, stats)
        if k:
            stats.drafted += k
            stats.accepted += acceptance.n_accepted
            stats.accepted_lengths[acceptance.n_accepted] += 1
            stats.depths[k] += 1
        if scouted:
            stats.scouted += 1
        return RoundReport(index=stats.rounds, k=k, drafted=drafted, scouted=scouted, acceptance=acceptance, verify=record,
                           draft_counts=self.ahead.round_counts() if (k or scouted) and self.draft is not None else None,
                           moe_layers=self.spec.moe_layers, window=clock.window, loaded_bytes=self._bytes_loaded() - bytes_at_start,
                           draft_step_s=self._draft_step_s(), stats=stats)

    def _adapt(self, report: RoundReport, clock: RoundClock) -> None:
        """Step 7: lift the round's protections, then feed what it measured to the estimates and the lookahead policy."""
        k, accepted, record = report.k, report.acceptance.n_accepted, report.verify
        if report.scouted:  # the scout's time is the plain rounds' own (LookaheadState.scout_s), not a depth-1 draft
            self.estimates.observe_scout(clock.draft_s)
        if self.cache is not None:
            self.cache.unprotect_all(self.backend.record_event(self.backend.compute_stream))
        self.plan = None
        round_s = clock.round_s
        self.estimates.observe_acceptance(k, accepted)
        # With a draft-ahead the verify's time includes the steps drafted beside it, and a round that took
        # steps over drafted only the rest: its real draft time goes into the fit (not charging them twice).
        self.estimates.observe_draft(k, clock.draft_s, steps=self.ahead.steps_run(k))
        self.estimates.observe_round(k, round_s, clock.draft_s, clock.verify_s)
        rows = k + 1
        if record is not None and k:
            self.estimates.observe_union(rows, sum(record.first_row.values()), len(_routed_pairs(record)))
        elif record is not None:
            self.estimates.observe_plain_token(_routed_pairs(record))
        if k or record is None:
            self.estimates.break_plain_run()
        self.estimates.observe_verify(rows, max(0.0, clock.verify_s - (record.stall_s if record else 0.0)), report.loaded_bytes)
        if self.draft is not None:  # without a draft `_next_k` asks the policy nothing: no outcome of its choice to learn
            self.lookahead.observe(outcome=RoundOutcome(k=k, accepted=accepted, tpot_s=round_s / (accepted + 1),
                                                        round_s=round_s))

    # ---- measurements -------------------------------------------------------------------------------
    def _start_record(self):
        return self.experts.start_record() if isinstance(self.experts, OffloadedExperts) else None

    def _account(self, record, stats: RequestStats) -> None:
        if record is None:
            return
        record.settle()  # device-side waits into stall_s (idempotent)
        stats.hits += record.hits
        stats.misses += record.misses
        stats.host_computed_experts += record.host_computed
        stats.host_compute_s += record.host_s
        stats.host_hidden_s += record.host_hidden_s
        stats.stall_s += record.stall_s
        stats.routing_wait_s += record.routing_wait_s
        stats.host_wait_s += record.host_wait_s
        for layer, used in record.used.items():
            self.uses.used(self.moe_index[layer], used)
        stats.h2d_bytes = self._bytes_loaded() - stats.h2d_bytes_at_start

    def _finish_deferred(self) -> None:
        if self.kernel is not None:
            self.kernel.run_deferred()

    def _gpu_mark(self):
        """A timed event on the compute stream (CUDA only; None elsewhere, where host wall time is exact)."""
        if self.model.device.type != "cuda":
            return None
        return self.backend.record_event(self.backend.compute_stream, timed=True)

    def _stream_mark(self):
        """Off CUDA: a timed event on the backend's compute stream (idle there, so it completes at about
        once), giving the copy-busy window a start and an end on the copy stream's clock."""
        return None if self.cache is None else self.backend.record_event(self.backend.compute_stream, timed=True)

    def _device_ids(self, ids: list[int]) -> Tensor:
        """Token ids to the device without a blocking copy (pinned source, non-blocking on CUDA)."""
        host = torch.tensor(ids, dtype=torch.long)
        if self.model.device.type == "cuda":
            return host.pin_memory().to(self.model.device, non_blocking=True)
        return host

    # ---- measurements for the policies ------------------------------------------------------------
    def _bytes_loaded(self) -> int:
        return self.cache.stats.total().bytes_loaded if self.cache is not None else 0

    def _residency(self) -> np.ndarray:
        resident = np.zeros((len(self.spec.moe_layers), self.spec.num_experts), dtype=bool)
        if self.cache is None:
            resident[:] = True
            return resident
        for layer in range(resident.shape[0]):
            resident[layer, self.cache.lru_order(layer)] = True
        return resident

    def bandwidth(self) -> float:
        measured = self.cache.transfer.bandwidth_bytes_per_s if self.cache is not None else None
        return float(measured or 25e9)

    def _timing(self) -> LinkTiming:
        return LinkTiming(bandwidth_bytes_per_s=self.bandwidth(), draft_step_s=self._draft_step_s(),
                          expert_bytes=self.memory.expert_bytes)

    def _draft_step_s(self) -> float:
        """The draft-step time the prefetch plans with: the estimate, or 1 ms before a draft step was timed."""
        return self.estimates.draft_step_s or 1e-3

    def _lookahead_state(self) -> LookaheadState:
        return LookaheadState(
            acceptance_by_position=self.estimates.measured_acceptance(self.k_max),
            draft_step_s_fit=self.estimates.draft_fit(),
            verify_s_fit=self.estimates.verify_fit(),
            bandwidth_bytes_per_s=self.bandwidth(),
            predicted_new_bytes=self.estimates.predicted_new_bytes(self.k_max),
            k_max=self.k_max,
            model_key=(f"{self.spec.family}:{self.spec.hidden_size}x{self.spec.num_layers}:{self.memory.slots_per_layer}"
                       f"+{self.memory.extra_slots}"),
            round_overhead_s=self.estimates.overheads(),
            scout_s=(self.estimates.scout_s or sum(self.estimates.draft_fit())) if self._scouting() else 0.0,
            union_exponent=self.estimates.beta,
        )


def _routed_pairs(record) -> frozenset[tuple[int, int]]:
    """The (layer, expert) pairs a forward's rows chose, on either path (the device's `used`, the host's `host_used`)."""
    return frozenset((layer, expert) for used in (record.used, record.host_used) for layer, experts in used.items()
                     for expert in experts)


def _until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop:
            return tokens[: index + 1]
    return tokens
