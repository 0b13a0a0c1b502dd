"""config.json's numbers and lists before the tensors are checked: a field of the wrong JSON type is a CheckpointError
naming it (never an unhashable-type traceback), a load checks the safetensors headers before it plans memory by the
layer count config.json claims, and the plan's non-expert bytes, counted per kind of layer, are the listing's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specter.bench.synthetic import SHAPES
from specter.build import load_resident
from specter.builtin import BUILTIN
from specter.config import EngineConfig
from specter.errors import CheckpointError
from specter.memory import plan_memory
from specter.model.spec import MAX_LAYERS, ModelSpec, spec_from_config
from specter.model.weights import dense_numel, dense_shapes, layer_kinds
from tests.hf_models import FAMILIES, hf_config, rewrite_config
from tests.test_bad_checkpoints import cli_error, tiny_config
from tests.test_families_extra import _TINY, DEEPSEEK_V2_LITE, PHI_35_MOE, VARIANTS

MISSING_LAYER = "'model.layers.4.input_layernorm.weight' is missing"  # tiny has 4 layers


@pytest.fixture
def ck(tiny, tmp_path) -> Path:
    """A copy of the built-in checkpoint that a test may break."""
    return shutil.copytree(tiny, tmp_path / "ck")


# ---- wrongly typed config.json fields ---------------------------------------------------------------------------
WINDOWED = dict(use_sliding_window=True, sliding_window=16)


@pytest.mark.parametrize("changes,fragment", [
    ({"model_type": ["qwen2_moe"]}, "config field 'model_type' = ['qwen2_moe'] should be of type str"),
    ({"model_type": {"name": "qwen2_moe"}}, "config field 'model_type' = {'name': 'qwen2_moe'} should be of type str"),
    ({"mlp_only_layers": [[1]]}, "config field 'mlp_only_layers' = [[1]] should be a list of ints"),
    ({"mlp_only_layers": [{}]}, "config field 'mlp_only_layers' = [{}] should be a list of ints"),
    ({"mlp_only_layers": [True]}, "config field 'mlp_only_layers' = [True] should be a list of ints"),
    ({"mlp_only_layers": ["1"]}, "config field 'mlp_only_layers' = ['1'] should be a list of ints"),
    ({"mlp_only_layers": {"1": 1}}, "config field 'mlp_only_layers' = {'1': 1} should be of type list"),
    (WINDOWED | {"layer_types": [["full_attention"]] * 4}, "config field 'layer_types' = [['full_attention'], "),
    (WINDOWED | {"layer_types": [{}] * 4}, "config field 'layer_types' = [{}, {}, {}, {}] should list 'sliding_attention'"),
    ({"num_hidden_layers": MAX_LAYERS + 1}, f"config field 'num_hidden_layers' = {MAX_LAYERS + 1} is more than {MAX_LAYERS}"),
])
def test_a_wrongly_typed_field_is_named(changes, fragment):
    with pytest.raises(CheckpointError) as info:
        spec_from_config(tiny_config(**changes), "ck/config.json")
    message = str(info.value)
    assert message.startswith("ck/config.json: ") and fragment in message, message


def test_every_layer_count_up_to_the_bound_is_read():
    """Beyond it (10**30, say) the spec's layer sets would be built for ever; up to it, the files refuse the claim."""
    assert spec_from_config(tiny_config(num_hidden_layers=MAX_LAYERS)).num_layers == MAX_LAYERS
    assert MAX_LAYERS >= 10**7  # the count tests/test_info_checks.py has refused by its missing tensor


@pytest.mark.parametrize("command", ["generate", "info"])
@pytest.mark.parametrize("changes,fragment", [
    ({"model_type": ["qwen2_moe"]}, "'model_type' = ['qwen2_moe'] should be of type str"),
    ({"mlp_only_layers": [[1]]}, "'mlp_only_layers' = [[1]] should be a list of ints"),
    (WINDOWED | {"layer_types": [["full_attention"]] * 4}, "'layer_types' = [['full_attention']"),
])
def test_a_wrongly_typed_field_from_the_command_line(command, changes, fragment, ck, capsys):
    rewrite_config(ck, **changes)
    argv = ["--model", str(ck), "--device", "cpu", "--residents", "4", "--max-new-tokens", "1", "--prompt-ids", "1,2"]
    message = cli_error(capsys, *(["generate", *argv] if command == "generate" else ["info", str(ck), "--no-measure"]))
    assert f"{ck / 'config.json'}: config field {fragment}" in message, message


