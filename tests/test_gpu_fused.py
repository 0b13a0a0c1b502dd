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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, experts, top_k, renormalize", [(1, 60, 4, False), (16, 128, 8, True), (3, 64, 6, False), (2, 8, 2, True)])
def test_fused_router_on_cuda(dtype, rows, experts, top_k, renormalize):
    generator = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(rows, experts, device="cuda", generator=generator) * 2).to(dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    reference, _ = torch.topk(probs, top_k, dim=-1)
    ids, weights = fused.topk_softmax(logits, top_k, renormalize, dtype)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and ids.shape == (rows, top_k)
    assert torch.equal(probs.gather(-1, ids), reference)  # the same choice in the same order (ties: lower id first)
    if renormalize:
        reference = reference / reference.sum(dim=-1, keepdim=True)
    assert (weights.float() - reference.to(dtype).float()).abs().max().item() <= ULP[dtype]
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0]], device="cuda", dtype=dtype)
    assert fused.topk_softmax(tied, 3, False, dtype)[0].tolist() == [[1, 2, 4]]  # equal probabilities: lower id first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 2048), (16, 4096), (3, 5120)])
def test_fused_sigmoid_gate_on_cuda(dtype, rows, width):
    import torch.nn.functional as F

    generator = torch.Generator(device="cuda").manual_seed(4)
    h = torch.randn(rows, width, device="cuda", generator=generator).to(dtype)
    gate = (torch.randn(1, width, device="cuda", generator=generator) / width**0.5).to(dtype)
    out = torch.randn(rows, width, device="cuda", generator=generator).to(dtype)
    reference = (torch.sigmoid(F.linear(h, gate)) * out).float()
    got = fused.sigmoid_gate(h, gate, out)
    assert got.dtype == dtype and got.shape == out.shape
    assert ((got.float() - reference).abs() / (reference.abs() + 1e-2)).max().item() <= 4 * max(ULP[dtype], 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim, capacity, window", [(1, 16, 16, 128, 2048, None),
                                                                                  (4, 32, 8, 128, 512, None),
                                                                                  (2, 32, 8, 128, 4096, 1024),
                                                                                  (1, 16, 16, 128, 32768, None)])
@pytest.mark.parametrize("splits", [None, 1, 5, "merged"])  # None: the default runs for the capacity (16, 4, 32, 64 here);
# merged: the default runs merged in the same launch (counters)
def test_fused_decode_attention_on_cuda(dtype, rows, heads, kv_heads, head_dim, capacity, window, splits):
    import math

    generator = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(rows, heads, head_dim, device="cuda", generator=generator).to(dtype)
    keys = torch.randn(kv_heads, capacity, head_dim, device="cuda", generator=generator).to(dtype)
    values = torch.randn(kv_heads, capacity, head_dim, device="cuda", generator=generator).to(dtype)
    positions = torch.randint(0, capacity, (rows,), device="cuda", generator=generator)
    positions[0] = capacity - 1  # the whole cache visible
    counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device="cuda") if splits == "merged" else None
    got = fused.decode_attention(q, keys, values, positions, window, None if counters is not None else splits, counters)
    got = got.view(rows, heads, head_dim).double()
    assert counters is None or counters.eq(0).all().item()
    group = heads // kv_heads
    for r, p in enumerate(positions.tolist()):
        first = 0 if window is None else max(0, p - window + 1)
        k = keys[:, first : p + 1].double().repeat_interleave(group, dim=0)  # [H, n, hd]
        v = values[:, first : p + 1].double().repeat_interleave(group, dim=0)
        weights = torch.softmax(torch.einsum("hd,hnd->hn", q[r].double(), k) / math.sqrt(head_dim), dim=-1)
        reference = torch.einsum("hn,hnd->hd", weights, v)
        assert (got[r] - reference).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 16, 16, 128), (3, 32, 8, 128), (2, 6, 2, 40)])
def test_rope_and_cache_equals_rope_then_index_copy_bit_for_bit_on_cuda(dtype, rows, heads, kv_heads, head_dim):
    generator = torch.Generator(device="cuda").manual_seed(6)
    capacity = 64
    q = torch.randn(rows, heads, head_dim, device="cuda", generator=generator).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, device="cuda", generator=generator).to(dtype)
    cos = torch.randn(capacity, head_dim, device="cuda", generator=generator).to(dtype)
    sin = torch.randn(capacity, head_dim, device="cuda", generator=generator).to(dtype)
    positions = torch.randperm(capacity, device="cuda", generator=generator)[:rows]
    cache = torch.randn(2, kv_heads, capacity, head_dim, device="cuda", generator=generator).to(dtype)
    expected = cache.clone()
    q_ref, k_ref = fused.rope(q, k, cos, sin, positions)
    expected[0].index_copy_(1, positions, k_ref.transpose(0, 1))
    expected[1].index_copy_(1, positions, v.transpose(0, 1))
    q_got = fused.rope_and_cache(q, k, v, cos, sin, positions, cache[0], cache[1])
    assert torch.equal(q_got, q_ref) and torch.equal(cache, expected)


def test_attention_merged_in_its_launch_is_the_two_launch_result_at_every_position_of_graph_replays() -> None:
    """fused.decode_attention with counters, captured once in a CUDA graph (as the draft step runs it) and replayed
    at 300 positions from 0 to the cache's end: rows that fit in the first run (written by it alone) and rows merged
    by the last of their runs to finish. Each replay matches the two-launch merge within float32 rounding and leaves
    every counter at zero (a race in the count would show as a wrong or missing output)."""
    rows, heads, kv_heads, head_dim, capacity = 2, 32, 8, 128, 2048
    generator = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(rows, heads, head_dim, device="cuda", generator=generator)
    keys = torch.randn(kv_heads, capacity, head_dim, device="cuda", generator=generator)
    values = torch.randn(kv_heads, capacity, head_dim, device="cuda", generator=generator)
    positions = torch.zeros(rows, dtype=torch.int64, device="cuda")
    counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device="cuda")
    fused.decode_attention(q, keys, values, positions, None, None, counters)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.decode_attention(q, keys, values, positions, None, None, counters)
    for step in range(300):
        positions.copy_(torch.tensor([step * 7 % capacity, capacity - 1 - step], device="cuda"))
        q.copy_(torch.randn(rows, heads, head_dim, device="cuda", generator=generator))
        graph.replay()
        expected = fused.decode_attention(q, keys, values, positions, None)
        torch.cuda.synchronize()
        assert (out - expected).abs().max().item() <= 1e-5, step
        assert counters.eq(0).all().item(), step
