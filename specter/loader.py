"""From a checkpoint path and an EngineConfig to a model on its device, with experts resident or pooled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specter.config import EngineConfig
from specter.errors import ConfigError
from specter.memory import with_model_context
from specter.model.checkpoint import Checkpoint
from specter.model.resident import ResidentExperts
from specter.model.spec import ModelSpec
from specter.model.registry import transformer_for
from specter.model.transformer import Transformer
from specter.model.weights import check_no_unknown_experts, iter_experts, load_dense

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    """'auto' is CUDA when present; asking for CUDA on a machine without it is a configuration error."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"EngineConfig.device = {config.device!r}: CUDA is not available on this machine; use device='cpu' or 'auto'")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, spec: ModelSpec) -> torch.dtype:
    name = spec.dtype if config.dtype == "auto" else config.dtype
    return _DTYPES.get(name, torch.float32)


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
    check_no_unknown_experts(ckpt)
    dense = load_dense(ckpt, dtype, device, progress=config.progress)
    model = transformer_for(ckpt.spec)(ckpt.spec, dense, exact=config.exact, row_bucket=config.row_bucket, max_context=config.max_context,
                                       kernels=config.tuning.kernels)
    experts = ResidentExperts.from_iter(iter_experts(ckpt, dtype, progress=config.progress), ckpt.spec.num_experts, device)
    ckpt.close()
    return LoadedModel(Path(path), ckpt.spec, model, experts, config)
