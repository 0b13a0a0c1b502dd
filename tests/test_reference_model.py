"""benchmarks/reference_model.py --shape (issue 28): narrow full-depth real shapes trained with each router's balance loss.

What is checked: every family's model has one balance loss per MoE layer, non-zero and with a gradient into its router
(DeepSeek-V2's per sequence, which transformers lacks); the loss formula on hand-made routing (1 when balanced, E when
each sequence sends every token to one expert); a few steps lower the loss; the --tiny CLI run writes a checkpoint that
specter loads, train.json with the held-out loss and held_out.json, and its widened copy computes the narrow function.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from specter.bench.widen import DEFAULT_FACTORS, WidenedCheckpoint  # noqa: E402
from specter.config import EngineConfig  # noqa: E402
from specter.decode import run_sync  # noqa: E402
from specter.build import load_resident  # noqa: E402
from specter.build import CheckpointWeights  # noqa: E402
from specter.model.checkpoint import Checkpoint  # noqa: E402
from specter.model.registry import transformer_for  # noqa: E402
from specter.model.resident import ResidentExperts  # noqa: E402
from specter.model.weights import iter_experts, load_dense  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = sorted(DEFAULT_FACTORS)


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("reference_model", ROOT / "benchmarks" / "reference_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_model"] = module
    spec.loader.exec_module(module)
    return module


def small_config(trainer, shape: str) -> dict:
    """The tiny narrow config with thin experts and one head-dim's worth of width fields (fast, mechanics only)."""
    config = trainer.shape_config(shape, tiny=True)
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(field):
            config[field] = 32
    return config


