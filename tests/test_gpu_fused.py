"""The fused RMSNorm and RoPE kernels on a real GPU, at real widths, against torch's op sequence."""

from __future__ import annotations

import pytest
import torch

from specter.model import fused
from specter.model.transformer import rms_norm, rotate_half
from specter.quant.moe_triton import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="triton is not installed"),
]

ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2048), (16, 4096), (1, 32, 128), (3, 7168)])
def test_fused_rms_norm_on_cuda(dtype, shape):
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(*shape, device="cuda", generator=generator) * 3).to(dtype)
    weight = (1 + torch.randn(shape[-1], device="cuda", generator=generator) / 4).to(dtype)
    reference = rms_norm(x, weight, 1e-6).float()
    got = fused.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert ((got.float() - reference).abs() / (reference.abs() + 1e-3)).max().item() <= 2 * ULP[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 16, 16, 128), (1, 32, 8, 128), (17, 16, 4, 64)])
def test_fused_rope_on_cuda(dtype, rows, heads, kv_heads, head_dim):
    generator = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(rows, heads, head_dim, device="cuda", generator=generator).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    angles = torch.rand(256, head_dim // 2, device="cuda", generator=generator) * 6.3
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    positions = torch.randperm(256, device="cuda", generator=generator)[:rows]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    got_q, got_k = fused.rope(q, k, cos, sin, positions)
    assert (got_q.float() - (q * c + rotate_half(q) * s).float()).abs().max().item() <= 16 * ULP[dtype]
    assert (got_k.float() - (k * c + rotate_half(k) * s).float()).abs().max().item() <= 16 * ULP[dtype]
