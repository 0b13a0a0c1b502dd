"""Specter against transformers where a checkpoint leans on what transformers does beyond tests/test_parity.py's
configurations: OLMoE's clip_qkv, Qwen's sliding-window layers, the defaults of fields config.json leaves out, a
checkpoint without a dtype, chat templates, models without MoE layers, Phi-MoE's fused layout and a base model's
save without the `model.` prefix. Tokens are held to transformers' eager float32 greedy generate on tiny random
checkpoints built with its own classes, reloaded from the directory Specter reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specter import Engine, EngineConfig
from specter.build import load_resident
from specter.decode import decode_resident_graphed, greedy_decode, run_sync
from specter.errors import CheckpointError
from specter.kernel import run
from specter.memory import plan_memory
from specter.model.checkpoint import Checkpoint
from specter.model.spec import spec_from_config
from specter.tokenizer import Tokenizer, train_byte_level_bpe
from tests.hf_models import rewrite_config, save_fused
from tests.test_families_extra import hf_variant

PROMPT = [3, 17, 42, 5, 88, 12, 7, 60]
NEW_TOKENS = 24
_TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=None)
_FAMILY_FIELDS = {
    "mixtral": dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                      num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                      head_dim=16),
    "olmoe": dict(intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
    "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                        v_head_dim=8, num_key_value_heads=4),
}


def _classes(family: str):
    import transformers as tf

    return {"mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM), "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM), "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
            "phimoe": (tf.PhimoeConfig, tf.PhimoeForCausalLM),
            "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM)}[family]


def saved_model(family: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **fields) -> Path:
    """A tiny transformers model of `family` made from its config class with `fields` (so fields it derives, such as
    Qwen2-MoE's layer_types, follow them), weights normal(0, 0.15) except norms as tests/hf_models.py, saved."""
    config_cls, model_cls = _classes(family)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(_TINY | _FAMILY_FIELDS[family] | fields))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.15)
    model.to(dtype).save_pretrained(path)
    return path


def hf_tokens(path: Path, prompt: list[int] = PROMPT, n: int = NEW_TOKENS, dtype: torch.dtype | str = torch.float32) -> list[int]:
    """transformers' eager greedy tokens of the checkpoint at `path`, read as transformers reads it."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def specter_tokens(path: Path, prompt: list[int] = PROMPT, n: int = NEW_TOKENS, graphed: bool = False, **config) -> list[int]:
    """Specter's greedy tokens, every weight resident: the eager exact forward, or the static step (`graphed`)."""
    loaded = load_resident(path, EngineConfig(device="cpu", max_context=128, **({"dtype": "float32"} | config)))
    decode = decode_resident_graphed if graphed else greedy_decode
    return run_sync(decode(loaded.model, loaded.experts, prompt, n))


# ---- 1. OLMoE's clip_qkv ----------------------------------------------------------------------------------

def test_olmoe_clips_q_k_v_after_the_qk_norms_as_transformers_does(tmp_path):
    path = saved_model("olmoe", tmp_path / "olmoe", clip_qkv=0.3)  # a clamp that bites on the normalised q and k
    expected = hf_tokens(path)
    assert specter_tokens(path) == expected
    assert specter_tokens(path, graphed=True) == expected  # the static step computes q/k/v the same way


# ---- 2. Sliding-window layers ------------------------------------------------------------------------------

@pytest.mark.parametrize("written_by", ["transformers v5", "older"])
def test_qwen2_moe_windows_only_the_layers_transformers_windows(written_by, tmp_path):
    path = saved_model("qwen2_moe", tmp_path / "q2", num_hidden_layers=4, use_sliding_window=True, sliding_window=4,
                       max_window_layers=3)
    if written_by == "older":  # no layer_types: transformers derives them from max_window_layers
        rewrite_config(path, layer_types=None)
    assert Checkpoint(path).spec.full_attention_layers == {1, 3}  # every other layer from the first, below layer 3
    expected = hf_tokens(path, n=32)
    assert specter_tokens(path, n=32) == expected
    assert specter_tokens(path, n=32, graphed=True) == expected  # the static step masks each layer as the eager forward
    assert specter_tokens(path, n=32, exact=False) == expected  # the fast forward's block attention too


