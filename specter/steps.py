"""Which forward runs the target's decode and verify and the draft's steps: the one place the runtime chooses.

The tiers, from the target's exactness down:
- the eager forward (`Transformer.forward`): exact mode's row blocks and torch's ops; every family, any device;
- the static step (`graphed.StaticStep`, replayed as a CUDA graph on CUDA): R rows at device positions, for a family
  whose class declares it (`FamilySpec.static`, read by `static_step_supported`): all-resident experts run it whole
  (`graphed_target`), offloaded ones cut at each MoE layer's routing (`segmented_step`), with static_verify or CUDA
  graphs (`EngineConfig.verify_is_static`, `cuda_graphs`); None from both pickers: the eager forward;
- the draft (non-exact, `make_draft`): the one-row static step on CUDA with graphs, else the eager forward.
Inside any of them, which kernel each product runs (torch's ops, a fused Triton launch of specter.model.fused, or the
one-row int4 kernels of specter.model.rowfused) is the model's `KernelTiers` (specter.model.tiers), chosen once when
the Transformer is built from `EngineConfig.tuning.kernels`, its exactness and its device; the exact target never
takes the last two.
"""

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
    return SegmentedStep(model, kv, use_graph=model.device.type == "cuda" and config.cuda_graphs, backend=experts.cache.backend)


def segmented_verify(config: EngineConfig, device_type: str, model: Transformer | type[Transformer]) -> bool:
    """Whether an offloaded verify runs the segmented static step (the memory plan asks before the model exists)."""
    return config.verify_is_static(device_type) and static_step_supported(model, config.tuning.kernels.static_mla)


def make_draft(model: Transformer, experts: DraftExperts, config: EngineConfig) -> Draft:
    """The draft over the target's tensors: its one-row static step (graphed) on CUDA with cuda_graphs when the family
    declares the static step, else the eager non-exact forward."""
    return Draft(model, experts, static=None if config.cuda_graphs else False)
