"""KernelTiers: the one place a Transformer's products pick torch's ops, a fused Triton launch or the one-row kernels,
chosen once from EngineConfig.tuning.kernels, the forward's exactness, the device and the family's declaration."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specter.config import KernelTuning, RowTiles
from specter.model import fused
from specter.model.tiers import KernelTiers
from specter.model.transformer import FamilySpec

CPU = torch.device("cpu")
FIELDS = [field.name for field in dataclasses.fields(KernelTiers) if field.name not in ("merge_in_launch", "row")]
DRAFT = set(FIELDS) - {"exact_attention"}  # every tier but the exact forward's own


def choose(kernels: KernelTuning | None = None, exact: bool = False, family: FamilySpec | None = FamilySpec(),
           fused_ok: bool = True, monkeypatch: pytest.MonkeyPatch | None = None) -> KernelTiers:
    assert monkeypatch is not None
    monkeypatch.setattr(fused, "usable_on", lambda device: fused_ok)  # as on CUDA (or under the interpreter), or not
    return KernelTiers.choose(kernels or KernelTuning(), exact=exact, device=CPU, family=family)


def chosen(tiers: KernelTiers) -> set[str]:
    return {name for name in FIELDS if getattr(tiers, name)}


def test_the_exact_forward_runs_torchs_ops_by_default(monkeypatch):
    assert chosen(choose(exact=True, monkeypatch=monkeypatch)) == set()


def test_exact_rowwise_gives_the_exact_forward_the_row_wise_launches_only(monkeypatch):
    """kernels.exact_rowwise: the norm, rope and router launches compute each row on its own, so the exact forward may
    take them, and every row's attention over its visible positions; the packed products, the one-row kernels and
    the draft's one-row attention with its merge counters stay the draft's."""
    rowwise = KernelTuning(exact_rowwise=True)
    assert chosen(choose(rowwise, exact=True, monkeypatch=monkeypatch)) == {"norm", "rope", "router", "exact_attention"}
    assert chosen(choose(rowwise.model_copy(update={"router_and_gate": False}), exact=True, monkeypatch=monkeypatch)) == {
        "norm", "rope", "exact_attention"}
    assert chosen(choose(rowwise, exact=True, fused_ok=False, monkeypatch=monkeypatch)) == set()  # no Triton: torch's
    assert chosen(choose(rowwise, monkeypatch=monkeypatch)) == DRAFT  # the draft's tiers do not change
    assert chosen(choose(rowwise, exact=True, family=None, monkeypatch=monkeypatch)) == set()  # an undeclared class


def test_the_draft_takes_every_tier_where_triton_runs(monkeypatch):
    tiers = choose(monkeypatch=monkeypatch)
    assert chosen(tiers) == DRAFT and tiers.merge_in_launch and tiers.row == RowTiles()


def test_without_triton_the_draft_keeps_only_its_packed_torch_products(monkeypatch):
    assert chosen(choose(fused_ok=False, monkeypatch=monkeypatch)) == {"residual_addend", "packed_qkv", "packed_ffn_input"}


@pytest.mark.parametrize("switch, lost", [
    ("row_kernels", {"row_kernels", "row_moe"}),
    ("router_and_gate", {"router", "packed_ffn_input", "row_moe"}),  # torch's router: the MoE layer is not fused at all
    ("decode_attention", {"decode_attention"}),
    ("rope_writes_cache", {"rope_writes_cache"}),
    ("packed_qkv", {"packed_qkv"}),
    ("packed_ffn_input", {"packed_ffn_input"}),
    ("residual_addend", {"residual_addend"}),
])
def test_each_switch_turns_off_its_own_tier(monkeypatch, switch, lost):
    tiers = choose(KernelTuning(**{switch: False}), monkeypatch=monkeypatch)
    assert chosen(tiers) == DRAFT - lost


@pytest.mark.parametrize("family, rows, row_moe", [
    (None, False, False),  # a class that declares nothing: no one-row kernels
    (FamilySpec(norm="layer", routing="sparsemixer"), False, False),  # Phi-MoE's LayerNorm
    (FamilySpec(attention="mla", routing="group_limited"), True, False),  # DeepSeek: its own routing
    (FamilySpec(), True, True),
])
def test_the_one_row_kernels_follow_the_familys_declaration(monkeypatch, family, rows, row_moe):
    tiers = choose(family=family, monkeypatch=monkeypatch)
    assert (tiers.row_kernels, tiers.row_moe) == (rows, row_moe)


def test_one_row_asks_for_one_row(monkeypatch):
    tiers = choose(monkeypatch=monkeypatch)
    assert tiers.one_row(torch.zeros(1, 8)) and tiers.one_row_moe(torch.zeros(1, 8))
    assert not tiers.one_row(torch.zeros(2, 8)) and not tiers.one_row_moe(torch.zeros(2, 8))


def test_a_model_chooses_its_tiers_once_from_the_kernels_it_was_built_with(tiny):
    """The tiers are the model's, chosen at construction from EngineConfig.tuning.kernels; the kernels stay as given
    (a forward with other kernels is another Transformer over the same weights)."""
    from specter.build import load_resident
    from specter.config import EngineConfig

    kernels = KernelTuning(residual_addend=False, row=RowTiles(block_k=1024))
    for exact in (True, False):
        model = load_resident(tiny, EngineConfig(device="cpu", exact=exact, tuning={"kernels": kernels})).model
        assert model.kernels is not None and model.kernels == kernels
        assert model.tiers == KernelTiers.choose(kernels, exact=exact, device=model.device, family=type(model).family)
        assert model.tiers.row.block_k == 1024 and not model.tiers.residual_addend
        with pytest.raises(AttributeError):
            model.kernels = KernelTuning()  # type: ignore[misc]