def batch(length: int = 16, rows: int = 2) -> torch.Tensor:
    text = (ROOT / "specter" / "engine.py").read_bytes()[: rows * (length + 1)]
    return torch.tensor(list(text)).reshape(rows, length + 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_family_has_a_non_zero_balance_loss_per_moe_layer(trainer, shape, one_thread):
    config = small_config(trainer, shape)
    torch.manual_seed(0)
    model = trainer.make_shape_model(config, torch.device("cpu"))
    experts = trainer.num_experts_of(config)
    balance = trainer.BalanceLoss(model, config["model_type"], config["num_experts_per_tok"], experts)
    dense = config.get("first_k_dense_replace", 0)
    assert len(balance.routers) == config["num_hidden_layers"] - dense, [name for name, _ in balance.routers]
    assert balance.coef == trainer.BALANCE_COEF[config["model_type"]] > 0
    assert balance.per_sequence == (config["model_type"] == "deepseek_v2")
    loss, aux = trainer.balanced_loss(model, batch(), balance)
    assert aux > 0 and torch.isfinite(loss)
    per_layer = balance.layer_losses()
    assert per_layer.shape == (len(balance.routers),) and bool((per_layer >= 0.99).all()), per_layer  # >= 1 up to rounding
    balance.loss().backward()
    for name, router in balance.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, f"no gradient into {name}"
    balance.close()


def test_the_balance_loss_on_hand_made_routing(trainer):
    """Two sequences, E = 4, top-1: each sequence sends all its tokens to its own expert (0 and 1)."""
    experts = 4

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(experts, experts, bias=False)

    def losses(family: str, x: torch.Tensor, weight: torch.Tensor) -> float:
        layer = Layer()
        layer.gate.weight.data.copy_(weight)
        balance = trainer.BalanceLoss(layer, family, 1, experts)
        balance.start(*x.shape[:2])
        layer.gate(x)
        return float(balance.layer_losses()[0])

    x = torch.zeros(2, 5, experts)
    x[0, :, 0] = x[1, :, 1] = 1.0
    decisive = 50.0 * torch.eye(experts)  # probabilities one-hot up to e^-50
    assert losses("deepseek_v2", x, decisive) == pytest.approx(experts, rel=1e-6)  # per sequence: all on one expert
    assert losses("mixtral", x, decisive) == pytest.approx(experts / 2, rel=1e-6)  # the batch: half on each of two
    assert losses("deepseek_v2", x, torch.zeros(experts, experts)) == pytest.approx(1.0)  # uniform probabilities: 1
    assert losses("qwen2_moe", torch.randn(2, 5, experts), torch.zeros(experts, experts)) == pytest.approx(1.0)


def test_a_few_steps_lower_the_loss(trainer, one_thread):
    config = small_config(trainer, "deepseek-v2-lite")
    torch.manual_seed(0)
    model = trainer.make_shape_model(config, torch.device("cpu"))
    balance = trainer.BalanceLoss(model, "deepseek_v2", config["num_experts_per_tok"], trainer.num_experts_of(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, losses = batch(), []
    for _ in range(8):
        loss, _ = trainer.balanced_loss(model, tokens, balance)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("shape, write_wide", [("qwen1.5-moe-a2.7b", False), ("deepseek-v2-lite", True)])
def test_tiny_run_saves_a_checkpoint_specter_loads_and_widens_exactly(trainer, shape, write_wide, tmp_path, one_thread):
    out, wide = tmp_path / "narrow", tmp_path / "wide"
    widen = ["--widen", str(wide)] if write_wide else []
    assert trainer.main(["--shape", shape, "--tiny", "--max-steps", "3", "--length", "16", "--log-every", "1",
                         "--device", "cpu", "--out", str(out), *widen]) == 0
    record = json.loads((out / "train.json").read_text())
    factor = record["factor"]
    assert record["shape"] == shape and record["training"]["steps"] == 3 and record["training"]["tokens_per_s"] > 0
    assert 0 < record["training"]["held_out_loss"] < 8 and record["training"]["last_balance_loss"] > 0
    assert len(json.loads((out / "held_out.json").read_text())["windows"]) == trainer.HELD_OUT_WINDOWS
    assert (out / "prompts.json").is_file() and (wide / "held_out.json").is_file() == write_wide
    spec = Checkpoint(out).spec
    assert spec.num_layers == 2 and spec.num_experts == trainer.num_experts_of(record["narrow_config"])

    tokens = torch.tensor(json.loads((out / "held_out.json").read_text())["windows"][0][:12])
    narrow_logits = logits_of(load_resident(out, EngineConfig(device="cpu", dtype="float32", max_context=64)), tokens)
    written = [Checkpoint(wide)] if write_wide else []
    for source in (*written, WidenedCheckpoint(out, factor)):  # written by --widen, and widened on the fly
        assert source.spec.hidden_size == factor * spec.hidden_size
        wide_logits = logits_of(resident(source), tokens)
        gap = ((wide_logits - narrow_logits).abs().max() / narrow_logits.abs().max()).item()
        assert gap < 2e-2, gap  # --widen writes bfloat16 (the real bytes); WidenedCheckpoint keeps float32 here
    assert trainer.main(["--shape", shape, "--tiny", "--max-steps", "3", "--length", "16", "--device", "cpu",
                         "--out", str(out), "--reuse"]) == 0  # a finished run of these settings is kept


def resident(checkpoint):
    """A checkpoint-like source loaded as load_resident does, in float32."""
    dense = load_dense(checkpoint, torch.float32, torch.device("cpu"), progress=False)
    model = transformer_for(checkpoint.spec)(checkpoint.spec, dense, max_context=64)
    experts = ResidentExperts.from_iter(iter_experts(checkpoint, torch.float32, progress=False), checkpoint.spec.num_experts,
                                        torch.device("cpu"))
    return type("Loaded", (), {"model": model, "experts": experts})


def logits_of(loaded, tokens: torch.Tensor) -> torch.Tensor:
    model = loaded.model
    return model.logits(run_sync(model.forward(tokens, 0, model.new_kv(), loaded.experts)))


def test_checkpoint_weights_read_the_widened_run(trainer, tmp_path, one_thread):
    """The bench's way in: CheckpointWeights(WidenedCheckpoint(DIR, F)) has the real shape's width."""
    out = tmp_path / "narrow"
    trainer.main(["--shape", "olmoe-1b-7b", "--tiny", "--max-steps", "1", "--length", "16", "--device", "cpu", "--out", str(out)])
    factor = json.loads((out / "train.json").read_text())["factor"]
    source = CheckpointWeights(WidenedCheckpoint(out, factor))
    assert source.spec.hidden_size == 2048 and source.spec.num_experts == trainer.TINY_EXPERTS


def test_reuse_keeps_only_a_run_of_the_same_settings_and_says_what_differs(trainer, tmp_path, capsys):
    """--reuse: a finished run of the asked settings is kept; one of other settings (a call that asked for other
    minutes) is trained again, and the log says which settings differ."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.json").write_text(json.dumps({"shape": "mixtral-8x7b", "minutes": 2.5, "batch": 32}))
    assert trainer._finished(tmp_path, {"shape": "mixtral-8x7b", "minutes": 2.5, "batch": 32})
    assert capsys.readouterr().out == ""
    assert not trainer._finished(tmp_path, {"shape": "mixtral-8x7b", "minutes": 3, "batch": 32})
    assert "minutes 2.5 there, 3 asked" in capsys.readouterr().out
    assert not trainer._finished(tmp_path / "missing", {"shape": "mixtral-8x7b"})


def test_a_run_of_max_steps_does_not_depend_on_the_machines_speed(trainer, tmp_path, one_thread, monkeypatch):
    """With --max-steps the learning rate's cosine runs over the steps, not the minutes: the same steps on a machine
    ten times slower (its clock, here) train the same weights. Without it the rate follows the clock."""
    import itertools
    from safetensors.torch import load_file

    def run(name: str, seconds_per_call: float, steps: bool) -> dict[str, torch.Tensor]:
        ticks = itertools.count()
        monkeypatch.setattr(trainer.time, "monotonic", lambda: next(ticks) * seconds_per_call)
        out = tmp_path / name
        length = ["--max-steps", "4"] if steps else []  # else a tiny run's default 20 steps, over the minutes
        assert trainer.main(["--shape", "qwen1.5-moe-a2.7b", "--tiny", *length, "--minutes", "10", "--length", "16",
                             "--device", "cpu", "--out", str(out)]) == 0
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}

    fast, slow = run("fast", 0.01, True), run("slow", 0.1, True)
    assert fast.keys() == slow.keys() and all(torch.equal(fast[k], slow[k]) for k in fast)
    fast, slow = run("fast-minutes", 0.01, False), run("slow-minutes", 5.0, False)
    assert any(not torch.equal(fast[k], slow[k]) for k in fast)


def test_recomputed_layers_train_the_same_weights_and_keep_one_routing_per_layer(trainer, tmp_path, one_thread):
    """--recompute-layers N: the first N layers' forward runs again in the backward pass (activation checkpointing,
    for GPU memory); the weights equal those of a run without it, and the balance loss still reads each router once
    a forward (the recomputation would otherwise add its routers' inputs a second time)."""
    from safetensors.torch import load_file

    def run(name: str, recompute: int) -> dict[str, torch.Tensor]:
        out = tmp_path / name
        assert trainer.main(["--shape", "qwen3-30b-a3b", "--tiny", "--max-steps", "3", "--length", "16", "--device",
                             "cpu", "--recompute-layers", str(recompute), "--out", str(out)]) == 0
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}

    plain, recomputed = run("plain", 0), run("recomputed", 2)
    assert plain.keys() == recomputed.keys()
    assert all(torch.allclose(plain[k], recomputed[k], rtol=0, atol=1e-6) for k in plain), "recomputation changed the weights"

    config = small_config(trainer, "qwen3-30b-a3b")
    model = trainer.make_shape_model(config, torch.device("cpu"))
    trainer.recompute_activations(model, len(model.model.layers))
    balance = trainer.BalanceLoss(model, "qwen3_moe", config["num_experts_per_tok"], trainer.num_experts_of(config))
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    loss, _ = trainer.balanced_loss(model, batch(), balance)
    loss.backward()
    assert len(calls) == 2, "the layer's forward did not run again in the backward pass"
    assert len(balance.inputs) == len(balance.routers)
    assert all(p.grad is not None for _, router in balance.routers for p in router.parameters())
    with pytest.raises(SystemExit, match="decoder layers"):
        trainer.recompute_activations(model, len(model.model.layers) + 1)
