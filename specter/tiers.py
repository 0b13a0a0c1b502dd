"""Which forward runs the target's decode and verify and the draft's steps: the one place the engine chooses.

The tiers, from the target's exactness down:
- the eager forward (`Transformer.forward`): exact mode's row blocks and torch's ops; every family, any device;
- the static step (`graphed.StaticStep`, replayed as a CUDA graph on CUDA): R rows at device positions, for a family
  that declares it (`FamilySpec.static`, read by `static_step_supported`): all-resident experts run it whole
  (`GraphedTarget`), offloaded ones cut at each MoE layer's routing (`segmented.SegmentedStep`), with static_verify
  or CUDA graphs (`EngineConfig.verify_is_static`, `cuda_graphs`);
- the draft (non-exact, `Draft`): the one-row static step on CUDA with graphs, else the eager forward. Inside either,
  each product picks its kernel from `EngineConfig.tuning.kernels` and the device: torch's ops, the fused Triton
  launches of specter.model.fused (CUDA or Triton's interpreter), or the one-row int4 kernels of
  specter.model.rowfused (`Transformer._row_kernels`); the exact target never takes the last two.
"""

from __future__ import annotations

from typing import NamedTuple

from specter.config import EngineConfig
from specter.draft import Draft, DraftExperts
from specter.model.graphed import GraphedTarget, static_step_supported
from specter.model.kv import KVCache
from specter.model.resident import ResidentExperts
from specter.model.segmented import SegmentedStep
from specter.model.transformer import ExpertProvider, Transformer
from specter.verify import OffloadedExperts


class Steps(NamedTuple):
    """The target's static steps: at most one is set; neither means the eager forward."""

    graphed: GraphedTarget | None
    segmented: SegmentedStep | None


def choose_steps(model: Transformer, experts: ExpertProvider, kv: KVCache, config: EngineConfig) -> Steps:
    """The target's decode and verify forward over `kv`: GraphedTarget (all experts resident), SegmentedStep
    (offloaded experts with a static verify) or neither (the eager forward)."""
    return Steps(graphed_target(model, experts, kv, config), segmented_step(model, experts, kv, config))


def graphed_target(model: Transformer, experts: ExpertProvider, kv: KVCache, config: EngineConfig) -> GraphedTarget | None:
    """All experts resident with a static-step family: decode and verify run one R-row static step.

    Replayed as a CUDA graph on CUDA with cuda_graphs; also built (run directly) with static_verify on
    any device, so the resident and the offloaded configurations share the static step's numerics.
    """
    graphs = model.device.type == "cuda" and config.cuda_graphs
    static = config.verify_is_static(model.device.type)
    supported = static_step_supported(model, config.tuning.kernels.static_mla)
    if not (graphs or static) or not isinstance(experts, ResidentExperts) or not supported:
        return None
    return GraphedTarget(model, experts, kv, use_graph=graphs)


def segmented_step(model: Transformer, experts: ExpertProvider, kv: KVCache, config: EngineConfig) -> SegmentedStep | None:
    """Offloaded experts with static_verify: verify runs GraphedTarget's numerics, cut at each MoE layer's routing."""
    if not isinstance(experts, OffloadedExperts) or not segmented_verify(config, model.device.type, model):
        return None
    return SegmentedStep(model, kv, use_graph=model.device.type == "cuda" and config.cuda_graphs)


def segmented_verify(config: EngineConfig, device_type: str, model: Transformer | type[Transformer]) -> bool:
    """Whether an offloaded verify runs the segmented static step (the memory plan asks before the model exists)."""
    return config.verify_is_static(device_type) and static_step_supported(model, config.tuning.kernels.static_mla)


def make_draft(model: Transformer, experts: DraftExperts, config: EngineConfig) -> Draft:
    """The draft over the target's tensors: its one-row static step (graphed) on CUDA with cuda_graphs when the family
    declares the static step, else the eager non-exact forward."""
    return Draft(model, experts, static=None if config.cuda_graphs else False)
