"""Built-in models made in code: deterministic tiny checkpoints written in Hugging Face format.

They load through exactly the same path as a real checkpoint, so the README's command and the tests
exercise the real reader. They are written once into a cache directory and reused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

BUILTIN = {
    # A Qwen1.5-MoE-like model: shared expert with sigmoid gate, 16 routed experts, top-2.
    "tiny": dict(model_type="qwen2_moe", vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=128,
                 num_experts=16, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_theta=10000.0, tie_word_embeddings=False, qkv_bias=True, decoder_sparse_step=1, mlp_only_layers=[],
                 torch_dtype="float32", eos_token_id=None, bos_token_id=None),
}
VERSION = 2  # 2: adds tokenizer.json (byte-level BPE trained on TOKENIZER_TEXT)

# The built-in tokenizer's training text: deterministic, with multi-byte characters so that some tokens
# hold parts of a character (what incremental detokenization must handle).
TOKENIZER_TEXT = (
    "hello world. the quick brown fox jumps over the lazy dog. a mixture of experts routes every token to a few "
    "experts; the draft proposes tokens and the target verifies them in one pass. experts that are resident "
    "on the device are computed first, and the others are copied over the link while the draft runs. "
    "speculative decoding, expert offloading, prefetching, eviction, lookahead, memory budget, cache slots. "
    "once upon a time there was a small model that could not hold all of its experts in memory. "
    "café, naïve, déjà vu, crème brûlée, smörgåsbord, Ελληνικά, русский текст, 日本語のテキスト, 中文文本, "
    "한국어 문장, emoji 🙂🚀✨, math ∑∫√≈≠, arrows → ← ↑ ↓. "
    "Hello, World! How are you today? I am fine, thank you. 0123456789 + - * / = ( ) [ ] { } < > # @ & % $ "
)
TOKENIZER_SPECIAL = ("<|endoftext|>",)


def cache_dir() -> Path:
    """The folder of the built-in models and cached figures: $SPECTER_CACHE, else ~/.cache/specter (also where it is
    set empty: an empty one was the current directory)."""
    return Path(os.environ.get("SPECTER_CACHE") or Path.home() / ".cache" / "specter")


def is_builtin(name: str) -> bool:
    return name in BUILTIN and not Path(name).exists()


def builtin_path(name: str) -> Path:
    """The directory of a built-in model, building it on first use."""
    path = cache_dir() / f"builtin-{name}-v{VERSION}"
    try:
        if not (path / "config.json").exists():
            write_builtin(name, path)
    except OSError as error:  # SPECTER_CACHE is a file, read-only, full...
        from specter.errors import ConfigError

        raise ConfigError(f"cannot write the built-in model {name!r} under {cache_dir()} ({error.strerror or error}); "
                          "set SPECTER_CACHE to a writable directory") from None
    return path


def write_builtin(name: str, path: Path, seed: int = 1234) -> Path:
    config = dict(BUILTIN[name])
    generator = torch.Generator().manual_seed(seed)
    tensors = _random_tensors(config, generator)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(tmp, config["vocab_size"])
    if path.exists():  # another process built it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(path)
    return path


def _write_tokenizer(directory: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json: a byte-level BPE with exactly `vocab_size` ids.

    The end-of-text token is not the model's eos (config.json keeps eos_token_id null), so the built-in
    model's output length is always max_new_tokens.
    """
    from specter.tokenizer import train_byte_level_bpe

    tokenizer = train_byte_level_bpe([TOKENIZER_TEXT] * 4, vocab_size, TOKENIZER_SPECIAL)
    assert tokenizer.get_vocab_size() <= vocab_size, "built-in tokenizer larger than the model's vocabulary"
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TOKENIZER_SPECIAL[0], "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))


def _random_tensors(config: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    D, V, E = config["hidden_size"], config["vocab_size"], config["num_experts"]
    I, S = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = D // heads

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * (scale / shape[-1] ** 0.5)

    tensors = {"model.embed_tokens.weight": normal(V, D, scale=D**0.5), "model.norm.weight": torch.ones(D), "lm_head.weight": normal(V, D, scale=4.0)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        tensors |= {f"{p}.input_layernorm.weight": torch.ones(D), f"{p}.post_attention_layernorm.weight": torch.ones(D)}
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
            tensors[f"{p}.self_attn.{name}.weight"] = normal(rows, D)
            tensors[f"{p}.self_attn.{name}.bias"] = torch.zeros(rows)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal(D, heads * hd)
        tensors[f"{p}.mlp.gate.weight"] = normal(E, D, scale=3.0)
        tensors[f"{p}.mlp.shared_expert_gate.weight"] = normal(1, D)
        for name, inter in [(f"{p}.mlp.shared_expert", S)] + [(f"{p}.mlp.experts.{e}", I) for e in range(E)]:
            tensors |= {f"{name}.gate_proj.weight": normal(inter, D), f"{name}.up_proj.weight": normal(inter, D),
                        f"{name}.down_proj.weight": normal(D, inter)}
    return tensors


def builtin_note(name_or_path: str) -> str | None:
    """The one-line notice the CLI prints on stderr when `name_or_path` is a built-in model, else None.

    Built-in models have random weights: without the notice a first user reads their gibberish as a bug.
    """
    if not is_builtin(name_or_path):
        return None
    config = BUILTIN[name_or_path]
    return (f"note: {name_or_path!r} is a built-in model with random weights ({config['model_type']}, "
            f"{config['num_hidden_layers']} layers, {config['num_experts']} experts, made in code): its text is gibberish. "
            f"It shows the engine at work; for real text pass --model a checkpoint directory (README: Run a real model).")


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A checkpoint path, or the path of a built-in model given by name."""
    from specter.errors import ConfigError

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"the model must be a checkpoint directory (a str or Path) or a built-in model's name "
                          f"({', '.join(sorted(BUILTIN))}), got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    if not str(name).strip():  # Path('') is the current directory, whose missing config.json was the message
        raise ConfigError(f"the model path is empty; give a checkpoint directory or a built-in model's name "
                          f"({', '.join(sorted(BUILTIN))})")
    return builtin_path(name) if is_builtin(name) else Path(name)