# ---- a load checks the files before it plans by config.json's layer count --------------------------------------
class LayerWalk(AssertionError):
    pass


@pytest.fixture
def few_layer_visits(monkeypatch):
    """Fails a test that names more layers' tensors than a real model has (one call of `layer_prefix` per tensor group
    of a layer): planning or listing a config's 10 million claimed layers one by one took minutes."""
    real, calls = ModelSpec.layer_prefix, []

    def counting(self, layer):
        calls.append(layer)
        if len(calls) > 20_000:
            raise LayerWalk(f"{len(calls)} layer names made: something walks every layer config.json claims")
        return real(self, layer)

    monkeypatch.setattr(ModelSpec, "layer_prefix", counting)
    return calls


@pytest.fixture
def no_plan(monkeypatch):
    """The load's memory plan fails the test: it must not run before the tensors are checked."""
    import specter.build

    def refuse(*args, **kwargs):
        raise AssertionError("the load planned memory before checking the checkpoint's tensors")

    monkeypatch.setattr(specter.build, "plan_memory", refuse)


def test_a_load_names_the_missing_tensor_of_a_claimed_layer_before_planning(ck, few_layer_visits, no_plan, capsys):
    rewrite_config(ck, num_hidden_layers=10**7)
    argv = ["--model", str(ck), "--device", "cpu", "--residents", "4", "--max-new-tokens", "1", "--prompt-ids", "1,2"]
    generate = cli_error(capsys, "generate", *argv)
    assert MISSING_LAYER in generate, generate
    assert generate == cli_error(capsys, "info", str(ck), "--no-measure")  # the same check, the same message


def test_the_resident_loader_checks_the_headers_first(ck, few_layer_visits):
    rewrite_config(ck, num_hidden_layers=10**7)
    with pytest.raises(CheckpointError, match=MISSING_LAYER):
        load_resident(ck, EngineConfig(device="cpu", max_context=64))


def test_a_load_checks_every_tensor_before_planning(ck, monkeypatch):
    """Not only the layer count: a tensor of another shape is refused before the plan too (the header check runs
    whole), with the message `info` gives."""
    from safetensors.torch import load_file, save_file

    import specter.build

    file = ck / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.3.mlp.experts.15.down_proj.weight"  # the last tensor a load reads
    tensors[name] = tensors[name][:, :5].contiguous()
    save_file(tensors, str(file))
    monkeypatch.setattr(specter.build, "plan_memory", lambda *a, **k: pytest.fail("planned before the header check"))
    with pytest.raises(CheckpointError, match="experts.15.down_proj.weight' has shape"):
        _load(ck)


def _load(path: Path) -> None:
    from specter.engine import Runtime
    from specter.kernel import run

    run(Runtime.load(path, EngineConfig(device="cpu", residents=2, max_context=64)))


def test_the_plan_of_ten_million_layers_lists_none_of_them(few_layer_visits):
    """`info` beside an empty safetensors file plans from config.json alone: the non-expert bytes are counted per
    kind of layer, so the plan costs what a real one costs; the figures grow exactly by one layer's bytes a layer."""
    spec = spec_from_config(tiny_config(num_hidden_layers=10**7, mlp_only_layers=[1]))
    few = spec_from_config(tiny_config(num_hidden_layers=4, mlp_only_layers=[1]))
    config = EngineConfig(device="cpu", max_context=64)
    plan, small = plan_memory(spec, torch.float32, config), plan_memory(few, torch.float32, config)
    assert len(few_layer_visits) < 100
    one_moe_layer = dense_numel(spec_from_config(tiny_config(num_hidden_layers=5, mlp_only_layers=[1]))) - dense_numel(few)
    assert plan.dense_bytes - small.dense_bytes == (10**7 - 4) * one_moe_layer * 4
    assert plan.moe_layers == 10**7 - 1 and plan.draft_bytes * small.moe_layers == small.draft_bytes * plan.moe_layers


