"""Packed projections: at load, each layer's q/k/v weights (and biases) become consecutive views of one tensor, so
the draft runs one product where the target runs three, on the target's own storage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specter.config import DraftConfig, EngineConfig
from specter.engine import Runtime
from specter.model import transformer as transformer_module
from specter.model.transformer import pack_projections, packed_projections
from tests.hf_models import hf_model, save_hf

NAMES = ("q_proj", "k_proj", "v_proj")
FULL = [f"p.{name}" for name in NAMES]


def projections(bias: bool = True, rows=(8, 4, 4), width: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    w = {f"p.{name}.weight": torch.randn(n, width, generator=generator) for name, n in zip(NAMES, rows)}
    if bias:
        w.update({f"p.{name}.bias": torch.randn(n, generator=generator) for name, n in zip(NAMES, rows)})
    w["other.weight"] = torch.randn(3, 3, generator=generator)
    return w


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [(8, 4, 4), (8, 4, 3)])  # 16 rows, or 15 padded to 16 (PACK_ROWS)
def test_packing_keeps_every_value_and_makes_views_of_one_tensor(bias, rows):
    w = projections(bias, rows)
    before = {name: t.clone() for name, t in w.items()}
    pack_projections(w, FULL)
    assert w.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(w[name], tensor), name
    weight, packed_bias, sizes = packed_projections(w, FULL)
    total = sum(rows)
    assert sizes == rows and weight.shape == (16, 6)
    assert all(w[f"p.{n}.weight"].untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for n in NAMES)
    assert torch.equal(weight[:total], torch.cat([before[f"p.{n}.weight"] for n in NAMES]))
    assert not weight[total:].any()  # the padding rows are zeros
    if bias:
        assert packed_bias.shape == (16,) and not packed_bias[total:].any()
        assert torch.equal(packed_bias[:total], torch.cat([before[f"p.{n}.bias"] for n in NAMES]))
    else:
        assert packed_bias is None
    x = torch.randn(3, 6)
    q, k, v = F.linear(x, weight, packed_bias)[:, :total].split(sizes, dim=-1)
    for name, part in zip(NAMES, (q, k, v)):
        expected = F.linear(x, before[f"p.{name}.weight"], before.get(f"p.{name}.bias"))
        torch.testing.assert_close(part, expected)
    # a second packing leaves the packed tensor alone (the draft's construction on the target's dict)
    pack_projections(w, FULL)
    assert packed_projections(w, FULL)[0].data_ptr() == weight.data_ptr()


def test_no_packing_when_the_projections_do_not_fit_together():
    missing = projections()
    del missing["p.k_proj.weight"]
    partial_bias = projections()
    del partial_bias["p.v_proj.bias"]
    widths = projections()
    widths["p.v_proj.weight"] = torch.randn(4, 7)
    dtypes = projections()
    dtypes["p.q_proj.weight"] = dtypes["p.q_proj.weight"].double()
    for w in (missing, partial_bias, widths, dtypes):
        originals = dict(w)
        pack_projections(w, FULL)
        assert all(w[name] is tensor for name, tensor in originals.items())
        assert packed_projections(w, FULL) is None
    # separate tensors that merely sit side by side are not taken for packed ones
    assert packed_projections(projections(), FULL) is None


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
@pytest.mark.parametrize("pack_rows", [16, 48])  # 48: the packed tensors end in padding rows
def test_the_draft_projects_once_on_the_targets_packed_storage(family, pack_rows, tmp_path, monkeypatch):
    """qwen2_moe has q/k/v biases, olmoe normalises q and k after the product: the draft's one product gives what
    the target's three give, and the target (exact) still runs its own three."""
    monkeypatch.setattr(transformer_module, "PACK_ROWS", pack_rows)
    path = save_hf(hf_model(family, seed=7), Path(tmp_path) / family)

    async def go():
        runtime = await Runtime.load(str(path), EngineConfig(device="cpu", max_context=64, residents=3, draft=DraftConfig(k=2)))
        try:
            target, draft = runtime.model, runtime.draft.model
            prefix = f"{target.spec.layer_prefix(0)}.self_attn"
            weight, _, sizes = packed_projections(target.w, [f"{prefix}.{name}" for name in NAMES])
            rows = sum(target.w[f"{prefix}.{name}.weight"].shape[0] for name in NAMES)
            assert sum(sizes) == rows and weight.shape[0] == rows + -rows % pack_rows
            x = torch.randn(3, target.spec.hidden_size, dtype=target.dtype)
            positions = torch.arange(5, 8)
            shapes: list[tuple[int, ...]] = []
            linear = F.linear

            def counting(inp, w, b=None):
                shapes.append(tuple(w.shape))
                return linear(inp, w, b)

            monkeypatch.setattr(transformer_module.F, "linear", counting)
            drafted = draft._qkv(0, prefix, x, positions)
            assert shapes == [tuple(weight.shape)]
            shapes.clear()
            targeted = target._qkv(0, prefix, x, positions)
            assert len(shapes) == 3 and tuple(weight.shape) not in shapes
            for got, expected in zip(drafted, targeted):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            monkeypatch.setattr(transformer_module.F, "linear", linear)  # (PACK_ROWS stays patched for the pack below)
            # the MoE layer's inputs: router, shared gate, shared gate and up in one product (Qwen2-MoE's layout only)
            layer = min(target.spec.moe_layers)
            packed = draft.packed_ffn_input(layer)
            assert target.packed_ffn_input(layer) is None  # the exact target never takes it
            if family != "qwen2_moe":
                assert packed is None
                return
            assert packed is not None and packed[0].shape[0] % pack_rows == 0
            h, residual, routed = (torch.randn(3, target.spec.hidden_size, dtype=target.dtype) for _ in range(3))
            ids, weights, product = draft.packed_route(layer, h, packed)
            _, expected_ids, expected_weights = target.route(layer, h)
            assert torch.equal(ids, expected_ids)
            torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
            got = draft.packed_finish(layer, residual, routed, product)
            torch.testing.assert_close(got, residual + routed + target.shared_expert(layer, h), rtol=1e-5, atol=1e-5)
        finally:
            await runtime.aclose()

    asyncio.run(go())
