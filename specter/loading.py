"""Loading a runtime's parts: where weights come from, the plug-ins, the backend, and the experts.

Every expert is streamed once: into device memory when all fit, otherwise into the pinned host pool
behind an expert cache; in both cases also into the draft's quantizer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Protocol

import torch

from specter import plugins
from specter.config import EngineConfig
from specter.draft import quantize_layers
from specter.errors import BudgetError
from specter.experts.cache import ExpertCache
from specter.experts.pool import ExpertPool
from specter.experts.transfer import LinkEmulation, TransferEngine, parse_link
from specter.kernel import Kernel
from specter.memory import MemoryPlan, available_host_bytes, fmt
from specter.model.checkpoint import Checkpoint
from specter.model.resident import ResidentExperts
from specter.model.spec import ModelSpec
from specter.model.weights import check_no_unknown_experts, iter_experts, load_dense
from specter.verify import OffloadedExperts

Tensor = torch.Tensor


def scout_only(config: EngineConfig) -> bool:
    """The draft would serve only the scout: the depth is fixed at 0."""
    return config.lookahead == "fixed" and config.draft.k == 0


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
    }


def load_backend(config: EngineConfig, device: torch.device):
    name = device.type if config.backend == "auto" else config.backend
    if name == "cpu":
        return plugins.load_backend("cpu", link_gbps=parse_link(config.link))
    return plugins.load_backend(name, device=device.index or 0)


def check_device_memory(config: EngineConfig, device: torch.device, memory: MemoryPlan) -> None:
    """Refuse, before allocating, a plan the machine cannot hold: a budget above the GPU's free memory, or (without
    a budget) the plan's device bytes, plus the host pool on the CPU, above what is free there."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if config.budget is not None and config.budget > free:
            raise BudgetError(f"budget {fmt(config.budget)} is more than the GPU's free memory {fmt(free)}; lower --budget")
        needed, where = memory.device_bytes, "the GPU's free memory"
    else:
        free = available_host_bytes()
        needed, where = memory.device_bytes + memory.host_pool_bytes, "the host's available memory"
    if config.budget is None and needed > free:
        raise BudgetError(
            f"this configuration needs about {fmt(needed)} and {where} is {fmt(free)}: KV for max_context "
            f"{config.max_context} tokens {fmt(memory.kv_bytes)}, workspace {fmt(memory.workspace_bytes)}, non-expert weights "
            f"{fmt(memory.dense_bytes)}, draft {fmt(memory.draft_bytes)}, experts {fmt(needed - memory.fixed_bytes)}; "
            "lower --max-context (KV and workspace grow with it), or give --residents or --budget"
        )


def apply_threads(config: EngineConfig, device: torch.device) -> None:
    """Set torch's intra-op CPU threads (process-wide) to EngineConfig.threads, or to the measured default."""
    threads = config.threads if config.threads is not None else default_threads(device)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def default_threads(device: torch.device) -> int:
    """EngineConfig.threads=None: see its description for the measurements behind it."""
    if device.type == "cuda":
        return 1  # the host only enqueues work and keeps books
    # Never one thread per core: torch's OpenMP workers spin while they wait, and with one other busy process
    # they fight it for every core (2 cores, 2 threads: 1.1 s TPOT on tiny against 54 ms with 1).
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class WeightSource(Protocol):
    """Where a runtime's weights come from: a checkpoint directory, or synthetic weights made in memory."""

    spec: ModelSpec

    def validate(self) -> None:
        """Raise CheckpointError for problems detectable before loading (called after the memory plan)."""

    def dense(self, dtype: torch.dtype, device: torch.device, progress: bool) -> dict[str, Tensor]:
        """Every non-expert tensor by on-disk name, on the device."""

    def experts(self, dtype: torch.dtype, progress: bool) -> Iterator[tuple[int, int, Tensor]]:
        """(layer, expert, packed flat CPU tensor) for every routed expert, layer by layer."""

    def close(self) -> None: ...


LARGE_CHECKPOINT_BYTES = 1 << 30  # above this, loading shows progress on a terminal even when not asked


class CheckpointWeights:
    """A WeightSource reading a Hugging Face checkpoint directory."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt, self.spec = ckpt, ckpt.spec
        on_disk = sum(file.stat().st_size for file in ckpt.files if file.is_file())
        self.auto_progress = on_disk > LARGE_CHECKPOINT_BYTES and sys.stderr.isatty()

    def validate(self) -> None:
        check_no_unknown_experts(self.ckpt)

    def dense(self, dtype: torch.dtype, device: torch.device, progress: bool) -> dict[str, Tensor]:
        return load_dense(self.ckpt, dtype, device, progress=progress or self.auto_progress)

    def experts(self, dtype: torch.dtype, progress: bool) -> Iterator[tuple[int, int, Tensor]]:
        return iter_experts(self.ckpt, dtype, progress=progress or self.auto_progress)

    def close(self) -> None:
        self.ckpt.close()


async def load_experts(source: WeightSource, config: EngineConfig, memory: MemoryPlan, backend, kernel: Kernel, dtype: torch.dtype,
                        device: torch.device, speculative: bool):
    """Stream every expert once: into device memory (all resident) or the host pool, and into the draft's quantizer."""
    spec = source.spec
    if memory.all_resident:
        resident = ResidentExperts.from_iter(source.experts(dtype, config.progress), spec.num_experts, device)
        stream = ((layer, e, resident.expert(layer, e)) for layer in spec.moe_layers for e in range(spec.num_experts))
        draft = quantize_layers(stream, spec.hidden_size, spec.expert_intermediate, spec.num_experts, config.draft, device) if speculative else {}
        return resident, None, draft
    pool = ExpertPool(backend, len(spec.moe_layers), spec.num_experts, spec.expert_numel, dtype)
    moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}

    def into_pool():
        for layer, expert, flat in source.experts(dtype, config.progress):
            pool.write(moe_index[layer], expert, flat)
            yield layer, expert, flat

    if speculative:
        draft = quantize_layers(into_pool(), spec.hidden_size, spec.expert_intermediate, spec.num_experts, config.draft, device)
    else:
        draft = {}
        for _ in into_pool():
            pass
    pool.check_complete()
    gbps = parse_link(config.link)
    link = LinkEmulation(gbps) if gbps is not None and device.type == "cuda" else None
    tuning = config.tuning
    transfer = TransferEngine(backend, kernel, link=link, tuning=tuning.transfer)
    cache = ExpertCache(backend, kernel, transfer, pool, memory.slots_per_layer, choose_victims=lambda *a: [], tuning=tuning.cache)
    return OffloadedExperts(cache, kernel, {}, tuning=tuning.verify), cache, draft