# ---- the per-kind count is the listing's sum on every family's configs ----------------------------------------
def _listed(spec: ModelSpec) -> int:
    """The plan's non-expert elements as they were counted: every tensor of every layer, listed."""
    total = 0
    for shape in dense_shapes(spec).values():
        numel = 1
        for size in shape:
            numel *= size
        total += numel
    return total


REAL_CONFIGS = {f"shape {name}": config for name, config in SHAPES.items()} | {
    "tiny": BUILTIN["tiny"], "Phi-3.5-MoE": PHI_35_MOE, "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE,
    # the variants the tests run against transformers
    **{f"variant {name}": dict(model_type=family, **(_TINY | overrides)) for name, (family, overrides) in VARIANTS.items()},
    # every kind of layer mix the readers make: dense layers listed, stepped, first and strided; windows on some layers
    "qwen3 mlp_only_layers": SHAPES["qwen3-30b-a3b"] | dict(mlp_only_layers=[0, 5, 47]),
    "qwen3 sparse step 3": SHAPES["qwen3-30b-a3b"] | dict(decoder_sparse_step=3, mlp_only_layers=[1]),
    "qwen3 windowed": SHAPES["qwen3-30b-a3b"] | dict(use_sliding_window=True, sliding_window=4096),
    "qwen1.5 all dense": SHAPES["qwen1.5-moe-a2.7b"] | dict(decoder_sparse_step=0),
    "qwen1.5 tied": SHAPES["qwen1.5-moe-a2.7b"] | dict(tie_word_embeddings=True, qkv_bias=False),
    "qwen1.5 max_window_layers": SHAPES["qwen1.5-moe-a2.7b"] | dict(use_sliding_window=True, sliding_window=4096,
                                                                    max_window_layers=9, mlp_only_layers=[2, 3, 20]),
    "qwen1.5 layer_types": SHAPES["qwen1.5-moe-a2.7b"] | dict(
        use_sliding_window=True, sliding_window=4096, mlp_only_layers=[0, 1, 7],
        layer_types=["sliding_attention" if layer % 3 else "full_attention" for layer in range(24)]),
    "mixtral windowed": SHAPES["mixtral-8x7b"] | dict(sliding_window=4096),
    "olmoe clipped": SHAPES["olmoe-1b-7b"] | dict(clip_qkv=8.0),
    "deepseek strided": SHAPES["deepseek-v2-lite"] | dict(first_k_dense_replace=3, moe_layer_freq=2, q_lora_rank=1536),
    "deepseek biased": DEEPSEEK_V2_LITE | dict(attention_bias=True, n_shared_experts=None),
    "phimoe plain": SHAPES["phi-3.5-moe"] | dict(attention_bias=False, lm_head_bias=False, sliding_window=2048),
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_the_per_kind_count_is_the_listings(name):
    spec = spec_from_config(REAL_CONFIGS[name], name)
    assert dense_numel(spec) == _listed(spec)
    assert sum(layer_kinds(spec).values()) == spec.num_layers and spec.num_moe_layers == len(spec.moe_layers)
    for dtype in (torch.bfloat16, torch.float32):
        element = torch.empty((), dtype=dtype).element_size()
        assert plan_memory(spec, dtype, EngineConfig(device="cpu", max_context=256)).dense_bytes == _listed(spec) * element


@pytest.mark.parametrize("family", FAMILIES)
def test_the_per_kind_count_is_the_listings_on_transformers_configs(family):
    pytest.importorskip("transformers")
    for overrides in ({}, {"num_hidden_layers": 7}):
        spec = spec_from_config(hf_config(family, **overrides).to_dict(), family)
        assert dense_numel(spec) == _listed(spec)


def test_the_kinds_are_counted_from_the_layer_sets():
    spec = spec_from_config(REAL_CONFIGS["qwen1.5 layer_types"])
    full = [layer for layer in range(24) if layer % 3 == 0]
    assert layer_kinds(spec) == {(True, True): 1, (True, False): 2, (False, True): len(full) - 1,
                                 (False, False): 24 - 3 - (len(full) - 1)}
    assert layer_kinds(spec_from_config(SHAPES["mixtral-8x7b"])) == {(False, False): 32}
