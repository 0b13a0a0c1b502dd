"""The runtime: loads a model within a memory budget and runs the decode round of DESIGN section 1.

    draft k tokens (prefetching planned experts at checkpoints) -> verify k+1 tokens -> accept -> commit -> adapt

`Runtime.round` is that sentence as code. Loading splits one memory budget between non-expert weights,
the quantized draft, the KV cache and the expert slots; experts that do not fit live in host memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specter import calibrate
from specter.accept import Acceptance, coupled_verdict, greedy_verdict, read_verdict, rejection_verdict
from specter.config import EngineConfig, GenerationConfig, TuningConfig
from specter.decode import check_prompt, greedy_decode
from specter.draft import Draft, DraftExperts
from specter.errors import ConfigError, RequestCancelled
from specter.experts.cache import ExpertCache
from specter.kernel import NOT_READY, Kernel, StageCounters, stage
from specter.build import CheckpointWeights, TargetSteps, WeightSource, build_runtime  # noqa: F401  (part of this module's API)
from specter.log import get_logger
from specter.memory import MemoryPlan
from specter.metrics import Estimates, RequestStats, busy_within, idle_causes, pump_gaps
from specter.model.checkpoint import Checkpoint
from specter.model.kv import KVCache
from specter.model.resident import ResidentExperts
from specter.model.spec import ModelSpec
from specter.paths import check_output_file
from specter.model.transformer import ExpertProvider, Transformer
from specter.policy import LinkTiming, LookaheadState, Plan, RoundOutcome
from specter.steps import make_draft
from specter.sampling import SamplingParams, probs, sample
from specter.trace import TraceHeader, TraceRound, TraceWriter
from specter.verify import OffloadedExperts, to_host
from specter.victims import UseClock, Victims  # noqa: F401  (UseClock is part of this module's API)

log = get_logger(__name__)
Tensor = torch.Tensor
MAX_DEFERRED_ROUNDS = 64
"""Rounds of copy-busy measurement that may wait for the kernel's idle time before one is finished in line."""


@dataclasses.dataclass(frozen=True)
class Carry:
    """A draft-ahead that can start the next round: its x0 (the guess) at `start`, and its proposals (device)."""

    start: int
    x0: int
    tokens: Tensor


@dataclasses.dataclass
class GenerationResult:
    """The new tokens of one request and its statistics."""

    tokens: list[int]
    stats: RequestStats


