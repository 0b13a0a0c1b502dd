"""One GPU memory budget for everything: non-expert weights, draft experts, KV, workspace, expert slots.

The plan is computed from the spec before anything is allocated, so a budget too small for the model is
refused with the minimum it needs, and the expert cache gets exactly what is left.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import torch

from specter.config import EngineConfig
from specter.draft import draft_expert_bytes
from specter.errors import BudgetError, ConfigError
from specter.model.spec import ModelSpec
from specter.model.weights import dense_numel

MiB = 2**20
GiB = 2**30
ALLOCATOR_SLACK_BYTES = 32 * MiB  # the caching allocator's rounding and small buffers
CUDA_LIBRARY_BYTES = 64 * MiB
"""On CUDA: cuBLAS/cuBLASLt workspaces (torch reserves 32 MiB per stream on sm90; the compute stream and a
graph-capture stream use one each) and the graphs' private pools: without this reserve a model's peak reserved
memory on the GPU exceeds its budget, by more when it speculates (tests/test_memory.py checks the peak against the
budget)."""


DEFAULT_CONTEXT = 2048
"""The context `EngineConfig.max_context=None` plans for, when the model's positions allow it."""


def with_model_context(config: EngineConfig, spec: ModelSpec) -> EngineConfig:
    """The config with max_context resolved for this model: None becomes min(DEFAULT_CONTEXT, max_position_embeddings);
    a context beyond the model's positions is refused (its rotary positions were never trained)."""
    if config.max_context is None:
        return config.model_copy(update={"max_context": min(DEFAULT_CONTEXT, spec.max_position)})
    if config.max_context > spec.max_position:
        raise ConfigError(f"max_context {config.max_context} is more than the model's max_position_embeddings {spec.max_position}; "
                          f"use max_context (--max-context) {spec.max_position} or less (or leave it unset for min({DEFAULT_CONTEXT}, "
                          f"{spec.max_position}))")
    return config


def on_cuda(config: EngineConfig) -> bool:
    return config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())


def workspace_bytes(spec: ModelSpec, config: EngineConfig, speculative: bool = True) -> int:
    """Activations of one row block through the widest layer, fp32 logits of a verify block, the segmented
    verify's expert outputs staged by expert id, and slack. A verify block is k_max + 1 rows where the engine builds a
    draft, one row block where it does not (its k_max is then 0, whatever the config's)."""
    rows = max(config.row_bucket, config.draft.k_max + 1) if speculative else config.row_bucket
    widest = max(spec.expert_intermediate * 2, spec.dense_intermediate * 2, spec.shared_intermediate * 2, 4 * spec.hidden_size)
    per_row = 4 * (spec.vocab_size + 8 * spec.hidden_size + 4 * widest)
    scores = 3 * 4 * spec.num_heads * rows * config.max_context  # the static step's whole-cache attention scores
    staged = 4 * spec.num_experts * rows * spec.hidden_size  # SegmentedStep's [E, R, D] (float32 at most)
    return ALLOCATOR_SLACK_BYTES + 4 * rows * per_row + scores + staged + (CUDA_LIBRARY_BYTES if on_cuda(config) else 0)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part of the budget and the expert slots they leave: `slots_per_layer` in every MoE layer and one
    more in `extra_slots` of them, so that the budget's bytes past a whole count per layer hold experts too."""

    budget: int | None
    dense_bytes: int
    draft_bytes: int
    kv_bytes: int
    workspace_bytes: int
    expert_bytes: int
    moe_layers: int
    num_experts: int
    slots_per_layer: int  # the fewest slots a MoE layer holds
    min_slots_per_layer: int
    slot_overhead_bytes: int = 0  # device bytes per slot besides its expert (the static verify's expert-graph output)
    extra_slots: int = 0  # MoE layers that hold one slot more than `slots_per_layer` (fewer than `moe_layers`)

    @property
    def layer_slots(self) -> tuple[int, ...]:
        """Each MoE layer's slots, by MoE index (`spread_slots`)."""
        return spread_slots(self.slots_per_layer, self.extra_slots, self.moe_layers)

    @property
    def total_slots(self) -> int:
        return self.moe_layers * self.slots_per_layer + self.extra_slots

    @property
    def slot_bytes(self) -> int:
        return self.expert_bytes + self.slot_overhead_bytes

    @property
    def fixed_bytes(self) -> int:
        return self.dense_bytes + self.draft_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def minimum_budget(self) -> int:
        return self.fixed_bytes + self.moe_layers * self.min_slots_per_layer * self.slot_bytes

    @property
    def resident_budget(self) -> int:
        """The budget at which every expert fits on the device."""
        return self.fixed_bytes + self.moe_layers * self.num_experts * self.expert_bytes

    @property
    def all_resident(self) -> bool:
        return self.slots_per_layer >= self.num_experts

    @property
    def device_bytes(self) -> int:
        """What the plan puts on the device: the fixed parts and the experts resident there (all, or the slots)."""
        if self.all_resident:
            return self.resident_budget
        return self.fixed_bytes + self.total_slots * self.slot_bytes

    @property
    def idle_bytes(self) -> int:
        """The budget's bytes the plan leaves unused: less than one slot (0 without a budget or with every expert
        resident)."""
        return 0 if self.budget is None or self.all_resident else self.budget - self.device_bytes

    @property
    def next_slot_budget(self) -> int | None:
        """The smallest budget that gives one MoE layer one slot more (at most the resident budget); None with every
        expert resident."""
        return None if self.all_resident else min(self.device_bytes + self.slot_bytes, self.resident_budget)

    @property
    def host_pool_bytes(self) -> int:
        """The pinned host copy of every expert, when they do not all fit on the device."""
        return 0 if self.all_resident else self.moe_layers * self.num_experts * self.expert_bytes


