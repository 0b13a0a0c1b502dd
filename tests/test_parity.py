"""Specter's target forward against Hugging Face transformers on tiny random checkpoints of every family."""

from __future__ import annotations

import pytest
import torch

from specter.config import EngineConfig
from specter.decode import greedy_decode, run_sync
from specter.build import load_resident
from tests.hf_models import FAMILIES, hf_model, save_fused, save_hf

PROMPT = [3, 17, 42, 5, 88, 12, 7, 60]


def specter_logits(loaded, tokens: list[int]) -> torch.Tensor:
    model = loaded.model
    kv = model.new_kv()
    hidden = run_sync(model.forward(torch.tensor(tokens), 0, kv, loaded.experts))
    return model.logits(hidden)


@pytest.mark.parametrize("layout", ["single", "sharded", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(family, layout, tmp_path):
    hf = hf_model(family)
    save = {"single": save_hf, "sharded": lambda m, p: save_hf(m, p, sharded=True), "fused": save_fused}[layout]
    path = save(hf, tmp_path / family)
    if layout == "sharded":
        assert (path / "model.safetensors.index.json").exists()
    loaded = load_resident(path, EngineConfig(device="cpu", dtype="float32", max_context=128))
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    got = specter_logits(loaded, PROMPT)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item()), (got - expected).abs().max()

    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    ours = run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 32))
    assert ours == hf_tokens