class Runtime:
    """One model on one device, serving one request at a time."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model: Transformer, memory: MemoryPlan, backend, kernel: Kernel | None,
                 experts: ExpertProvider, cache: ExpertCache | None, draft: Draft | None, policies: dict, victims: Victims,
                 steps: TargetSteps) -> None:
        """Made by `specter.build.build_runtime` (through `load` or `build`), every part already built; `victims` is
        the cache's victim chooser, whose policy is `policies["eviction"]`."""
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
        self.overlap = config.draft.overlap_steps(model.device.type, config.cuda_graphs)
        self._carry: Carry | None = None  # the last verify's draft-ahead, if it can start the next round
        self._carried = 0  # draft steps this round took from a carry (read by _finish_round)
        self._ahead_this_round = False  # this round drafted a guess and ahead (read by _finish_round)
        self._ahead_stream: Any = None  # the draft-ahead's CUDA stream, made on first use
        self._ahead_done: Any = None  # the end of the draft-ahead enqueued beside this round's verify
        self._ahead_tokens: Tensor | None = None  # [33] device buffer the draft-ahead writes its proposals into
        self._ahead_counts: Tensor | None = None  # [33, L, E] the route counters after each of its steps
        self._kept_counts: Tensor | None = None  # [L, E] the round's own route counters, kept before a draft-ahead resets them
        self._counts_kept = False  # this round's window recall reads _kept_counts
        self.estimates = Estimates(self.k_max)
        self.trace: TraceWriter | None = None
        self._trace_checkpoints: list[tuple[int, np.ndarray]] = []  # the round's plans' counts, for a trace
        self.stages = StageCounters()  # per-stage counts and host wall time (draft, verify), see specter.kernel.stage
        self._counts_host: list[Tensor] = []  # pinned snapshots of the draft's route counters, one per checkpoint (CUDA)
        self._generator: torch.Generator | None = None  # rejection sampling, re-seeded every round
        self._closed = False
        self._round_bytes_at_start = 0  # H2D bytes loaded before this round (the round's bytes for the estimates)
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
        new_tokens = min(new_tokens, self.config.max_context - max(len(p) for p in prompts))
        await calibrate.calibrate(lambda p: greedy_decode(self.model, recorder, p, new_tokens, kv=self.kv), recorder, prompts)
        self._end_request()
        layers = {}
        for layer in spec.moe_layers:
            inputs, choices = recorder.layer(layer)
            flats = [self._full_expert(layer, e) for e in range(spec.num_experts)]
            layers[layer] = calibrate.gptq_layer(flats, inputs, choices, spec.hidden_size, spec.expert_intermediate, self.config.draft)
            layers[layer] = layers[layer].to(self.model.device)
        self.draft = make_draft(self.model, DraftExperts(layers, spec.num_layers, spec.num_experts, self.model.device), self.config)
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

    async def aclose(self) -> None:
        self._closed = True
        self._finish_deferred()  # reads events of chunks the cache and its transfer engine still hold
        if self.cache is not None:
            await self.cache.aclose()
            await self.cache.transfer.aclose()
        if self.kernel is not None:
            self.kernel.close()
        if self.backend is not None:
            self.backend.close()
        if self.trace is not None:
            self.trace.close()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def retune(self, tuning: TuningConfig) -> None:
        """Take `tuning` from the next request on: the cache, transfer and verify knobs are read at run time (A/B
        runs flip them between the requests of one process). The kernels' are fixed when the graphs are captured."""
        if tuning.kernels != self.config.tuning.kernels:
            raise ConfigError("tuning.kernels is fixed when the runtime is built (its CUDA graphs are captured then); "
                              "build another runtime to change it")
        self.config = self.config.model_copy(update={"tuning": tuning})
        if self.cache is not None:
            self.cache.tuning, self.cache.transfer.tuning = tuning.cache, tuning.transfer
        if isinstance(self.experts, OffloadedExperts):
            self.experts.tuning = tuning.verify

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

    def record_trace(self, path: str | Path) -> None:
        """Write a routing trace (see specter.trace) of every speculative round from now on."""
        check_output_file(path, "trace path")  # a clear ConfigError instead of an OSError from open()
        header = TraceHeader(model=self.spec.family, num_layers=len(self.spec.moe_layers), num_experts=self.spec.num_experts,
                             expert_bytes=self.memory.expert_bytes, top_k=self.spec.top_k, slots_per_layer=self.memory.slots_per_layer)
        self.trace = TraceWriter(path, header)

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
            if self.cache is not None:
                fence = self.backend.record_event(self.backend.compute_stream)
                self.cache.transfer.chunk_log = None
                self.cache.unprotect_all(fence)
        finally:  # whatever the cache raised, the rest still runs
            self.plan = None
            self._carry = None
            self._join_ahead()
            self.kv.reset()
            self._finish_deferred()  # last: whatever it meets, the engine is consistent already

    async def _generate(self, prompt: list[int], generation: GenerationConfig, stats: RequestStats) -> AsyncIterator[list[int]]:
        params = SamplingParams(generation.temperature, generation.top_k, generation.top_p, generation.seed)
        stats.prompt_tokens = len(prompt)
        stats.h2d_bytes_at_start = self._bytes_loaded()
        started = time.perf_counter()
        first = await self._prefill(prompt, params, stats)
        stats.ttft_s = time.perf_counter() - started
        stats.h2d_prefill_bytes = self._bytes_loaded() - stats.h2d_bytes_at_start
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
        self._carry = None
        tokens = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
        record = self._start_record()
        hidden = await self.model.forward(tokens, 0, self.kv, self.experts)
        self.kv.crop(len(prompt))
        logits = self.model.logits(hidden[-1:])
        token = sample(logits, torch.tensor([len(prompt)], device=logits.device), params)
        first = int((await to_host(self.kernel, token))[0])
        self._account(record, stats)  # after the host read: the device-side waits have completed
        return first

    # ---- one decode round (DESIGN section 1) ------------------------------------------------------
    async def round(self, x0: int, params: SamplingParams, remaining: int, stats: RequestStats) -> list[int]:
        """Draft, prefetch, verify, accept, commit, adapt. Returns the committed tokens (1..k+1).

        The draft and the transfer stage are tasks of one task group: at each prefetch checkpoint the draft
        snapshots its route counters (an async D2H copy) and goes on enqueuing steps, while the transfer
        stage waits for the GPU to pass that point, plans, and issues copies. Leaving the group (normally,
        by error or by cancellation) leaves no stage running.
        """
        start = self.kv.length  # position of x0
        k = self._next_k(remaining)
        ahead = self._ahead_steps(start, k, remaining, params)  # draft-ahead steps beside this verify (0: none)
        steps = k + 1 if ahead else k  # with a draft-ahead the draft also guesses the target's own next token
        prefix = self._take_carry(x0, start, steps)
        self._counts_kept = False
        round_started = time.perf_counter()
        self._round_bytes_at_start = self._bytes_loaded()
        self._trace_checkpoints = []
        x0_tensor = self._device_ids([x0])
        marks = [self._gpu_mark()]  # GPU-timeline marks: host wall time misses work graph replays leave queued
        chunks = self._log_chunks()
        drafted, draft_logits = None, None
        scouted = not k and self._scouting()
        if k or scouted:
            async with stage("draft", counters=self.stages, k=k):
                # a scout is a draft of one step whose token is dropped: its routes for x0 plan the prefetch
                drafted, draft_logits = await self._draft_and_transfer(x0_tensor, start, steps or 1, params, prefix)
            if scouted:
                drafted, draft_logits = None, None
        guess = None
        if ahead:  # d_{k+1}: not verified, the first token of the draft-ahead; its routes are the verify's last row's
            drafted, guess = drafted[:k], drafted[k:]
            self._kept_counts.copy_(self.draft.route_counts)  # the draft-ahead resets them; the window recall reads these
            self._counts_kept = True
        draft_s = time.perf_counter() - round_started
        marks.append(self._gpu_mark())
        window = [marks[1] if marks[1] is not None else self._stream_mark()]  # the verify, for the copy-busy measurement
        block = torch.cat([x0_tensor, drafted]) if k else x0_tensor
        record = self._start_record()
        if record is not None:  # the segmented verify leads each layer's routing with these (VerifyTuning.lead_misses)
            self.experts.predicted = self._predicted() if self.segmented is not None and self.experts.tuning.lead_misses > 0 else None
        verify_started = time.perf_counter()
        try:
            async with stage("verify", counters=self.stages, rows=k + 1):
                if ahead:
                    logits = await self._verify_beside_draft(block, start, guess, ahead, params)
                else:
                    logits = await self._verify(block, start)  # [k+1, V]
                marks.append(self._gpu_mark())
                window.append(marks[2] if marks[2] is not None else self._stream_mark())
                acceptance, guessed = await self._accept(block[1:], logits, draft_logits, start, params, guess)
                if record is not None:
                    record.settle()  # the verdict has been read: the verify's device-side waits are complete
        finally:
            self._join_ahead()
        verify_s = time.perf_counter() - verify_started
        if marks[0] is not None:  # the verdict has been awaited, so every mark has completed: no stall
            draft_s, verify_s = marks[1].elapsed_since(marks[0]), marks[2].elapsed_since(marks[1])
        if chunks is not None:
            self._copy_busy(chunks, window, record, stats)
        self.kv.crop(start + acceptance.n_accepted + 1)
        if ahead:
            stats.ahead_rounds += 1
            stats.ahead_steps += ahead
            if acceptance.n_accepted == k and acceptance.tokens[-1] == guessed:  # the guess is the next round's x0
                self._carry = Carry(start=start + k + 1, x0=guessed, tokens=self._ahead_tokens[:ahead])
        if prefix is not None:
            stats.carried_rounds += 1
            stats.carried_steps += prefix.shape[0]
        self._carried = 0 if prefix is None else prefix.shape[0]
        self._ahead_this_round = bool(ahead)
        self._finish_round(k, acceptance, record, stats, draft_s, verify_s, time.perf_counter() - round_started, scouted)
        return acceptance.tokens

    # ---- draft-ahead beside the verify (DraftConfig.overlap, issue 4 item 8) ---------------------------------
    def _ahead_steps(self, start: int, k: int, remaining: int, params: SamplingParams) -> int:
        """Draft-ahead steps beside this round's verify: 0 when off, when the round does not speculate, for
        rejection sampling (the next round would need the steps' logits), for an eager draft on CUDA (no second
        stream for it), and when nothing would be left to draft after this round."""
        if not self.overlap or not k or self.draft is None:
            return 0
        if self._ahead_tokens is None:  # the draft-ahead's buffers, made once (a few KiB)
            counts = self.draft.route_counts
            self._ahead_tokens = torch.zeros(33, dtype=torch.long, device=self.model.device)
            self._ahead_counts = torch.zeros((33, *counts.shape), dtype=counts.dtype, device=counts.device)
            self._kept_counts = torch.zeros_like(counts)
        if params.temperature > 0 and self.config.draft.sampling == "rejection":
            return 0
        if self.model.device.type == "cuda" and not self.draft.static:
            return 0
        after = remaining - (k + 1)  # tokens left once this round commits all it can; the next round drafts after - 1
        room = self.kv.capacity - (start + k + 1)  # KV positions from the guess on
        return max(0, min(self.overlap, k + 1, after - 1, room))

    def _take_carry(self, x0: int, start: int, steps: int) -> Tensor | None:
        """The last draft-ahead's proposals as this round's first draft steps, if it started from this very
        token and position (always dropped afterwards)."""
        carry, self._carry = self._carry, None
        if carry is None or not steps or carry.x0 != x0 or carry.start != start:
            return None
        taken = min(carry.tokens.shape[0], steps)
        if taken < carry.tokens.shape[0]:  # the counters hold every step it ran: keep the routes of those taken
            self.draft.route_counts.copy_(self._ahead_counts[taken - 1])
        return carry.tokens[:taken]

    async def _verify_beside_draft(self, block: Tensor, start: int, guess: Tensor, steps: int, params: SamplingParams) -> Tensor:
        """The verify and the draft-ahead as one task group: `steps` draft steps from the guess at position
        start + k + 1 (beyond every position the verify writes), on a second stream on CUDA."""
        cuda = self.model.device.type == "cuda" and self.draft.static
        if cuda and self._ahead_stream is None:
            self._ahead_stream = self.backend.new_stream("draft-ahead")
        after = self.backend.record_event(self.backend.compute_stream) if cuda else None
        out = self._ahead_tokens[:steps]
        try:
            with _single_failure():
                async with asyncio.TaskGroup() as group:
                    verify = group.create_task(self._verify(block, start), name="specter-verify")
                    group.create_task(self.draft.extend(guess, start + block.shape[0], out, self._ahead_counts[:steps], self.kv,
                                                        params, self._ahead_stream if cuda else None, after, self.backend),
                                      name="specter-draft-ahead")
        finally:
            if cuda:  # whatever was enqueued there, the compute stream's later work comes after it
                self._ahead_done = self.backend.record_event(self._ahead_stream)
        return verify.result()

    def _join_ahead(self) -> None:
        """Order the compute stream after the draft-ahead (no host wait): the next draft reuses its buffers."""
        if self._ahead_done is not None:
            self.backend.stream_wait(self.backend.compute_stream, self._ahead_done)
            self._ahead_done = None

    def _scouting(self) -> bool:
        return self.scout and self.draft is not None and self.cache is not None

    async def _draft_and_transfer(self, x0: Tensor, start: int, k: int, params: SamplingParams,
                                  prefix: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The draft and transfer stages as one task group; a single failure surfaces as itself, not a group."""
        with _single_failure():
            async with asyncio.TaskGroup() as stages:
                checkpoints: asyncio.Queue[tuple[int, Tensor, Any] | None] = asyncio.Queue()
                stages.create_task(self._transfer_stage(checkpoints, k), name="specter-transfer-stage")
                drafted = await stages.create_task(self._draft(x0, start, k, params, checkpoints, prefix), name="specter-draft-stage")
                checkpoints.put_nowait(None)
        return drafted

    async def _verify(self, block: Tensor, start: int) -> Tensor:
        """The target over [x0, d1..dk] at positions start..start+k: logits [k+1, V]."""
        if self.segmented is not None:  # offloaded, static_verify: the resident graph's numerics, experts hot first
            return await self.experts.verify_static(self.segmented, block, start)
        if self.graphed is not None:  # resident on CUDA: one R-row graph serves k = 0 and every verify
            return self.graphed.logits(block, start)
        hidden = await self.model.forward(block, start, self.kv, self.experts)
        return self.model.logits(hidden)

    def _next_k(self, remaining: int) -> int:
        if self.draft is None:
            return 0
        k = self.lookahead.next_k(self._lookahead_state())
        return max(0, min(k, self.k_max, remaining - 1))

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
        if self.trace is not None:
            self._trace_checkpoints.append((steps_done, counts.copy()))
        self.plan = self.prefetch.plan(route_counts=counts, resident=self._residency(), steps_done=steps_done, k=k,
                                       timing=self._timing(), slots_per_layer=self.memory.slots_per_layer)
        for layer in range(len(self.spec.moe_layers)):
            planned = self.plan.for_layer(layer)
            self.cache.protect(layer, planned, replace=True)
            self.cache.prefetch(layer, planned)

    async def _accept(self, drafts: Tensor, logits: Tensor, draft_logits: Tensor | None, start: int,
                      params: SamplingParams, guess: Tensor | None = None) -> tuple[Acceptance, int | None]:
        """The verdict, and the draft-ahead's guess (host) in the same copy when there is one."""
        positions = torch.arange(start + 1, start + 2 + drafts.shape[0], device=logits.device)
        if params.greedy:
            verdict = greedy_verdict(drafts, logits)
        elif draft_logits is not None:
            generator = self._rejection_generator(logits.device).manual_seed(params.seed * 1_000_003 + start)
            verdict = rejection_verdict(drafts, probs(draft_logits, params), probs(logits, params), generator)
        else:
            verdict = coupled_verdict(drafts, logits, positions, params)
        if guess is not None:
            verdict = torch.cat([verdict, guess.to(verdict.dtype)])
        host = await to_host(self.kernel, verdict)  # await point: the round's one host sync for acceptance
        if guess is not None:
            return read_verdict(torch.tensor(host[:-1])), host[-1]
        return read_verdict(torch.tensor(host)), None

    def _log_chunks(self) -> list | None:
        """Start logging the round's chunks for the copy-busy measurement (offloaded runtimes only)."""
        return None if self.cache is None else self.cache.transfer.start_chunk_log()

    def _finish_deferred(self) -> None:
        if self.kernel is not None:
            self.kernel.run_deferred()

    def _stream_mark(self):
        """Off CUDA: a timed event on the backend's compute stream (idle there, so it completes at about
        once), giving the copy-busy window a start and an end on the copy stream's clock."""
        return None if self.cache is None else self.backend.record_event(self.backend.compute_stream, timed=True)

    def _copy_busy(self, chunks: list, window: list, record, stats: RequestStats) -> None:
        """Copy-stream busy time inside this round's verify window, if the verify stalled on a copy.

        The window runs from the verify's start to the end of the last chunk that started before the
        verify ended (capped at the verify's end). Reading the chunks' events costs a few microseconds each
        (H200 trace: 42 % of the GPU-idle time in round-boundary gaps of 1 ms or more), so the reading is
        deferred to the kernel's idle work (`Kernel.defer`: it runs while a later wait's event is pending)
        and finished when the request ends (`_end_request`). Only the chunk list is taken now. Without a kernel
        the events are read here, and a round whose window marks have not completed is left out.
        """
        transfer = self.cache.transfer
        transfer.chunk_log = None
        if record is None or record.stall_s <= 0 or not chunks:
            return
        if self.kernel is None:
            if all(mark.query() for mark in window):
                for _ in self._copy_busy_work(chunks, window, stats, batch=len(chunks)):
                    pass
            return
        if self.kernel.deferred >= MAX_DEFERRED_ROUNDS:  # waits found no pending events for them: bound the backlog
            self.kernel.run_deferred()
        self.kernel.defer(self._copy_busy_work(list(chunks), window, stats))

    def _copy_busy_work(self, chunks: list, window: list, stats: RequestStats, batch: int = 8) -> Iterator[Any]:
        """The measurement of `_copy_busy`, a few chunks per step (NOT_READY until the window's marks complete)."""
        while not all(mark.query() for mark in window):
            yield NOT_READY
        origin = window[0]
        verify_end = window[1].elapsed_since(origin)
        times = []
        for first in range(0, len(chunks), batch):
            times += self.cache.transfer.chunk_times(chunks[first : first + batch], origin, open_end=verify_end)
            yield None
        span = min(max((t.end for t in times if t.start < verify_end), default=0.0), verify_end)
        if span > 0:
            stats.copy_busy_s += busy_within([(t.start, t.end) for t in times], 0.0, span)
            stats.copy_window_s += span
            if self.cache.transfer.issue_marks:  # (without the marks there is nothing to split)
                causes = idle_causes(times, span)
                if causes is not None:  # (the pump trace covers the same windows as the split)
                    for cause, seconds in causes.items():
                        stats.copy_idle_s[cause] = stats.copy_idle_s.get(cause, 0.0) + seconds
                    stats.pump_gaps += pump_gaps(times, span)

    def _gpu_mark(self):
        """A timed event on the compute stream (CUDA only; None elsewhere, where host wall time is exact)."""
        if self.model.device.type != "cuda":
            return None
        return self.backend.record_event(self.backend.compute_stream, timed=True)

    def _device_ids(self, ids: list[int]) -> Tensor:
        """Token ids to the device without a blocking copy (pinned source, non-blocking on CUDA)."""
        host = torch.tensor(ids, dtype=torch.long)
        if self.model.device.type == "cuda":
            return host.pin_memory().to(self.model.device, non_blocking=True)
        return host

    def _rejection_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator

    def _finish_round(self, k: int, acceptance: Acceptance, record, stats: RequestStats, draft_s: float, verify_s: float,
                      round_s: float, scouted: bool = False) -> None:
        stats.rounds += 1
        self._account(record, stats)
        if k:
            stats.drafted += k
            stats.accepted += acceptance.n_accepted
            stats.accepted_lengths[acceptance.n_accepted] += 1
            self._observe_recall(record, stats, k, acceptance)
        if scouted:  # the scout's time is the plain rounds' own (LookaheadState.scout_s), not a depth-1 draft
            stats.scouted += 1
            self._observe_scout_recall(record, stats)
            self.estimates.observe_scout(draft_s)
        if self.cache is not None:
            self.cache.unprotect_all(self.backend.record_event(self.backend.compute_stream))
        self.plan = None
        self.estimates.observe_acceptance(k, acceptance.n_accepted)
        # With a draft-ahead the verify's time includes the steps drafted beside it, and a round that took
        # steps over drafted only the rest: its real draft time goes into the fit (not charging them twice).
        self.estimates.observe_draft(k, draft_s, steps=self._draft_steps_run(k))
        self.estimates.observe_round(k, round_s, draft_s, verify_s)
        rows = k + 1
        if record is not None and k:
            self.estimates.observe_union(rows, sum(record.first_row.values()), sum(len(used) for used in record.used.values()))
        self.estimates.observe_verify(rows, max(0.0, verify_s - (record.stall_s if record else 0.0)),
                                      self._bytes_loaded() - self._round_bytes_at_start)
        committed = acceptance.n_accepted + 1
        self.lookahead.observe(outcome=RoundOutcome(k=k, accepted=acceptance.n_accepted, tpot_s=round_s / committed, round_s=round_s))

    def _draft_steps_run(self, k: int) -> int:
        """Draft steps this round ran itself: k, one more with a draft-ahead (the guess), less those taken over."""
        if not k:
            return 0
        return k + (1 if self._ahead_this_round else 0) - self._carried

    def _draft_predictions(self, record) -> tuple[np.ndarray, list[tuple[int, set[int], list[int]]]]:
        """The draft's route counters [L_moe, E] and, per layer the verify used: (compact layer, named, used)."""
        counts = self._kept_counts if self._counts_kept else self.draft.route_counts  # a draft-ahead resets the latter
        counts = counts[self.spec.moe_layers].cpu().numpy()  # after verify: no stall added
        return counts, [(self.moe_index[layer], set(np.flatnonzero(counts[self.moe_index[layer]]).tolist()), used)
                        for layer, used in record.used.items()]

    def _observe_recall(self, record, stats: RequestStats, k: int, acceptance: Acceptance) -> None:
        if record is None or self.draft is None:
            return
        counts, predictions = self._draft_predictions(record)
        for compact, predicted, used in predictions:
            stats.add_recall(compact, predicted, used)
        if self.trace is not None:
            used = [record.used.get(layer, []) for layer in self.spec.moe_layers]
            self.trace.write_round(TraceRound.from_arrays(stats.rounds, k, acceptance.n_accepted,
                                                          self.estimates.draft_step_s or 0.0, counts, used,
                                                          loaded_bytes=self._bytes_loaded() - self._round_bytes_at_start,
                                                          checkpoints=self._trace_checkpoints))

    def _observe_scout_recall(self, record, stats: RequestStats) -> None:
        """A scout's recall, kept apart from the window's (one step ahead of its own token; no trace round)."""
        if record is None or self.draft is None:
            return
        for _compact, predicted, used in self._draft_predictions(record)[1]:
            stats.scout_recall_hits += len(predicted.intersection(used))
            stats.scout_recall_total += len(used)

    def _start_record(self):
        return self.experts.start_record() if isinstance(self.experts, OffloadedExperts) else None

    def _account(self, record, stats: RequestStats) -> None:
        if record is None:
            return
        record.settle()  # device-side waits into stall_s (idempotent)
        stats.hits += record.hits
        stats.misses += record.misses
        stats.stall_s += record.stall_s
        for layer, used in record.used.items():
            self.uses.used(self.moe_index[layer], used)
        stats.h2d_bytes = self._bytes_loaded() - stats.h2d_bytes_at_start

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
        return LinkTiming(bandwidth_bytes_per_s=self.bandwidth(), draft_step_s=self.estimates.draft_step_s or 1e-3,
                          expert_bytes=self.memory.expert_bytes)

    def _lookahead_state(self) -> LookaheadState:
        return LookaheadState(
            acceptance_by_position=self.estimates.measured_acceptance(self.k_max),
            draft_step_s_fit=self.estimates.draft_fit(),
            verify_s_fit=self.estimates.verify_fit(),
            bandwidth_bytes_per_s=self.bandwidth(),
            predicted_new_bytes=self.estimates.predicted_new_bytes(self.k_max),
            k_max=self.k_max,
            model_key=f"{self.spec.family}:{self.spec.hidden_size}x{self.spec.num_layers}:{self.memory.slots_per_layer}",
            round_overhead_s=self.estimates.overheads(),
            scout_s=(self.estimates.scout_s or sum(self.estimates.draft_fit())) if self._scouting() else 0.0,
        )


@contextlib.contextmanager
def _single_failure() -> Iterator[None]:
    """A task group's one failure surfaces as itself (e.g. a PluginError from a policy, as the user should see
    it), not wrapped in a group; several stay a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def _until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop:
            return tokens[: index + 1]
    return tokens
