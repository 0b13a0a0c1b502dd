"""Group-wise quantization (int8/int4/int3/int2) and GPTQ: packing, error bounds, formats, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.errors import ConfigError
from specter.quant import (
    ExpertHessians,
    HessianAccumulator,
    dequantize,
    gptq_quantize,
    gptq_quantize_experts,
    quantize,
    quantize_experts,
)
from specter.quant.groupwise import CODES_PER_UNIT, empty_experts, level_limit, pack_codes, unpack_codes


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


@pytest.fixture
def normal_weight() -> torch.Tensor:
    return torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), rows=st.integers(1, 5), units=st.integers(1, 6), seed=st.integers(0, 99))
def test_pack_unpack_roundtrip_is_exact(bits: int, rows: int, units: int, seed: int) -> None:
    k = units * CODES_PER_UNIT[bits]
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
    codes = torch.randint(low, high, (rows, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, k), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_error_matches_derived_bound(normal_weight: torch.Tensor, bits: int) -> None:
    # Without clipping every element lands within half a step of a level: |err| <= s/2. Errors are then
    # close to uniform on [-s/2, s/2], so ||err||_F^2 ~= sum over groups of group * s^2 / 12.
    q = quantize(normal_weight, bits=bits, group=128)
    error = dequantize(q) - normal_weight
    step = q.scales.T.repeat_interleave(128, dim=1)  # [N, K], fp32 here
    assert (error.abs() <= step / 2 + 1e-6).all()
    predicted = math.sqrt((step.square().mean() / 12).item()) / normal_weight.square().mean().sqrt().item()
    measured = relative_error(dequantize(q), normal_weight)
    assert abs(measured - predicted) < 0.05 * predicted
    # For N(0, 1) groups of 128, absmax ~= 2.7, so rel ~= 2.7 / (2^(b-1) - 0.5) / sqrt(12): 0.104 / 0.0061.
    assert measured < {4: 0.12, 8: 0.008}[bits]


def test_error_grows_as_bits_shrink(normal_weight: torch.Tensor) -> None:
    errors = [relative_error(dequantize(quantize(normal_weight, bits, 128)), normal_weight) for bits in (2, 3, 4, 8)]
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert errors[0] < 0.40 and errors[1] < 0.22  # clip search gets near the Lloyd-Max-like optimum


@pytest.mark.parametrize("bits", [2, 3])
def test_clip_search_beats_absmax_at_low_bits(normal_weight: torch.Tensor, bits: int) -> None:
    searched = relative_error(dequantize(quantize(normal_weight, bits, 128, clip_search=True)), normal_weight)
    absmax = relative_error(dequantize(quantize(normal_weight, bits, 128, clip_search=False)), normal_weight)
    assert searched < absmax


@pytest.mark.parametrize("bits,expected", [(8, 1 + 1 / 64), (4, 0.5 + 1 / 64), (3, 0.375 + 1 / 64), (2, 0.25 + 1 / 64)])
def test_bytes_per_param_with_half_scales(bits: int, expected: float) -> None:
    w = torch.randn(64, 512).to(torch.bfloat16)
    q = quantize(w, bits, 128)
    assert q.scales.dtype == torch.bfloat16
    assert q.nbytes / w.numel() == pytest.approx(expected)
    assert dequantize(q).dtype == torch.bfloat16


def test_per_row_group_and_codes_on_grid() -> None:
    w = torch.randn(8, 96)
    q = quantize(w, 4, group=-1)
    assert q.group == 96 and q.scales.shape == (1, 8)
    codes = unpack_codes(q.packed, 4, 96)
    assert torch.equal(dequantize(q), (codes.float() + 0.5) * q.scales.T)


def test_zero_group_dequantizes_to_zero() -> None:
    w = torch.randn(4, 256)
    w[1, :128] = 0
    d = dequantize(quantize(w, 4, 128))
    assert torch.equal(d[1, :128], torch.zeros(128))


def test_outermost_level_hits_absmax_for_rtn() -> None:
    w = torch.randn(16, 128)
    q = quantize(w, 4, 128)
    assert torch.allclose(q.scales[0] * level_limit(4), w.abs().amax(dim=1))
    assert torch.allclose(dequantize(q).abs().amax(dim=1), w.abs().amax(dim=1))


@pytest.mark.parametrize(
    "bits,group,k,fragment",
    [
        (4, 100, 256, "does not divide"),
        (5, 128, 256, "not supported"),
        (3, 4, 64, "multiple of 8"),
        (4, 0, 64, "divide"),
    ],
)
def test_bad_configs_raise_config_error(bits: int, group: int, k: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        quantize(torch.randn(4, k), bits, group)


def make_experts(experts: int, intermediate: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(experts, intermediate, hidden, generator=gen)
    up = torch.randn(experts, intermediate, hidden, generator=gen)
    down = torch.randn(experts, hidden, intermediate, generator=gen)
    return gate, up, down


def test_quantize_experts_stacks_per_expert_quantization() -> None:
    gate, up, down = make_experts(3, 64, 128)
    qe = quantize_experts(gate, up, down, bits=4, group=32)
    assert qe.w13.shape == (3, 128, 64) and qe.w13_scales.shape == (3, 4, 128)
    assert qe.w2.shape == (3, 128, 32) and qe.w2_scales.shape == (3, 2, 128)
    gate_q, up_q, down_q = qe.dequantize_experts()
    assert torch.equal(up_q[2], dequantize(quantize(torch.cat([gate[2], up[2]]), 4, 32))[64:])
    assert torch.equal(down_q[1], dequantize(quantize(down[1], 4, 32)))
    assert qe.nbytes == 3 * (128 * 64 + 4 * 128 * 4 + 128 * 32 + 2 * 128 * 4)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, -1), (3, 64), (2, 32)])
def test_quantize_experts_into_a_preallocated_layer_equals_each_experts_own_quantization(bits, group) -> None:
    gate, up, down = make_experts(3, 64, 128, seed=bits)
    out = empty_experts(3, 64, 128, bits, group, torch.float32, "cpu")
    assert quantize_experts(gate, up, down, bits=bits, group=group, out=out) is out
    for e in range(3):
        w13, w2 = quantize(torch.cat([gate[e], up[e]]), bits, group), quantize(down[e], bits, group)
        assert torch.equal(out.w13[e], w13.packed) and torch.equal(out.w13_scales[e], w13.scales)
        assert torch.equal(out.w2[e], w2.packed) and torch.equal(out.w2_scales[e], w2.scales)
        assert (out.w13_group, out.w2_group) == (w13.group, w2.group)
    allocated = quantize_experts(gate, up, down, bits=bits, group=group)  # no `out`: the same bytes
    assert all(torch.equal(getattr(allocated, name), getattr(out, name)) for name in ("w13", "w13_scales", "w2", "w2_scales"))


def test_quantize_experts_refuses_an_out_of_another_shape_or_format() -> None:
    gate, up, down = make_experts(2, 64, 128)
    for wrong, match in ((empty_experts(2, 64, 128, 4, 64, torch.float32, "cpu"), r"\(32, 32\)"),
                         (empty_experts(3, 64, 128, 4, 32, torch.float32, "cpu"), "3, 128"),
                         (empty_experts(2, 64, 128, 2, 32, torch.float32, "cpu"), "int2"),
                         (empty_experts(2, 64, 128, 4, 32, torch.bfloat16, "cpu"), "bfloat16")):
        with pytest.raises(ConfigError, match=match):
            quantize_experts(gate, up, down, bits=4, group=32, out=wrong)


def test_quantize_layers_fills_every_layer_as_quantize_experts_does_and_refuses_a_stranger() -> None:
    from specter.config import DraftConfig
    from specter.draft import quantize_layers

    layers = {1: make_experts(2, 64, 128, seed=1), 3: make_experts(2, 64, 128, seed=3)}
    # a packed flat: w13 [2I, D] (gate rows, then up rows), then w2 [D, I] (specter.model.weights.unpack_expert)
    flats = {(layer, e): torch.cat([gate[e].flatten(), up[e].flatten(), down[e].flatten()])
             for layer, (gate, up, down) in layers.items() for e in range(2)}
    config = DraftConfig(quant="int4", group_size=32)
    stream = [(layer, e, flats[layer, e]) for e in (1, 0) for layer in (3, 1)]  # interleaved, out of order
    built = quantize_layers(stream, 128, 64, 2, config, torch.device("cpu"), layers=[1, 3], dtype=torch.float32)
    assert sorted(built) == [1, 3]
    for layer, (gate, up, down) in layers.items():
        expected = quantize_experts(gate, up, down, bits=4, group=32)
        assert all(torch.equal(getattr(built[layer], n), getattr(expected, n)) for n in ("w13", "w13_scales", "w2", "w2_scales"))
    with pytest.raises(ConfigError, match="layer 3, which is not one of its MoE layers"):
        quantize_layers(stream, 128, 64, 2, config, torch.device("cpu"), layers=[1], dtype=torch.float32)


def test_quantize_experts_rejects_mismatched_shapes() -> None:
    gate, up, down = make_experts(2, 64, 128)
    with pytest.raises(ConfigError, match="down"):
        quantize_experts(gate, up, down.transpose(1, 2), bits=4, group=32)


def correlated_activations(rows: int, features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=gen) / math.sqrt(features)
    return torch.randn(rows, features, generator=gen) @ mixing + 0.5 * torch.randn(features, generator=gen)


@pytest.mark.parametrize("bits,group", [(4, 32), (3, 64), (4, -1)])
def test_gptq_beats_rtn_on_correlated_activations(bits: int, group: int) -> None:
    x = correlated_activations(1024, 128, seed=1)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(2))
    accumulator = HessianAccumulator(128)
    accumulator.add(x[:500])
    accumulator.add(x[500:])
    gptq = dequantize(gptq_quantize(w, accumulator.hessian, bits, group))
    rtn = dequantize(quantize(w, bits, group))
    gptq_error = (x @ (w - gptq).T).norm()
    rtn_error = (x @ (w - rtn).T).norm()
    assert gptq_error < 0.85 * rtn_error


def test_gptq_output_is_in_the_shared_format() -> None:
    x = correlated_activations(256, 64, seed=3)
    w = torch.randn(32, 64).to(torch.float16)
    q = gptq_quantize(w, x.T.double() @ x.double(), bits=4, group=32)
    assert q.packed.dtype == torch.uint8 and q.scales.dtype == torch.float16 and q.shape == (32, 64)
    codes = unpack_codes(q.packed, 4, 64).float().reshape(32, 2, 32)
    assert torch.equal(dequantize(q, torch.float32), ((codes + 0.5) * q.scales.T.float()[..., None]).reshape(32, 64))


def test_gptq_without_calibration_data_is_rtn() -> None:
    w = torch.randn(16, 64)
    q = gptq_quantize(w, torch.zeros(64, 64, dtype=torch.float64), bits=4, group=32)
    assert torch.equal(dequantize(q), dequantize(quantize(w, 4, 32)))


def test_expert_hessians_accumulate_only_routed_tokens() -> None:
    x = torch.randn(5, 8)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [0, 1]])
    hessians = ExpertHessians(num_experts=4, in_features=8)
    hessians.add(x, ids)
    stacked = hessians.stacked()
    routed_to_1 = x[[0, 1, 3, 4]].double()
    assert torch.allclose(stacked[1], routed_to_1.T @ routed_to_1)
    assert torch.equal(stacked[3], torch.zeros(8, 8, dtype=torch.float64))
    assert hessians.experts[0].num_rows == 3


def test_gptq_batch_equals_one_call_per_weight() -> None:
    """One column loop for a layer's experts gives each expert exactly what its own call gives: a dead input, a
    Hessian that needs more damping than the first try, and one with no data at all among them."""
    from specter.quant.gptq import gptq_quantize_batch

    w = torch.randn(4, 24, 64, generator=torch.Generator().manual_seed(6))
    hessians = []
    for seed in range(4):
        x = correlated_activations(128, 64, seed=10 + seed)
        if seed == 1:
            x[:, :3] = 0  # inputs never seen
        if seed == 2:
            x = x[:, :1].repeat(1, 64)  # rank one: near-singular
        hessians.append(x.T.double() @ x.double())
    hessians[3] = torch.zeros(64, 64, dtype=torch.float64)
    hessian = torch.stack(hessians)
    batch = gptq_quantize_batch(w, hessian, bits=4, group=32)
    for e, got in enumerate(batch):
        alone = gptq_quantize(w[e], hessian[e], bits=4, group=32)
        assert torch.equal(got.packed, alone.packed) and torch.equal(got.scales, alone.scales), e
    with pytest.raises(ConfigError, match=r"\[E, N, K\]"):
        gptq_quantize_batch(w, hessian[:, :32, :32])


def test_gptq_quantize_experts_uses_both_hessians() -> None:
    gate, up, down = make_experts(2, 32, 64)
    x = correlated_activations(256, 64, seed=4)
    mid = correlated_activations(256, 32, seed=5)
    h_in = torch.stack([x.T.double() @ x.double()] * 2)
    h_mid = torch.stack([mid.T.double() @ mid.double()] * 2)
    qe = gptq_quantize_experts(gate, up, down, h_in, h_mid, bits=4, group=32)
    gate_q, _, down_q = qe.dequantize_experts()
    rtn_gate, _, rtn_down = quantize_experts(gate, up, down, 4, 32).dequantize_experts()
    assert (x @ (gate[0] - gate_q[0]).T).norm() < (x @ (gate[0] - rtn_gate[0]).T).norm()
    assert (mid @ (down[1] - down_q[1]).T).norm() < (mid @ (down[1] - rtn_down[1]).T).norm()
    with pytest.raises(ConfigError, match="Hessians"):
        gptq_quantize_experts(gate, up, down, h_mid, h_in, bits=4, group=32)


def hard_hessians(experts: int, k: int, seed: int) -> torch.Tensor:
    """[E, K, K] calibration Hessians with every special case: dead inputs, a rank-one H, one indefinite enough that
    the first damping fails (so its expert is factored on a later try than the others), and an empty H."""
    hessians = []
    for e in range(experts):
        x = correlated_activations(2 * k, k, seed=100 * seed + e)
        if e % 5 == 1:
            x[:, :3] = 0  # inputs never seen
        if e % 5 == 2:
            x = x[:, :1].repeat(1, k)  # rank one: near-singular
        h = x.T.double() @ x.double()
        if e % 5 == 3:  # the smallest eigenvalue pushed below -ridge: needs 10x the damping
            eigenvalues, vectors = torch.linalg.eigh(h)
            ridge = 0.01 * h.diagonal().mean()
            h -= (eigenvalues[0] + 5 * ridge) * torch.outer(vectors[:, 0], vectors[:, 0])
        hessians.append(h if e % 5 != 4 else torch.zeros(k, k, dtype=torch.float64))
    return torch.stack(hessians)


def test_gptq_chunks_give_the_codes_of_one_batch() -> None:
    """The experts of a layer quantized 1, 3 or all at a time get identical codes and scales: chunking never mixes
    experts, and an expert that needs more damping is damped alone whichever chunk it falls in."""
    from specter.quant.gptq import gptq_quantize_batch

    hessian = hard_hessians(7, 64, seed=1)
    first_try = hessian[3] + 0.01 * hessian[3].diagonal().mean() * torch.eye(64, dtype=torch.float64)
    assert torch.linalg.cholesky_ex(first_try).info != 0  # the retry path really runs
    w = torch.randn(7, 24, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    whole = gptq_quantize_batch(w, hessian, bits=4, group=32, chunk=7)
    assert len(whole) == 7 and whole[0].scales.dtype == torch.bfloat16
    for chunk in (1, 3, None):
        chunked = gptq_quantize_batch(w, hessian, bits=4, group=32, chunk=chunk)
        for e, (got, want) in enumerate(zip(chunked, whole, strict=True)):
            assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales), (chunk, e)
    with pytest.raises(ConfigError, match="positive"):
        gptq_quantize_batch(w, hessian, group=32, chunk=0)


def test_gptq_chunk_size_follows_the_memory_budget() -> None:
    from specter.quant.gptq import GPTQ_WORKING_BYTES, experts_per_chunk, gptq_bytes_per_expert

    per_expert = gptq_bytes_per_expert(2816, 2048)  # Qwen1.5-MoE gate/up: the inverse's [K, K] temporaries dominate
    assert 0.2e9 < per_expert < 0.3e9
    assert experts_per_chunk(60, 2816, 2048, "cpu") == 60 and 60 * per_expert <= GPTQ_WORKING_BYTES  # one chunk
    assert experts_per_chunk(60, 2816, 2048, "cpu", budget=36 * per_expert) == 30  # evened out: 30 + 30, not 36 + 24
    assert experts_per_chunk(60, 2816, 2048, "cpu", budget=per_expert - 1) == 1
    assert experts_per_chunk(3, 2816, 2048, "cpu", budget=100 * per_expert) == 3


def test_gptq_stays_on_the_cpu_for_cpu_weights() -> None:
    from specter.quant.gptq import gptq_quantize_batch

    q = gptq_quantize_batch(torch.randn(2, 8, 32), hard_hessians(2, 32, seed=2), bits=4, group=32)
    assert all(t.packed.device.type == "cpu" and t.scales.device.type == "cpu" for t in q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_on_cuda_gives_the_cpu_codes() -> None:
    """CUDA weights are quantized on the GPU (float64 there too) to the CPU's codes. The GPU orders float64 sums
    differently (matmuls, Cholesky, the ridge's mean), so a value could in principle land on the other side of a
    float32 rounding boundary and flip one code, and the error feedback then changes later codes of that row only
    (rows are independent): allow at most 1 % of rows to differ, and nothing at all in the scales of other rows."""
    from specter.quant.gptq import gptq_quantize_batch

    hessian = hard_hessians(10, 256, seed=3)
    w = torch.randn(10, 64, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    on_cpu = gptq_quantize_batch(w, hessian, bits=4, group=128)
    on_cuda = gptq_quantize_batch(w.cuda(), hessian, bits=4, group=128, chunk=4)  # H on the CPU: moved to w's device
    assert all(q.packed.device.type == "cuda" and q.scales.device.type == "cuda" for q in on_cuda)
    rows = torch.cat([(a.packed.cpu() != b.packed).any(dim=1) for a, b in zip(on_cuda, on_cpu, strict=True)])
    scale_rows = torch.cat([(a.scales.cpu() != b.scales).any(dim=0) for a, b in zip(on_cuda, on_cpu, strict=True)])
    assert rows.float().mean() <= 0.01, f"{int(rows.sum())} of {rows.numel()} rows differ"
    assert not (scale_rows & ~rows).any()  # a scale differs only in a row whose codes differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_draft_built_on_cuda_from_a_stream_keeps_no_reserve_beyond_its_bytes() -> None:
    """The draft's layers are allocated before the stream's temporaries (a widened load builds each expert through
    float64 copies on the device): once they are freed and the cache emptied, the reserve is the draft's bytes (and
    whatever was live before), not segments its tensors pinned. The control builds the same layers the way the draft
    did before, stacking each layer's results after its temporaries, to show that the stream does fragment a reserve."""
    from specter.config import DraftConfig
    from specter.draft import quantize_layers
    from specter.quant.groupwise import stack_experts

    num_layers, num_experts, inter, hidden = 6, 16, 3200, 2048
    bf16, cuda = torch.bfloat16, torch.device("cuda")

    def stream():
        for layer in range(num_layers):
            for e in range(num_experts):
                wide = torch.randn(3 * inter * hidden, dtype=torch.float64, device=cuda)
                yield layer, e, (wide * 0.02).to(bf16)
                del wide

    def excess(build) -> tuple[int, int]:
        # Measured against the reserve beyond live tensors before the build: tensors earlier tests left alive can pin
        # segments the cache cannot return, and those are not the build's.
        torch.cuda.empty_cache()
        live, before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        built = build()
        torch.cuda.empty_cache()
        stats = torch.cuda.memory_stats()
        kept = sum(q.nbytes for q in built.values())
        assert stats["allocated_bytes.all.current"] - live >= kept
        return stats["reserved_bytes.all.current"] - stats["allocated_bytes.all.current"] - before, kept

    def stacked() -> dict:  # the draft before: each layer's results stacked after its temporaries
        layers, pending = {}, {}
        for layer, e, flat in stream():
            pending.setdefault(layer, []).append(flat)
            if len(pending[layer]) == num_experts:
                w13 = [quantize(f[: 2 * inter * hidden].view(2 * inter, hidden), 4, 128) for f in pending[layer]]
                w2 = [quantize(f[2 * inter * hidden :].view(hidden, inter), 4, 128) for f in pending.pop(layer)]
                layers[layer] = stack_experts(w13, w2)
        return layers

    config = DraftConfig(quant="int4", group_size=128)
    free, draft_bytes = excess(lambda: quantize_layers(stream(), hidden, inter, num_experts, config, cuda,
                                                       layers=range(num_layers), dtype=bf16))
    control, control_bytes = excess(stacked)
    assert control_bytes == draft_bytes
    print(f"draft {draft_bytes / 2**20:.0f} MiB; reserve beyond live tensors the build added: {free / 2**20:.1f} MiB, control {control / 2**20:.1f}")
    assert free <= 32 * 2**20, f"{free / 2**20:.0f} MiB reserved beyond live tensors after the draft's build"
    assert control > 4 * free + 64 * 2**20, f"control {control / 2**20:.0f} MiB, draft {free / 2**20:.0f} MiB"
