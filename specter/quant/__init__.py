"""Weight-only quantization of routed experts and the draft's fused MoE (torch reference and Triton kernel)."""

from __future__ import annotations

from specter.quant.gptq import ExpertHessians, HessianAccumulator, gptq_quantize, gptq_quantize_experts
from specter.quant.groupwise import (
    SUPPORTED_BITS,
    QuantizedExperts,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_experts,
)
from specter.quant.moe_torch import moe_forward, moe_reference
from specter.quant.moe_triton import fused_moe

__all__ = [
    "SUPPORTED_BITS",
    "ExpertHessians",
    "HessianAccumulator",
    "QuantizedExperts",
    "QuantizedTensor",
    "dequantize",
    "fused_moe",
    "gptq_quantize",
    "gptq_quantize_experts",
    "moe_forward",
    "moe_reference",
    "quantize",
    "quantize_experts",
]