def plan_memory(spec: ModelSpec, dtype: torch.dtype, config: EngineConfig, speculative: bool = True,
                expert_graphs: bool | None = None) -> MemoryPlan:
    """Split the budget; raise BudgetError when it cannot hold the minimum.

    `expert_graphs`: whether the offloaded verify will keep one expert graph per slot (the engine knows,
    from the model family); None derives it from the configuration alone.
    """
    config = with_model_context(config, spec)
    element = torch.empty((), dtype=dtype).element_size()
    dense = dense_numel(spec) * element  # per kind of layer: as many layers as config.json claims cost nothing more
    moe_layers = spec.num_moe_layers
    kv = 2 * spec.num_layers * spec.num_kv_heads * config.max_context * spec.head_dim * element
    scale_bytes = element if dtype in (torch.float16, torch.bfloat16) else 4
    per_draft_expert = draft_expert_bytes(spec.hidden_size, spec.expert_intermediate, config.draft.quant, config.draft.group_size, scale_bytes)
    draft = per_draft_expert * spec.num_experts * moe_layers if speculative else 0
    expert = spec.expert_numel * element
    plan = MemoryPlan(
        budget=config.budget, dense_bytes=dense, draft_bytes=draft, kv_bytes=kv, workspace_bytes=workspace_bytes(spec, config, speculative),
        expert_bytes=expert, moe_layers=moe_layers, num_experts=spec.num_experts, slots_per_layer=spec.num_experts,
        min_slots_per_layer=spec.top_k, slot_overhead_bytes=_slot_overhead(spec, config, element, expert_graphs),
    )
    slots, extra = _slots(plan, config)
    return dataclasses.replace(plan, slots_per_layer=slots, extra_slots=extra)


