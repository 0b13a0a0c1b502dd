"""Which step runs the target and the draft for a configuration: the resident static step, the segmented
offloaded verify, or the eager forward (None from both pickers). To be replaced by one call into specter.model."""

from __future__ import annotations

from specter.config import EngineConfig
from specter.draft import Draft, DraftExperts
from specter.model.graphed import GraphedTarget, static_step_supported
from specter.model.kv import KVCache
from specter.model.resident import ResidentExperts
from specter.model.segmented import SegmentedStep
from specter.model.transformer import ExpertProvider, Transformer
from specter.verify import OffloadedExperts


def graphed_target(model: Transformer, experts: ExpertProvider, kv: KVCache, config: EngineConfig) -> GraphedTarget | None:
    """All experts resident with the standard attention: decode and verify run one R-row static step.

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
    return Draft(model, experts, static=None if config.cuda_graphs else False)
