"""Exact mode: a forward over T rows gives bit-identical logits and KV to T one-row steps."""

from __future__ import annotations

import pytest
import torch

from specter.config import EngineConfig
from specter.decode import run_sync
from specter.build import load_resident
from tests.hf_models import FAMILIES, hf_model, save_hf

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def rows_vs_steps(loaded, prefix: list[int], block: list[int]):
    model, experts = loaded.model, loaded.experts
    kv_block, kv_steps = model.new_kv(), model.new_kv()
    for kv in (kv_block, kv_steps):
        run_sync(model.forward(torch.tensor(prefix, device=model.device), 0, kv, experts))
    start = len(prefix)
    block_logits = model.logits(run_sync(model.forward(torch.tensor(block, device=model.device), start, kv_block, experts)))
    step_logits = torch.cat([
        model.logits(run_sync(model.forward(torch.tensor([tok], device=model.device), start + i, kv_steps, experts)))
        for i, tok in enumerate(block)
    ])
    end = start + len(block)
    return block_logits, step_logits, (kv_block.k[:, :, :end], kv_steps.k[:, :, :end]), (kv_block.v[:, :, :end], kv_steps.v[:, :, :end])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_forward_is_bit_identical_to_single_steps(family, dtype, device, tmp_path):
    path = save_hf(hf_model(family), tmp_path / family)
    loaded = load_resident(path, EngineConfig(device=device, dtype=dtype, max_context=96, row_bucket=8))
    for size in (2, 5, 9, 17):  # inside one bucket, exactly across buckets, and spanning three
        block_logits, step_logits, keys, values = rows_vs_steps(loaded, [1, 2, 3, 4, 5, 6], list(range(10, 10 + size)))
        assert torch.equal(block_logits, step_logits), f"logits differ for {size} rows"
        assert torch.equal(*keys) and torch.equal(*values), f"KV differs for {size} rows"


def test_non_exact_mode_runs_and_stays_close(tmp_path):
    path = save_hf(hf_model("qwen2_moe"), tmp_path / "m")
    exact = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=64))
    fast = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=64, exact=False))
    tokens = [5, 9, 11, 40, 2, 77, 31]
    a = exact.model.logits(run_sync(exact.model.forward(torch.tensor(tokens), 0, exact.model.new_kv(), exact.experts)))
    b = fast.model.logits(run_sync(fast.model.forward(torch.tensor(tokens), 0, fast.model.new_kv(), fast.experts)))
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