def spread_slots(slots: int, extra: int, layers: int) -> tuple[int, ...]:
    """`slots` for each of `layers` and one more for `extra` of them, spread evenly over the depth (the relay lends
    a slot to the layer after, so an extra slot can serve its neighbour too)."""
    assert 0 <= extra < max(layers, 1), f"{extra} extra slots over {layers} layers"
    return tuple(slots + ((i + 1) * extra // layers - i * extra // layers) for i in range(layers))


def split_slots(slots: Sequence[int]) -> tuple[int, int]:
    """A cache's per-layer counts as a plan's two fields: the fewest a layer holds (`slots_per_layer`) and the slots
    beyond that count over all layers (`extra_slots`)."""
    fewest = min(slots)
    return fewest, sum(slots) - fewest * len(slots)


def _slot_overhead(spec: ModelSpec, config: EngineConfig, element: int, expert_graphs: bool | None) -> int:
    """With static_verify and CUDA graphs, each slot's expert graph keeps an [R, D] output alive."""
    if expert_graphs is None:
        expert_graphs = on_cuda(config) and config.cuda_graphs and config.verify_is_static("cuda")
    if not expert_graphs:
        return 0
    return config.row_bucket * spec.hidden_size * element


def _slots(plan: MemoryPlan, config: EngineConfig) -> tuple[int, int]:
    """Slots in every MoE layer, and the count of layers with one more: `residents` as given (none more), all
    resident within the budget, or as many as the budget holds."""
    if config.residents is not None and not plan.moe_layers:
        # Every layer dense (decoder_sparse_step beyond the depth, all in mlp_only_layers, first_k_dense_replace = depth):
        # there is no expert to offload, so `residents` caps nothing and the model runs as without it (a budget too small
        # for the rest is still refused below). Refusing would fail a setting that only asks for at most so many experts.
        config = config.model_copy(update={"residents": None})
    if config.residents is not None:
        if config.residents < plan.min_slots_per_layer:
            raise BudgetError(f"residents={config.residents} slots per layer is below this model's minimum of "
                              f"{plan.min_slots_per_layer} (one token's active experts, its top-k); use residents (--residents) "
                              f"{plan.min_slots_per_layer} or more")
        if config.residents > plan.num_experts:
            raise BudgetError(f"residents={config.residents} slots per layer is more than this model's {plan.num_experts} experts "
                              f"per layer; use residents (--residents) {plan.num_experts} or less ({plan.num_experts}, or "
                              "neither residents nor budget, keeps every expert resident)")
        return config.residents, 0
    if config.budget is None or config.budget >= plan.resident_budget:
        return plan.num_experts, 0  # all resident: no cache, so no per-slot overhead either
    if config.budget < plan.minimum_budget:
        raise BudgetError(
            f"budget {fmt(config.budget)} is {fmt(plan.minimum_budget - config.budget, round_up=True)} short of the minimum "
            f"{fmt(plan.minimum_budget, round_up=True)} "
            f"(non-expert weights {fmt(plan.dense_bytes)}, draft {fmt(plan.draft_bytes)}, KV for {config.max_context} tokens "
            f"{fmt(plan.kv_bytes)}, workspace {fmt(plan.workspace_bytes)}, {plan.min_slots_per_layer} expert slots x "
            f"{plan.moe_layers} layers); raise the budget, lower max_context or use a smaller draft quantization"
        )
    if not plan.moe_layers:
        return 0, 0
    total = (config.budget - plan.fixed_bytes) // plan.slot_bytes
    # Below the resident budget the total is under moe_layers * num_experts (a slot costs at least an expert).
    return int(total // plan.moe_layers), int(total % plan.moe_layers)


def fmt(size: int, round_up: bool = False) -> str:
    """Bytes for people: 1.50 GiB, 12.0 MiB; `round_up` for a budget to give as printed (never short of `size`)."""
    unit, name, places = (GiB, "GiB", 2) if abs(size) >= GiB else (MiB, "MiB", 1)
    value = math.ceil(size / unit * 10**places) / 10**places if round_up else size / unit
    return f"{value:.{places}f} {name}"


def available_host_bytes() -> int:
    """Host memory the OS can give this process now (MemAvailable; free pages where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