def test_qwen2_moe_layer_types_as_written(tmp_path):
    path = saved_model("qwen2_moe", tmp_path / "q2", num_hidden_layers=4, use_sliding_window=True, sliding_window=3,
                       layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    spec = Checkpoint(path).spec
    assert [spec.window(layer) for layer in range(4)] == [None, 3, 3, None]
    assert specter_tokens(path, n=32) == hf_tokens(path, n=32)


def test_qwen3_moe_windows_every_layer(tmp_path):
    path = saved_model("qwen3_moe", tmp_path / "q3", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    spec = Checkpoint(path).spec
    assert [spec.window(layer) for layer in range(3)] == [4, 4, 4]
    assert specter_tokens(path, n=32) == hf_tokens(path, n=32)


def test_qwen_window_fields_read_as_transformers_reads_them():
    base = dict(model_type="qwen2_moe", vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
                num_experts_per_tok=2)
    assert spec_from_config(base | dict(use_sliding_window=True)).sliding_window == 4096  # transformers' default
    assert spec_from_config(base | dict(use_sliding_window=False, sliding_window=0)).sliding_window is None
    with pytest.raises(CheckpointError, match="'layer_types'.*each of the 3 layers"):
        spec_from_config(base | dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2))


# ---- 3. Defaults of fields config.json leaves out ---------------------------------------------------------

_MINIMAL = {
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "phimoe": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


@pytest.mark.parametrize("family", sorted(_MINIMAL))
def test_left_out_fields_take_the_defaults_of_transformers_config_class(family):
    fields = dict(vocab_size=96, hidden_size=256, num_hidden_layers=2, num_attention_heads=32) | _MINIMAL[family]
    spec = spec_from_config(dict(model_type=family, **fields))
    hf = _classes(family)[0](**fields)
    assert spec.rms_eps == hf.rms_norm_eps
    assert spec.rope_theta == hf.rope_parameters["rope_theta"]
    assert spec.max_position == hf.max_position_embeddings
    if family == "deepseek_v2":  # (its cache is the compressed latent: no kv heads)
        assert spec.q_lora_rank == hf.q_lora_rank
        assert spec.shared_intermediate == hf.moe_intermediate_size * hf.n_shared_experts
    else:
        assert spec.num_kv_heads == hf.num_key_value_heads


def test_a_mixtral_config_without_rope_theta_runs_as_in_transformers(tmp_path):
    # (the eps defaults are held by the test above: 1e-5 against 1e-6 moves no greedy token of these tiny models)
    path = saved_model("mixtral", tmp_path / "mixtral", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    rewrite_config(path, rope_parameters=None, rope_theta=None)
    assert specter_tokens(path) == hf_tokens(path)


# ---- 4. dtype ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("declared", [None, "auto"])
def test_a_checkpoint_without_a_dtype_runs_in_its_stored_dtype(declared, tmp_path):
    import transformers as tf

    path = saved_model("qwen3_moe", tmp_path / "bf16", dtype=torch.bfloat16)
    rewrite_config(path, dtype=declared, torch_dtype=None)
    if declared is None:  # (transformers cannot read a config that declares "auto"; Specter reads it as no dtype)
        assert tf.AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16  # transformers' dtype="auto"
    assert Checkpoint(path).spec.dtype == "bfloat16"
    auto = load_resident(path, EngineConfig(device="cpu", max_context=64))
    assert auto.model.dtype == torch.bfloat16
    declared_bf16 = specter_tokens(path, n=16, dtype="bfloat16")
    assert run_sync(greedy_decode(auto.model, auto.experts, PROMPT, 16)) == declared_bf16


@pytest.mark.parametrize(("dtype", "torch_dtype", "computes"), [
    ("bfloat16", "float16", torch.bfloat16),  # both: `dtype` wins, as transformers v5 keeps it
    ("bfloat16", "auto", torch.bfloat16),  # an "auto" torch_dtype hid a declared dtype
])
def test_dtype_wins_over_torch_dtype_as_in_transformers(tmp_path, dtype, torch_dtype, computes):
    import transformers as tf

    path = saved_model("qwen3_moe", tmp_path / "m", dtype=torch.float32)
    rewrite_config(path, dtype=dtype, torch_dtype=torch_dtype)
    if torch_dtype != "auto":  # (transformers cannot read a config that declares "auto")
        assert tf.AutoConfig.from_pretrained(path).dtype == computes
    assert Checkpoint(path).spec.dtype == str(computes).removeprefix("torch.")


def test_a_dtype_specter_does_not_compute_in_is_refused(tmp_path):
    path = saved_model("mixtral", tmp_path / "fp8")
    rewrite_config(path, dtype="float8_e4m3fn")
    with pytest.raises(CheckpointError, match=r"'float8_e4m3fn'.*'torch_dtype' or 'dtype'.*bfloat16, float16, float32.*--dtype"):
        load_resident(path, EngineConfig(device="cpu", max_context=64))
    assert specter_tokens(path, dtype="float32") == hf_tokens(path)  # --dtype settles it


# ---- 5. Chat templates -----------------------------------------------------------------------------------

TEMPLATES = {
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role }}: {{ m.content }}\n"
                     "{% if m.role == 'user' %}{% break %}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
                  "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}",
    "strftime_now": "Year {{ strftime_now('%Y') }}.\n{% for m in messages %}{{ m.content }}\n{% endfor %}",
    "tojson": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    "tojson options": "{{ messages[1] | tojson(indent=2) }}{{ messages[1] | tojson(separators=(',', ':')) }}"
                      "{{ {'b': 1, 'a': 'é'} | tojson }}{{ '<&>' | tojson }}",
}
MESSAGES = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo ✓ <b>"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_templates_render_as_in_transformers(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    template, special = TEMPLATES[name], {"bos_token": "<s>", "eos_token": "</s>"}
    tokenizer = Tokenizer(train_byte_level_bpe(["abc"], 300), chat_template=template, special_tokens=special)
    expected = render_jinja_template([MESSAGES], chat_template=template, add_generation_prompt=True, **special)[0][0]
    assert tokenizer.apply_chat_template(MESSAGES) == expected


# ---- 6. Models without MoE layers -------------------------------------------------------------------------

DENSE_ONLY = {"qwen2_moe": dict(decoder_sparse_step=5), "qwen3_moe": dict(mlp_only_layers=[0, 1, 2]),
              "deepseek_v2": dict(first_k_dense_replace=3)}


@pytest.mark.parametrize("family", sorted(DENSE_ONLY))
def test_offloading_settings_on_a_model_without_moe_layers_run_it_resident(family, tmp_path):
    path = saved_model(family, tmp_path / family, **DENSE_ONLY[family])
    spec = Checkpoint(path).spec
    assert spec.moe_layers == []
    for residents in (1, 2):  # 1: below the top-k, which no layer needs here
        assert plan_memory(spec, torch.float32, EngineConfig(device="cpu", residents=residents, max_context=64)).all_resident
    fixed = plan_memory(spec, torch.float32, EngineConfig(device="cpu", max_context=64)).fixed_bytes
    assert plan_memory(spec, torch.float32, EngineConfig(device="cpu", budget=fixed, max_context=64)).all_resident

    async def complete() -> list[int]:
        async with Engine.from_pretrained(path, EngineConfig(device="cpu", dtype="float32", residents=1, max_context=64)) as engine:
            return (await engine.complete(PROMPT, max_new_tokens=16)).token_ids

    assert run(complete()) == hf_tokens(path, n=16)


def test_info_and_trace_on_a_model_without_moe_layers(tmp_path, capsys):
    """`info --residents 100` was refused as outside 2..6 slots per MoE layer where the load runs the model resident,
    and `--trace` was refused as if --residents kept every expert resident, with advice that could not help."""
    from specter.cli import main

    path = saved_model("qwen3_moe", tmp_path / "dense", **DENSE_ONLY["qwen3_moe"])
    for residents in ("1", "100"):
        assert main(["info", str(path), "--no-measure", "--residents", residents, "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["moe_layers"] == 0
    assert main(["generate", "--model", str(path), "--device", "cpu", "--residents", "2", "--prompt-ids", "1,2",
                 "--trace", str(tmp_path / "run.trace")]) == 2
    err = capsys.readouterr().err
    assert "the model has no MoE layer (every layer is dense)" in err and "--residents N below" not in err, err


# ---- 7. Phi-MoE's fused layout ----------------------------------------------------------------------------

def test_phimoe_fused_layout_loads_and_matches_transformers(tmp_path):
    path = save_fused(hf_variant("phimoe-plain"), tmp_path / "phimoe")
    assert "model.layers.0.mlp.router.weight" in load_file(path / "model.safetensors")  # transformers v5's names
    assert Checkpoint(path).spec.router_name(0) == "model.layers.0.mlp.router.weight"
    assert specter_tokens(path) == hf_tokens(path)


# ---- 8. A base model's save without the `model.` prefix ---------------------------------------------------

def test_a_save_without_the_model_prefix_loads_as_in_transformers(tmp_path):
    path = saved_model("qwen3_moe", tmp_path / "base", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("model."): value for name, value in tensors.items() if name != "lm_head.weight"},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "embed_tokens.weight" in load_file(path / "model.safetensors")
    assert specter_tokens(path) == hf_tokens(path)

    missing = {name: value for name, value in load_file(path / "model.safetensors").items() if name != "layers.1.input_layernorm.weight"}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor 'layers.1.input_layernorm.weight' is missing"):  # the file's name for it
        load_resident(path, EngineConfig(device="cpu", max_context=64))


# ---- On CUDA: the launches only a GPU runs -----------------------------------------------------------

CUDA_MODELS = {"olmoe-clip": ("olmoe", dict(clip_qkv=0.3)),
               "qwen2-windows": ("qwen2_moe", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=3))}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("forward", ["exact", "exact-rowwise", "fast"])
@pytest.mark.parametrize("model", sorted(CUDA_MODELS))
def test_on_cuda_the_fused_paths_clip_and_window_as_transformers(model, forward, tmp_path):
    """The CUDA-only launches that compute q/k/v and attend (the fast forward's: the draft's packed q/k/v, one-row
    products and decode attention; the exact forward's with kernels.exact_rowwise), eager and static, in float32:
    transformers' tokens."""
    from specter.config import KernelTuning, TuningConfig

    family, fields = CUDA_MODELS[model]
    path = saved_model(family, tmp_path / model, **fields)
    expected = hf_tokens(path, n=32)
    tuning = TuningConfig(kernels=KernelTuning(exact_rowwise=forward == "exact-rowwise"))
    loaded = load_resident(path, EngineConfig(device="cuda", dtype="float32", max_context=64, exact=forward != "fast", tuning=tuning))
    assert run_sync(greedy_decode(loaded.model, loaded.experts, PROMPT, 32)) == expected
    assert run_sync(decode_resident_graphed(loaded.model, loaded.experts, PROMPT, 32, kernel="dense", use_graph=True)) == expected
