"""The Triton fused MoE on a real GPU: real expert shapes vs the reference, no host sync, CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from specter.quant import QuantizedExperts, moe_forward, moe_reference, quantize_experts
from specter.quant.moe_triton import fused_moe, fused_moe_triton, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="triton is not installed"),
]

QWEN = dict(experts=60, hidden=2048, intermediate=1408, active=4)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double().cpu() - exact.double().cpu()).norm() / exact.double().cpu().norm()).item()


def cuda_layer(experts: int, hidden: int, intermediate: int, bits: int, seed: int = 0) -> QuantizedExperts:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (experts, intermediate, hidden)
    gate = (torch.randn(shape, generator=gen, device="cuda") / hidden**0.5).bfloat16()
    up = (torch.randn(shape, generator=gen, device="cuda") / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, intermediate, generator=gen, device="cuda") / intermediate**0.5).bfloat16()
    return quantize_experts(gate, up, down, bits=bits, group=128)


def cuda_routes(tokens: int, active: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(active, dim=-1)
    return ids, weights


@pytest.fixture(scope="module")
def qwen_int4() -> QuantizedExperts:
    return cuda_layer(QWEN["experts"], QWEN["hidden"], QWEN["intermediate"], bits=4)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_int4_kernel_matches_reference_on_qwen_shapes(qwen_int4: QuantizedExperts, tokens: int) -> None:
    ids, weights = cuda_routes(tokens, QWEN["active"], QWEN["experts"], seed=tokens)
    x = torch.randn(tokens, QWEN["hidden"], device="cuda", dtype=torch.bfloat16)
    out = fused_moe(x, ids, weights, qwen_int4)
    assert out.shape == (tokens, QWEN["hidden"]) and out.dtype == torch.bfloat16
    gate, up, down = (w.cpu() for w in qwen_int4.dequantize_experts())
    reference = moe_reference(x.cpu().double(), ids.cpu(), weights.cpu(), gate, up, down)
    assert relative_error(out, reference) < 1e-2


def test_int8_kernel_matches_torch_path() -> None:
    qe = cuda_layer(experts=8, hidden=1024, intermediate=512, bits=8)
    ids, weights = cuda_routes(5, 2, 8, seed=1)
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    expected = moe_forward(x.float(), ids, weights, qe)  # fp32 compute on the same dequantized weights
    assert relative_error(fused_moe_triton(x, ids, weights, qe), expected) < 1e-2


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("tokens", [1, 16])
def test_int2_and_int3_kernels_match_torch_path_on_qwen3_shapes(bits: int, tokens: int) -> None:
    """The draft formats below int4 on Qwen3-30B-A3B's expert shape (groups of 128, bf16): the one-token GEMVs (the
    draft's step) and the 16-row GEMMs, against the torch path on the same codes."""
    qe = cuda_layer(experts=16, hidden=2048, intermediate=768, bits=bits, seed=bits)
    ids, weights = cuda_routes(tokens, 8, 16, seed=tokens)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    expected = moe_forward(x.float(), ids, weights, qe)
    assert relative_error(fused_moe(x, ids, weights, qe), expected) < 1e-2


def test_kernel_is_deterministic_and_order_free(qwen_int4: QuantizedExperts) -> None:
    ids, weights = cuda_routes(8, QWEN["active"], QWEN["experts"], seed=3)
    x = torch.randn(8, QWEN["hidden"], device="cuda", dtype=torch.bfloat16)
    first = fused_moe(x, ids, weights, qwen_int4)
    flipped = fused_moe(x, ids.flip(1), weights.flip(1), qwen_int4)
    assert torch.equal(first, fused_moe(x, ids, weights, qwen_int4))
    assert torch.equal(first, flipped)


def test_kernel_does_not_sync_with_the_host(qwen_int4: QuantizedExperts) -> None:
    ids, weights = cuda_routes(4, QWEN["active"], QWEN["experts"], seed=4)
    x = torch.randn(4, QWEN["hidden"], device="cuda", dtype=torch.bfloat16)
    fused_moe(x, ids, weights, qwen_int4)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, ids, weights, qwen_int4)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_kernel_replays_in_a_cuda_graph_with_new_routes(qwen_int4: QuantizedExperts) -> None:
    tokens, active = 4, QWEN["active"]
    static_x = torch.randn(tokens, QWEN["hidden"], device="cuda", dtype=torch.bfloat16)
    static_ids, static_weights = cuda_routes(tokens, active, QWEN["experts"], seed=5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(static_x, static_ids, static_weights, qwen_int4)  # warm-up compiles the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(static_x, static_ids, static_weights, qwen_int4)
    new_ids, new_weights = cuda_routes(tokens, active, QWEN["experts"], seed=6)
    static_ids.copy_(new_ids)
    static_weights.copy_(new_weights)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fused_moe(static_x, new_ids, new_weights, qwen_int4))


@pytest.mark.parametrize("bits", [4, 8])
def test_single_token_gemv_matches_reference_is_order_free_and_replays(qwen_int4: QuantizedExperts, bits: int) -> None:
    from specter.config import MoETiles

    qe = qwen_int4 if bits == 4 else cuda_layer(QWEN["experts"], QWEN["hidden"], QWEN["intermediate"], bits=8, seed=2)
    config = MoETiles(single_token_gemv=True)
    ids, weights = cuda_routes(1, QWEN["active"], QWEN["experts"], seed=7)
    x = torch.randn(1, QWEN["hidden"], device="cuda", dtype=torch.bfloat16)
    out = fused_moe(x, ids, weights, qe, config)
    gate, up, down = (w.cpu() for w in qe.dequantize_experts())
    assert relative_error(out, moe_reference(x.cpu().double(), ids.cpu(), weights.cpu(), gate, up, down)) < 1e-2
    assert torch.equal(out, fused_moe(x, ids.flip(1), weights.flip(1), qe, config))  # added in expert-id order
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(x, ids, weights, qe, config)
    new_ids, new_weights = cuda_routes(1, QWEN["active"], QWEN["experts"], seed=8)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    assert torch.equal(static_out, fused_moe(x, new_ids, new_weights, qe, config))
