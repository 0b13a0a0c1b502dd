"""Building a runtime from its parts: device and dtype, plug-ins and backend, the memory plan, the weights into the
device or the host pool, the draft, the expert cache and its transfer engine, the target's steps. Every part is
made before the part that uses it and handed to its constructor; nothing is patched in afterwards (the bench swaps
whole parts between cells: a new cache over the same pool, another link).

Every expert is streamed once: into device memory when all fit, otherwise into the pinned host pool behind an
expert cache; in both cases also into the draft's quantizer. `load_resident` is the simplest path (every weight
on the device, no runtime), for tests and parity checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from specter import plugins
from specter.config import EngineConfig
from specter.draft import DraftExperts, quantize_layers
from specter.errors import BudgetError, CheckpointError, ConfigError, MemoryShortError, PluginError
from specter.experts.cache import CacheSnapshot, ExpertCache
from specter.experts.costs import HostKernel, calibrate, default_cost_store, host_kernels, routing_profile
from specter.experts.host import HostExperts
from specter.experts.host import default_threads as host_default_threads
from specter.experts.pool import ExpertPool
from specter.experts.transfer import LinkEmulation, TransferEngine, parse_link
from specter.kernel import Kernel
from specter.log import get_logger
from specter.memory import MemoryPlan, available_host_bytes, fmt, plan_memory, with_model_context
from specter.model.checkpoint import Checkpoint
from specter.model.graphed import GraphedTarget
from specter.model.kv import KVCache
from specter.model.registry import transformer_for
from specter.model.resident import ResidentExperts
from specter.model.segmented import SegmentedStep
from specter.model.spec import ModelSpec
from specter.model.transformer import ExpertProvider, Transformer
from specter.model.weights import check_checkpoint, check_no_unknown_experts, iter_experts, load_dense
from specter.placement import (
    OVERLAP,
    Placement,
    PlacementState,
    PricingError,
    copy_seconds,
    decision_record,
    has_rounds,
    host_seconds,
    prefill_placement,
    preloaded,
)
from specter.steps import graphed_target, make_draft, segmented_step, segmented_verify
from specter.verify import OffloadedExperts
from specter.victims import Victims

log = get_logger(__name__)
Tensor = torch.Tensor
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LARGE_CHECKPOINT_BYTES = 1 << 30
OFF = "off"
"""EngineConfig.cpu_experts of an engine without host experts (policies/placement.py's `Off` says the same)."""  # above this, loading shows progress on a terminal even when not asked


# ---- where weights come from ----------------------------------------------------------------------------

class WeightSource(Protocol):
    """Where a runtime's weights come from: a checkpoint directory, or synthetic weights made in memory."""

    spec: ModelSpec

    def validate(self) -> None:
        """Raise CheckpointError for problems detectable before loading: called before the memory plan, which is sized
        by the spec's numbers (a config.json claiming 10 million layers must be refused by the files, not planned)."""

    def dense(self, dtype: torch.dtype, device: torch.device, progress: bool) -> dict[str, Tensor]:
        """Every non-expert tensor by on-disk name, on the device."""

    def experts(self, dtype: torch.dtype, progress: bool) -> Iterator[tuple[int, int, Tensor]]:
        """(layer, expert, packed flat tensor) for every routed expert, layer by layer: on the CPU, or on the engine's
        device where the source makes it there (a WidenedCheckpoint widening on CUDA); the pool and the draft's quantizer
        take either."""

    def close(self) -> None: ...


class CheckpointWeights:
    """A WeightSource reading a Hugging Face checkpoint directory."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt, self.spec = ckpt, ckpt.spec
        on_disk = sum(file.stat().st_size for file in ckpt.files if file.is_file())
        self.auto_progress = on_disk > LARGE_CHECKPOINT_BYTES and sys.stderr.isatty()

    def validate(self) -> None:
        """What `specter info` checks, from the safetensors headers (`check_checkpoint`: every tensor present, of its
        shape and a float dtype, no expert beyond the count), so a load refuses with the same message, in seconds. A
        stand-in for a Checkpoint (the bench's WidenedCheckpoint, which reads no headers) gets the unknown-expert check."""
        if isinstance(self.ckpt, Checkpoint):
            check_checkpoint(self.ckpt)
        else:
            check_no_unknown_experts(self.ckpt)

    def dense(self, dtype: torch.dtype, device: torch.device, progress: bool) -> dict[str, Tensor]:
        return load_dense(self.ckpt, dtype, device, progress=progress or self.auto_progress)

    def experts(self, dtype: torch.dtype, progress: bool) -> Iterator[tuple[int, int, Tensor]]:
        return iter_experts(self.ckpt, dtype, progress=progress or self.auto_progress)

    def close(self) -> None:
        self.ckpt.close()


# ---- device, dtype, plug-ins, backend, threads ----------------------------------------------------------

def resolve_device(config: EngineConfig) -> torch.device:
    """'auto' is CUDA when present; asking for CUDA on a machine without it is a configuration error."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"EngineConfig.device = {config.device!r}: CUDA is not available on this machine; use device='cpu' or 'auto'")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, spec: ModelSpec) -> torch.dtype:
    """EngineConfig.dtype, or with 'auto' the checkpoint's (spec.dtype: config.json's, else its tensors'). A declared
    dtype the engine does not compute in (float8_e4m3fn, say) is refused rather than guessed: its weights are not the
    float32/16 or bfloat16 the loader reads, or the config is wrong, and one --dtype settles either."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if spec.dtype not in _DTYPES:
        raise CheckpointError(f"config.json declares dtype {spec.dtype!r} (its 'torch_dtype' or 'dtype' field), which Specter does not "
                              f"compute in; supported: {', '.join(sorted(_DTYPES))}; pass --dtype (EngineConfig.dtype) to choose one")
    return _DTYPES[spec.dtype]


def drafts_rounds(lookahead: str, k: int) -> bool:
    """Whether a lookahead policy and depth draft rounds of k > 0: all but the depth fixed at 0."""
    return not (lookahead == "fixed" and k == 0)


def keeps_expert_graphs(config: EngineConfig, spec: ModelSpec, device: torch.device) -> bool:
    """Whether the offloaded verify keeps one expert graph per cache slot (`plan_memory`'s `expert_graphs`): the
    family's segmented verify under CUDA graphs. `specter info` plans with it too, so it reports the engine's slots."""
    return bool(device.type == "cuda" and config.cuda_graphs and segmented_verify(config, device.type, transformer_for(spec)))


def scout_only(config: EngineConfig) -> bool:
    """The draft would serve only the scout: the depth is fixed at 0."""
    return not drafts_rounds(config.lookahead, config.draft.k)


def may_speculate(config: EngineConfig) -> bool:
    """Whether the engine builds a draft: it may draft (k_max > 0) and some round will (a depth above 0, or a scout)."""
    offloaded = config.budget is not None or config.residents is not None  # a scout has nothing to prefetch otherwise
    plain_only = scout_only(config) and not (config.draft.scout and offloaded)
    return config.draft.k_max > 0 and not plain_only


def load_policies(config: EngineConfig) -> dict:
    """Load every plug-in by name before allocating anything, so a typo fails fast and costs nothing."""
    lookahead_options = {"k": config.draft.k} if config.lookahead == "fixed" else {}
    return {
        "eviction": plugins.load_policy("eviction", config.eviction),
        "prefetch": plugins.load_policy("prefetch", config.prefetch),
        "lookahead": plugins.load_policy("lookahead", config.lookahead, **lookahead_options),
        "placement": placement_policy(config),
    }


def placement_policy(config: EngineConfig):
    """The `specter.placement` plug-in named by EngineConfig.cpu_experts; None for 'off', which needs none: no expert
    takes the host path and the engine runs without a placement (no plug-in, no host thread, no cost).
    EngineConfig.placement_overlap, when set, is the plug-in's `overlap` keyword."""
    if config.cpu_experts == OFF:
        return None
    if config.placement_overlap is None:
        return plugins.load_policy("placement", config.cpu_experts)
    hint = (f"placement_overlap (--placement-overlap) is an option of a cost-model placement such as 'auto'; leave it "
            f"unset with cpu_experts {config.cpu_experts!r}")
    try:
        policy = plugins.load_policy("placement", config.cpu_experts, overlap=config.placement_overlap)
    except PluginError as error:
        if not isinstance(error.__cause__, TypeError):  # (unknown or refused names say so themselves)
            raise
        raise PluginError(f"{error}. {hint}") from error
    if getattr(policy, "overlap", None) != config.placement_overlap:  # taken by **options and dropped, say
        raise PluginError(f"placement plug-in {config.cpu_experts!r} was given overlap={config.placement_overlap} and "
                          f"does not keep it as its `overlap` (as 'auto' does); {hint}")
    return policy


def load_backend(config: EngineConfig, device: torch.device):
    name = device.type if config.backend == "auto" else config.backend
    if name == "cpu":
        return plugins.load_backend("cpu", link_gbps=parse_link(config.link))
    return plugins.load_backend(name, device=device.index or 0)


def check_device_memory(config: EngineConfig, device: torch.device, memory: MemoryPlan) -> None:
    """Refuse, before allocating, a plan the machine cannot hold: a budget above the GPU's free memory, or (without
    a budget) the plan's device bytes above what is free there; on the CPU, budget or not, the plan's device bytes
    plus the host pool above the host's available memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if config.budget is not None and config.budget > free:
            raise BudgetError(f"budget {fmt(config.budget)} is more than the GPU's free memory {fmt(free)}; lower budget (--budget)")
        needed, where = memory.device_bytes, "the GPU's free memory"
    else:
        free = available_host_bytes()
        needed, where = memory.device_bytes + memory.host_pool_bytes, "the host's available memory"
        if config.budget is not None and needed > free:  # on the CPU the budget's part is host memory as well
            raise MemoryShortError(
                f"this configuration needs about {fmt(needed)} and {where} is {fmt(free)}: the budget's device part "
                f"{fmt(memory.device_bytes)} and the experts' host copy {fmt(memory.host_pool_bytes)}",
                "lower budget (--budget), or run on a machine with more memory (the experts' host copy does not shrink with the "
                "budget)")
    if config.budget is None and needed > free:
        if device.type == "cpu":  # the cache's slots and the experts' host copy are both host memory: offloading adds
            instead = "run on a machine with more memory"
        else:
            instead = ("lower residents (--residents)" if config.residents is not None
                       else "give residents or budget (--residents, --budget)")
        raise MemoryShortError(
            f"this configuration needs about {fmt(needed)} and {where} is {fmt(free)}: KV for max_context "
            f"{config.max_context} tokens {fmt(memory.kv_bytes)}, workspace {fmt(memory.workspace_bytes)}, non-expert weights "
            f"{fmt(memory.dense_bytes)}, draft {fmt(memory.draft_bytes)}, experts {fmt(needed - memory.fixed_bytes)}",
            f"lower max_context (--max-context; KV and workspace grow with it), or {instead}")


def apply_threads(config: EngineConfig, device: torch.device) -> None:
    """Set torch's intra-op CPU threads (process-wide) to EngineConfig.threads, or to the default for the device."""
    threads = config.threads if config.threads is not None else default_threads(device)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def default_threads(device: torch.device) -> int:
    """EngineConfig.threads=None: see its description for why."""
    if device.type == "cuda":
        return 1  # the host only enqueues work and keeps books
    # Never one thread per core: torch's OpenMP workers spin while they wait, and with one other busy process
    # they fight it for every core, each barrier waiting for a preempted worker's next time slice.
    return max(1, min(4, (os.cpu_count() or 1) // 2))


# ---- the experts ----------------------------------------------------------------------------------------

async def load_experts(source: WeightSource, config: EngineConfig, memory: MemoryPlan, backend, kernel: Kernel, dtype: torch.dtype,
                       device: torch.device, speculative: bool, victims: Victims | None = None):
    """Stream every expert once: into device memory (all resident) or the host pool, and into the draft's quantizer.

    Returns (the verify's expert provider, the expert cache or None, the draft's quantized layers). The cache gets
    `victims` as its victim chooser (none given: it never evicts by choice). Every expert takes the device path: the
    runtime is placed once it is built (`place_runtime`), where it can record its own routing trace first."""
    spec = source.spec
    if memory.all_resident:
        resident = ResidentExperts.from_iter(source.experts(dtype, config.progress), spec.num_experts, device)
        stream = ((layer, e, resident.expert(layer, e)) for layer in spec.moe_layers for e in range(spec.num_experts))
        draft = quantize_layers(stream, spec.hidden_size, spec.expert_intermediate, spec.num_experts, config.draft, device,
                                layers=spec.moe_layers, dtype=dtype) if speculative else {}
        release_stream_blocks(device)
        return resident, None, draft
    pool = ExpertPool(backend, len(spec.moe_layers), spec.num_experts, spec.expert_numel, dtype)
    moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}

    def into_pool():
        for layer, expert, flat in source.experts(dtype, config.progress):
            pool.write(moe_index[layer], expert, flat)
            yield layer, expert, flat

    if speculative:
        draft = quantize_layers(into_pool(), spec.hidden_size, spec.expert_intermediate, spec.num_experts, config.draft, device,
                                layers=spec.moe_layers, dtype=dtype)
    else:
        draft = {}
        for _ in into_pool():
            pass
    release_stream_blocks(device)
    pool.check_complete()
    cache = new_cache(config, memory.layer_slots, backend, kernel, new_transfer(config, backend, kernel, device), pool,
                      victims if victims is not None else (lambda *_: []))
    return OffloadedExperts(cache, kernel, moe_index, tuning=config.tuning.verify), cache, draft


def release_stream_blocks(device: torch.device) -> None:
    """Give the expert stream's temporaries (a layer's stacked flats and their float copies for the draft, a widened
    load's) back to the device before the cache's slots, the KV and the graphs allocate: a long-lived tensor carved
    from a cached block of theirs would pin its whole segment in the reserve, beyond what the plan counts."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def placement_state(cache: ExpertCache, config: EngineConfig, spec: ModelSpec) -> PlacementState:
    """What a placement policy sees of this engine now: its shape, its cache and the costs measured so far."""
    gbps = parse_link(config.link)
    return PlacementState(num_layers=cache.num_layers, num_experts=cache.num_experts, top_k=spec.top_k,
                          slots_per_layer=cache.slots_per_layer, layer_slots=cache.layer_slots, initial_residents=cache.snapshot().layers,
                          expert_bytes=cache.pool.expert_bytes, row_bucket=config.row_bucket,
                          host_threads=config.cpu_threads or host_default_threads(),
                          link_bytes_per_s=gbps * 1e9 if gbps is not None else cache.transfer.bandwidth_bytes_per_s,
                          **speculation(config))


def speculation(config: EngineConfig) -> dict:
    """The `PlacementState` fields of how `config` speculates: whether it drafts rounds of k > 0 (a scout-only or
    plain engine does not) and the eviction and prefetch plug-ins its prefetch runs through."""
    return {"speculates": may_speculate(config) and not scout_only(config), "eviction": config.eviction,
            "prefetch": config.prefetch}


OWN_PROFILE = "the engine's own routing trace, recorded at load (self_profile_tokens)"
"""How the load's messages name the trace a placement priced when the engine recorded it itself."""


def wants_own_profile(policy, state: PlacementState, config: EngineConfig) -> bool:
    """Whether the engine records its own routing trace before `policy` places it (`EngineConfig.self_profile_tokens`):
    only where the policy says it cannot price this engine's misses without a trace's rounds (`prices_misses`: a
    speculating engine, whose draft prefetches), none was given (placement_profile), and both costs a pricing weighs
    are measured (on the CPU without a link nothing could be priced, so decoding for a trace would be wasted)."""
    return (config.placement_profile is None and config.self_profile_tokens > 0 and state.speculates
            and not has_rounds(state) and copy_seconds(state) is not None and host_seconds(state, 1) is not None
            and getattr(policy, "prices_misses", None) is not None and not policy.prices_misses(state))


async def place_runtime(runtime: Any, policy) -> None:
    """Place a built runtime's experts with the `specter.placement` `policy` (None: 'off', which needs nothing), once
    for its life, before its first request: calibrate the costs (`specter.experts.costs`), ask the policy, tell the
    cache, load the device-path experts that fit in their layer's slots, and start the host path (`runtime.experts.host`;
    None when no expert takes it: the engine as without placements). After its draft and graphs exist, so that where
    the policy needs a trace's rounds and none was given (`wants_own_profile`) the runtime first decodes its own
    (`Runtime.own_routing_profile`), which is priced instead. Nothing to place with every expert resident."""
    cache = runtime.cache
    if policy is None or cache is None:
        return
    config, spec, device = runtime.config, runtime.spec, runtime.model.device
    kernels = model_host_kernels(runtime.model, config, cache.pool.dtype)
    state = placement_state(cache, config, spec)
    state = (await calibrate(runtime.kernel, cache.pool, kernels, state, spec.hidden_size, device, config.placement_profile,
                             config.tuning.host.parallel_experts, default_cost_store(), config.recalibrate)).apply(state)
    name, trace = getattr(policy, "name", None), config.placement_profile
    own = wants_own_profile(policy, state, config)
    if own:
        own_trace = await runtime.own_routing_profile()
        log.info("placement.own_profile", tokens=own_trace.tokens, rounds=own_trace.rounds,
                 acceptance=round(own_trace.acceptance, 3), seconds=round(own_trace.seconds, 2))
        state, trace = own_trace.apply(state), OWN_PROFILE
    with pricing_context(f"while the placement plug-in {name!r} priced the routing trace {trace} at load"):
        placement = policy.place(state=state)
    with pricing_context(f"while the engine priced the placement of plug-in {name!r} against the routing trace {trace} "
                         f"at load (its decision record)"):
        decision = decision_record(state, placement, getattr(policy, "prefetch_discount", 0.0), getattr(policy, "overlap", OVERLAP))
    log.info("placement.decided", policy=name, **decision)
    # prices_misses() answers for an engine that speculates without a trace's rounds: anywhere else its "no" is about
    # an engine this is not, and the warning would tell the user to give a trace it has or does not need
    if (state.speculates and not has_rounds(state) and getattr(policy, "prices_misses", None) is not None
            and not policy.prices_misses(state)):
        given = ("no placement_profile was given" if trace is None
                 else f"{OWN_PROFILE} holds no speculative round" if own
                 else f"placement_profile {str(trace)!r} has no rounds")
        log.warning("placement.needs_trace", policy=name, host_experts=placement.total,
                    hint=f"placement plug-in {name!r} says it cannot price a speculating engine's misses without a "
                         f"routing trace with rounds, and this engine speculates and {given}; record one with `specter "
                         "generate --trace PATH` on your own text and give it as placement_profile (--placement-profile "
                         "TRACE)")
    if placement.active:
        runtime.experts.host = await apply_placement(placement, cache, config, device, chosen_kernel(kernels, state), policy,
                                                     state)


@contextlib.contextmanager
def pricing_context(what: str) -> Iterator[None]:
    """An eviction or prefetch plug-in's error inside the cost model's replay of the routing trace (a `PricingError`)
    re-raised with `what` the load was doing then, the plug-in's own error as its cause."""
    try:
        yield
    except PricingError as error:
        raise PluginError(f"{error}, {what}") from error.__cause__


def chosen_kernel(kernels: Sequence[HostKernel], state: PlacementState) -> HostKernel:
    """The kernel of `kernels` the calibration behind `state` chose (`state.host_kernel`; none named: the first)."""
    return next((candidate for candidate in kernels if candidate.name == state.host_kernel), kernels[0])


def model_host_kernels(model: Transformer, config: EngineConfig, dtype: torch.dtype) -> list[HostKernel]:
    """The host kernels a placement's calibration chooses from for `model` (tuning.host.kernel; `costs.host_kernels`):
    the native one only for the families' own SwiGLU (a class that overrides `expert_mlp` keeps torch's)."""
    return host_kernels(config.tuning.host.kernel, model.expert_mlp, model.spec.hidden_size, model.spec.expert_intermediate,
                        dtype, own_expert=brings_own_expert(type(model)))


def brings_own_expert(family: type[Transformer]) -> bool:
    """Whether a model class computes its routed experts its own way (overrides `expert_mlp`): the native host kernel,
    the families' SwiGLU, is then not its function."""
    return family.expert_mlp is not Transformer.expert_mlp


async def apply_placement(placement: Placement, cache: ExpertCache, config: EngineConfig, device: torch.device,
                          host_kernel: HostKernel, policy=None, state: PlacementState | None = None) -> HostExperts:
    """`placement` from now on: the cache skips its host-path experts and holds the device-path ones that fit (loaded
    now, so those layers never copy again); returns the host path that computes the others with `host_kernel`, with
    the thread count the `state` was calibrated at (none: `cpu_threads`). With `policy` and the `state` it placed
    from, each prompt takes the policy's prompt placement (`place_prefill`), else `placement`."""
    cache.place(placement.host)
    await cache.restore(CacheSnapshot(tuple(tuple(experts) for experts in preloaded(placement, cache.layer_slots))))
    log.info("engine.placed", host_experts=placement.total, per_layer=placement.counts())
    prompt = None
    if policy is not None and state is not None:
        prompt = lambda rows: prefill_placement(policy, state, placement, rows)  # noqa: E731
    threads = state.host_threads if state is not None else config.cpu_threads
    return HostExperts(cache.pool, placement, config.row_bucket, host_kernel.mlp, threads, device, prompt=prompt,
                       parallel=config.tuning.host.parallel_experts, row_invariant=host_kernel.row_invariant,
                       job=host_kernel.job)


def new_transfer(config: EngineConfig, backend, kernel: Kernel, device: torch.device) -> TransferEngine:
    gbps = parse_link(config.link)
    link = LinkEmulation(gbps) if gbps is not None and device.type == "cuda" else None
    return TransferEngine(backend, kernel, link=link, tuning=config.tuning.transfer)


def new_cache(config: EngineConfig, slots: int | Sequence[int], backend, kernel: Kernel, transfer: TransferEngine,
              pool: ExpertPool, victims) -> ExpertCache:
    """An expert cache of `slots` per MoE layer (one count for all, or one each) over `pool`, choosing eviction
    victims through `victims`."""
    return ExpertCache(backend, kernel, transfer, pool, slots, choose_victims=victims, tuning=config.tuning.cache)


# ---- the runtime ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class TargetSteps:
    """The target's KV cache and the static steps that run it (None: the eager forward runs it)."""

    kv: KVCache
    graphed: GraphedTarget | None
    segmented: SegmentedStep | None


def target_steps(model: Transformer, experts: ExpertProvider, config: EngineConfig) -> TargetSteps:
    kv = model.new_kv()
    return TargetSteps(kv, graphed_target(model, experts, kv, config), segmented_step(model, experts, kv, config))


def engine_plan(config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> tuple[bool, MemoryPlan]:
    """Whether the engine of `config` (with its model context) builds a draft, and its memory plan (a BudgetError below
    the minimum): what `build_runtime` loads by, and what `unrecorded_rounds` tells a trace from before loading."""
    speculative = may_speculate(config)
    expert_graphs = keeps_expert_graphs(config, spec, device)
    if speculative and scout_only(config) and plan_memory(spec, dtype, config, False, expert_graphs=expert_graphs).all_resident:
        speculative = False  # every expert fits without a draft: a scout would have nothing to prefetch
    return speculative, plan_memory(spec, dtype, config, speculative, expert_graphs=expert_graphs)


def unrecorded_rounds(config: EngineConfig, spec: ModelSpec) -> str | None:
    """Why a routing trace (`Runtime.record_trace`) of the engine `config` loads for `spec` would hold no round, as
    planned before loading; None where it records its rounds. A trace holds the speculative rounds (k > 0) of an
    offloaded engine (observers.TraceRecorder: plain rounds, scouted or not, are not written, and a resident engine
    has no cache to trace), and a trace of none is a header that every replay of it would find vacuous."""
    if config.draft.k_max == 0:
        return "--k-max 0 turns speculation off, and only speculative rounds are recorded; give --k-max N above 0"
    if scout_only(config):
        return (f"--k 0 makes every round plain{' (scouted)' if config.draft.scout else ''}, and only speculative rounds "
                "are recorded; give --k N above 0")
    config = with_model_context(config, spec)
    _speculative, memory = engine_plan(config, spec, resolve_device(config), resolve_dtype(config, spec))
    if not spec.moe_layers:
        return "the model has no MoE layer (every layer is dense), so no round moves an expert and none is recorded"
    if memory.all_resident:
        why = ("no --budget or --residents keeps them all" if config.budget is None and config.residents is None
               else f"{'--residents' if config.residents is not None else '--budget'} holds all {spec.num_experts} per layer")
        return (f"every expert is resident ({why}), so no round moves an expert and none is recorded; give --residents "
                f"N below {spec.num_experts} or a --budget below full residency ({fmt(memory.resident_budget)}) to offload")
    return None


async def build_runtime(cls: type, source: WeightSource, config: EngineConfig | None = None) -> Any:
    """Plan memory (refusing a budget below the minimum before allocating), then load from `source` into a `cls`
    (a Runtime or a subclass), every collaborator made first and passed to its constructor."""
    spec = source.spec
    config = with_model_context(config or EngineConfig(), spec)  # max_context=None becomes a number here
    device, dtype = resolve_device(config), resolve_dtype(config, spec)
    policies = load_policies(config)
    # The files before anything sized by config.json's numbers (the plan, the profile's shape): they refuse a claim they
    # do not hold (10 million layers planned for minutes before the first missing tensor was named).
    source.validate()
    if config.placement_profile is not None:  # with `off` too, which reads no more of it: another model's trace is a mistake
        routing_profile(config.placement_profile, spec.num_moe_layers, spec.num_experts)  # parsed once: calibrate reads it
    speculative, memory = engine_plan(config, spec, device, dtype)
    calibrated = speculative and config.draft.quant == "gptq4"
    check_device_memory(config, device, memory)
    if policies["placement"] is not None and config.tuning.host.kernel == "native" and not memory.all_resident:
        # refused before any expert is read, not at placement time after all of them (the same check, `host_kernels`)
        family = transformer_for(spec)
        host_kernels("native", family.expert_mlp, spec.hidden_size, spec.expert_intermediate, dtype,
                     own_expert=brings_own_expert(family))
    backend = load_backend(config, device)
    kernel: Kernel | None = None
    runtime = None
    experts = None
    try:
        apply_threads(config, device)  # process-wide, so only once the checkpoint and the backend are known to load
        kernel = Kernel(backend, config.tuning.wait)
        dense = source.dense(dtype, device, config.progress)
        model = transformer_for(spec)(spec, dense, exact=config.exact, row_bucket=config.row_bucket, max_context=config.max_context,
                                      kernels=config.tuning.kernels)
        quantize_now = speculative and not calibrated
        victims = Victims(policies["eviction"], len(spec.moe_layers))
        experts, cache, draft_layers = await load_experts(source, config, memory, backend, kernel, dtype, device, quantize_now, victims)
        source.close()
        draft = make_draft(model, DraftExperts(draft_layers, spec.num_layers, spec.num_experts, device, tiles=config.tuning.kernels.moe),
                           config) if quantize_now else None
        runtime = cls(config, spec, model, memory, backend, kernel, experts, cache, draft, policies, victims,
                      target_steps(model, experts, config))
        runtime.capture_graphs()
        if calibrated:
            loaded = cache.snapshot() if cache is not None else None
            await runtime.calibrate_draft()
            # its decoding filled the cache and measured the link: the placement starts from the engine as loaded
            await runtime.forget_decoding(loaded)
        await place_runtime(runtime, policies["placement"])
    except BaseException:  # a failed build (a bad tensor, a refused pool, a graph capture) leaves no thread or handle
        source.close()
        if runtime is not None:
            await runtime.aclose()
        else:
            if isinstance(experts, OffloadedExperts):
                experts.close()  # its host thread
            if kernel is not None:
                kernel.close()
            backend.close()
        raise
    log.info("engine.loaded", family=spec.family, device=str(device), slots_per_layer=memory.slots_per_layer,
             extra_slots=memory.extra_slots, experts=spec.num_experts, speculative=speculative)
    return runtime


# ---- the simplest path: every weight on the device ------------------------------------------------------

@dataclasses.dataclass
class LoadedModel:
    """A target model ready to run: spec, non-expert weights on the device, and its routed experts."""

    path: Path
    spec: ModelSpec
    model: Transformer
    experts: ResidentExperts
    config: EngineConfig


def load_resident(path: str | Path, config: EngineConfig | None = None) -> LoadedModel:
    """Load every weight onto the device (the resident mode; offloading builds on the same reader)."""
    config = config or EngineConfig()
    ckpt = Checkpoint(path)
    config = with_model_context(config, ckpt.spec)
    device, dtype = resolve_device(config), resolve_dtype(config, ckpt.spec)
    check_checkpoint(ckpt)  # the headers first, as build_runtime: load_dense lists every layer config.json claims
    dense = load_dense(ckpt, dtype, device, progress=config.progress)
    model = transformer_for(ckpt.spec)(ckpt.spec, dense, exact=config.exact, row_bucket=config.row_bucket, max_context=config.max_context,
                                       kernels=config.tuning.kernels)
    experts = ResidentExperts.from_iter(iter_experts(ckpt, dtype, progress=config.progress), ckpt.spec.num_experts, device)
    ckpt.close()
    return LoadedModel(Path(path), ckpt.spec, model, experts, config)
