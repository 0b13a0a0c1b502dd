"""Which kernel each product of a Transformer's forward runs: the kernel tiers, chosen once per Transformer.

From the target's exactness down:
1. torch's ops: the exact forward (the target and its verify) on every device, and anything switched off;
2. fused Triton launches (specter.model.fused): the non-exact forward (the draft) on CUDA, or under Triton's
   interpreter, one path per EngineConfig.tuning.kernels switch; with kernels.exact_rowwise, the exact forward too
   takes those among them that compute each row on its own (norm, rope, router and gate, and the decode attention
   for every row, its runs merged in a second launch);
3. the one-row kernels (specter.model.rowfused): the draft's one-row products, for a family that keeps the base
   class's RMSNorm (and, for the MoE layer, its routing), with the kernels.row tiles.
The forward asks by name (`tiers.norm`, `tiers.one_row(x)`) and never reads the switches or the device itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specter.config import KernelTuning, RowTiles
from specter.model import fused

if TYPE_CHECKING:
    from specter.model.transformer import FamilySpec

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class KernelTiers:
    """One Transformer's kernel choices (see the module docstring); every field False is torch's ops (the exact
    forward by default)."""

    norm: bool  # RMSNorm in one launch (fused.rms_norm)
    rope: bool  # q and k rotated in one launch (fused.rope)
    rope_writes_cache: bool  # the static attention ropes and writes the KV cache in one launch (fused.rope_and_cache)
    decode_attention: bool  # a one-row step attends over the visible positions only (fused.decode_attention)
    merge_in_launch: bool  # ... and merges its runs in its own launch, with per-layer counters
    exact_attention: bool  # the exact forward's every row over its visible positions, one launch and a merge (no counters)
    router: bool  # the router's softmax + top-k and the shared expert's gate, one launch each (fused)
    gated_silu: bool  # the packed shared expert's activation in one launch (fused.gated_silu)
    residual_addend: bool  # residual + linear as one product with the residual as its addend (torch.addmm)
    packed_qkv: bool  # q, k and v as one product over the packed weights
    packed_ffn_input: bool  # the router and the shared expert's inputs as one product over the packed weights
    row_kernels: bool  # one-row products through rowfused (the q/k/v product with its norm, o_proj with its residual)
    row_moe: bool  # ... and the one-row MoE layer (input product, gate/up, finish)
    row: RowTiles  # the one-row kernels' tiles (EngineConfig.tuning.kernels.row)

    @staticmethod
    def choose(kernels: KernelTuning, *, exact: bool, device: torch.device, family: FamilySpec | None) -> KernelTiers:
        """The tiers of a forward that is `exact` or not, on `device`, for a class declaring `family` (None: a class
        that declares none keeps torch's ops and the general products: see transformer.declared)."""
        fast = not exact  # the non-exact forward's products: torch's, or the packed ones
        fused_ok = fast and fused.usable_on(device)  # ... or Triton launches
        # The launches that compute each row on its own, whatever rows run beside it: the exact forward of a class that
        # declares its family may take them too (kernels.exact_rowwise), its eager and static paths alike. (An
        # undeclared subclass keeps torch's ops: it may lay out its RoPE tables or route otherwise.)
        rowwise = (fast or (kernels.exact_rowwise and family is not None)) and fused.usable_on(device)
        rows = fused_ok and kernels.row_kernels and family is not None and family.norm == "rms"
        return KernelTiers(
            norm=rowwise, rope=rowwise, rope_writes_cache=fused_ok and kernels.rope_writes_cache,
            decode_attention=fused_ok and kernels.decode_attention, merge_in_launch=kernels.merge_in_launch,
            exact_attention=exact and rowwise,
            router=rowwise and kernels.router_and_gate, gated_silu=fused_ok,
            residual_addend=fast and kernels.residual_addend, packed_qkv=fast and kernels.packed_qkv,
            packed_ffn_input=fast and kernels.packed_ffn_input and kernels.router_and_gate,
            row_kernels=rows,
            row_moe=rows and kernels.router_and_gate and family is not None and family.routing == "softmax_topk",
            row=kernels.row,
        )  # fmt: skip

    def one_row(self, x: Tensor) -> bool:
        """Whether a product over x [T, ...] runs through the one-row kernels: T = 1 with row_kernels."""
        return self.row_kernels and x.shape[0] == 1

    def one_row_moe(self, x: Tensor) -> bool:
        """Whether a MoE layer over x [T, D] runs through the one-row kernels: T = 1 with row_moe."""
        return self.row_moe and x.shape[0] == 1

