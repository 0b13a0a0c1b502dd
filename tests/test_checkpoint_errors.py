"""Bad checkpoints fail with a CheckpointError naming the file and tensor and saying what was expected."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specter.config import EngineConfig
from specter.errors import CheckpointError, SpecterError
from specter.build import load_resident
from tests.hf_models import hf_model, rewrite_config, save_hf

CPU = EngineConfig(device="cpu", max_context=64)


@pytest.fixture
def ckpt(tmp_path):
    return save_hf(hf_model("qwen3_moe"), tmp_path / "m")


def edit_tensors(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))


def expect(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_resident(path, CPU)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert isinstance(info.value, SpecterError)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    expect(ckpt, "model.layers.1.self_attn.k_proj.weight", "missing")


def test_missing_expert_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.4.down_proj.weight"))
    expect(ckpt, "model.layers.2.mlp.experts.4.down_proj.weight", "missing")


def test_wrong_shape(ckpt):
    def shrink(t):
        t["model.layers.0.mlp.gate.weight"] = t["model.layers.0.mlp.gate.weight"][:3]
    edit_tensors(ckpt, shrink)
    expect(ckpt, "model.safetensors", "model.layers.0.mlp.gate.weight", "shape [3, 32]", "expected [6, 32]")


def test_wrong_dtype(ckpt):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    edit_tensors(ckpt, to_int)
    expect(ckpt, "model.norm.weight", "torch.int32", "expected float32, float16 or bfloat16")


def test_truncated_file(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    expect(ckpt, "model.safetensors", "truncated")


def test_corrupt_header(ckpt):
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"not json!!!!"
    file.write_bytes(bytes(data))
    expect(ckpt, "model.safetensors", "corrupt")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    expect(ckpt, "config.json", "missing")


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect(ckpt, "config.json", "not valid JSON")


NESTED = "[" * 100_000 + "]" * 100_000  # the JSON decoder recurses per level: a RecursionError, no ValueError


def test_a_config_nested_too_deeply_is_not_valid_json(ckpt):
    (ckpt / "config.json").write_text(NESTED)
    expect(ckpt, "config.json", "not valid JSON", "nested too deeply")


def test_a_shard_index_nested_too_deeply_is_malformed(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(NESTED)
    expect(ckpt, "model.safetensors.index.json", "malformed shard index")


def test_unknown_model_type_lists_supported(ckpt):
    rewrite_config(ckpt, model_type="llama")
    expect(ckpt, "'llama'", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


def test_a_config_json_that_is_a_directory_is_named_as_one(ckpt):
    """It was reported "missing", sending the user to look for a file that is there, as a folder."""
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    expect(ckpt, "config.json: a directory, not the model's JSON configuration")


def test_missing_config_field(ckpt):
    rewrite_config(ckpt, hidden_size=None)
    expect(ckpt, "config.json", "'hidden_size'", "missing")


def test_wrongly_typed_config_field(ckpt):
    rewrite_config(ckpt, num_hidden_layers="three")
    expect(ckpt, "'num_hidden_layers'", "int")


def test_more_experts_than_config(ckpt):
    rewrite_config(ckpt, num_experts=5)
    expect(ckpt, "experts.5", "declares only 5 experts")


def test_more_layers_than_config(ckpt):
    """A config.json declaring fewer layers than the weights hold ran the model cut short, the rest unread."""
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    assert layers > 1
    rewrite_config(ckpt, num_hidden_layers=layers - 1)
    expect(ckpt, f"model.layers.{layers - 1}.input_layernorm.weight", f"declares only {layers - 1} layers")


def test_pickle_checkpoint_refused(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "mixtral", "hidden_size": 8, "vocab_size": 8, "num_hidden_layers": 1,
                                                 "num_attention_heads": 2, "num_local_experts": 2, "num_experts_per_tok": 1,
                                                 "intermediate_size": 8}))
    torch.save({"w": torch.zeros(1)}, path / "pytorch_model.bin")
    expect(path, "pytorch_model.bin", "pickle", "safetensors")


def test_missing_shard(tmp_path):
    path = save_hf(hf_model("mixtral"), tmp_path / "sharded", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    expect(path, shard.name, "missing")


def test_not_a_directory(tmp_path):
    expect(tmp_path / "nope", "not a directory")
