"""Exact, function-preserving widening (Net2Net) of a narrow MoE checkpoint to a real model's width (issue 28).

A narrow model keeps a real shape's depth, experts, top-k, routing function, shared-expert layout, norms and
rope, at 1/F of the width with the same head dim (`narrow_config`); once trained, `widen_checkpoint` makes it
the real shape: the residual stream tiled F times, every linear map tiled on both sides and scaled by 1/F,
norm weights, biases and embedding columns tiled, heads and KV heads tiled together as whole blocks.

What is exact. In real arithmetic the widened model computes the narrow one's function: every hidden vector
of the wide model is the narrow one tiled F times (see the one-line proof beside each rule below), and the
logits are the same numbers. In floating point the dot products are longer and summed in another order, and
for F not a power of two W/F is rounded once; so the logits agree to rounding. tests/test_widen.py measures it for
every family: float32 logits within 1.1e-6 of the largest; bfloat16 logits bit-identical for F = 2 on the CPU, and
for F = 3 as far from the exact function as the narrow model's own bf16 rounding (at most 1.6x its RMS error).
Widening itself gives the same bits on the CPU and on CUDA (`WidenedCheckpoint`'s `device`; tests/test_gpu_widen.py).
Per expert and per layer the widened model has the real model's shapes, so its bytes and FLOPs are the real ones
(attention, router, shared expert, dense layers, experts).

What the small vocabulary leaves out. The vocabulary is not widened: a narrow model trained on a small
vocabulary (the reference trainer's 256 bytes) keeps it, so the embedding and the LM head are small. The
embedding costs one row per token, but the LM head is read whole every decode step and both take GPU memory
that the real model spends before any expert slot. In bfloat16, each of the two (embedding, LM head) is:

| shape | vocab x hidden | bytes each |
|---|---|---|
| qwen1.5-moe-a2.7b | 151936 x 2048 | 622,329,856 (594 MiB) |
| mixtral-8x7b | 32000 x 4096 | 262,144,000 (250 MiB) |
| qwen3-30b-a3b | 151936 x 2048 | 622,329,856 (594 MiB) |
| olmoe-1b-7b | 50304 x 2048 | 206,045,184 (197 MiB) |
| phi-3.5-moe | 32064 x 4096 | 262,668,288 (251 MiB; plus its LM-head bias, 63 KiB) |
| deepseek-v2-lite | 102400 x 2048 | 419,430,400 (400 MiB) |

(`vocab_bytes` computes these.) A benchmark on a widened checkpoint therefore under-counts the resident
non-expert bytes by about twice that (a budget leaves that much more room for expert slots) and the LM head's
per-token read (e.g. 0.13 ms of H200 bandwidth per token for the Qwen shapes); expert transfers are unaffected.

Shape legend: D hidden, F factor, H heads, Hkv kv heads, hd head dim, I expert width, E experts, V vocabulary,
r kv latent (kv_lora_rank), dr its rope part (qk_rope_head_dim).

CLI: `python -m specter.bench.widen --shape mixtral-8x7b --factor 8 --src NARROW_DIR --dst WIDE_DIR`;
`--narrow-config` prints the narrow config.json of a shape; `--table` prints every shape's narrow dims.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m specter.bench.widen`: a Ctrl-C held over the imports below (`specter.entry`)
    from specter.entry import widen

    raise SystemExit(widen())

import argparse
import copy
import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import specter.model  # noqa: F401  (registers the extra families: phimoe, deepseek_v2)
from specter.bench.synthetic import SHAPES
from specter.errors import CheckpointError, ConfigError
from specter.exits import run_tool
from specter.model.checkpoint import Checkpoint
from specter.model.deepseek_v2 import DeepseekSpec
from specter.model.spec import ModelSpec, spec_from_config
from specter.model.weights import dense_shapes

Tensor = torch.Tensor

WIDTH_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank")
"""config.json fields that scale with the width (absent or null ones are skipped). Everything else stays: depth,
experts, top-k, routing, head_dim, qk_nope/qk_rope/v head dims, norms and rope."""

DEFAULT_FACTORS = {"mixtral-8x7b": 8, "phi-3.5-moe": 8, "qwen1.5-moe-a2.7b": 4, "deepseek-v2-lite": 4, "qwen3-30b-a3b": 4,
                   "olmoe-1b-7b": 4}
"""F per shape: a narrow hidden size of 512 for every shape (Qwen3-30B-A3B's 4 KV heads allow at most F = 4)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
                   "prompts.json")
"""Files copied from the narrow checkpoint as they are (the vocabulary does not change; prompts.json is the bench's)."""

SHARD_BYTES = 4 << 30
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "source": None}


# ---- configs ------------------------------------------------------------------------------------
def check_factor(factor: Any) -> int:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ConfigError(f"widening factor {factor!r} must be a whole number >= 1 (F = real width / narrow width)")
    return factor


def narrow_config(real_config: dict[str, Any], factor: int, vocab_size: int | None = None) -> dict[str, Any]:
    """The config.json of `real_config` at 1/`factor` of the width (same head dim, fewer heads), optionally with a
    smaller vocabulary; depth, experts, top-k, routing, shared-expert layout, norms and rope unchanged."""
    check_factor(factor)
    narrow = copy.deepcopy(real_config)
    for field in WIDTH_FIELDS:
        value = narrow.get(field)
        if value is None:
            continue
        if value % factor:
            divisors = [f for f in range(1, value + 1) if value % f == 0 and f <= 64]
            raise ConfigError(f"{real_config.get('model_type')}: config field '{field}' = {value} is not divisible by the factor "
                              f"{factor}; pick a factor that divides every width field (this one allows {divisors})")
        narrow[field] = value // factor
    if vocab_size is not None:
        narrow["vocab_size"] = vocab_size
        _drop_token_ids_beyond(narrow, vocab_size)
    spec_from_config(narrow, f"narrow {real_config.get('model_type')} config")  # the engine must read it
    assert _head_dims(narrow) == _head_dims(real_config), "narrowing must keep the head dims"
    return narrow


def _drop_token_ids_beyond(config: dict[str, Any], vocab_size: int) -> None:
    """Special token ids of the real vocabulary mean nothing in a small one."""
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(field)
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i >= vocab_size for i in ids):
            config[field] = None


def widen_config(narrow: dict[str, Any], factor: int) -> dict[str, Any]:
    """The config.json of the widened model: every width field times `factor`, embeddings untied (the LM head is
    scaled by 1/F, the embedding is not, so they are no longer one tensor)."""
    check_factor(factor)
    wide = copy.deepcopy(narrow)
    for field in WIDTH_FIELDS:
        if wide.get(field) is not None:
            wide[field] = wide[field] * factor
    wide["tie_word_embeddings"] = False
    assert _head_dims(wide) == _head_dims(narrow), "widening must keep the head dims"
    return wide


def _head_dims(config: dict[str, Any]) -> tuple[int, ...]:
    """What widening must keep: the head dims (MLA's three, or head_dim) and the query heads per KV head."""
    spec = spec_from_config(config)
    heads = config["num_attention_heads"]
    group = heads // (config.get("num_key_value_heads") or heads)  # MLA's spec says 1 kv head; its config keeps the real count
    if spec.family == "deepseek_v2":
        return (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"], group)
    return (spec.head_dim, group)


def shape_narrow_config(shape: str, factor: int | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """narrow_config of a named real shape (specter.bench.synthetic.SHAPES), at its default factor unless given."""
    if shape not in SHAPES:
        raise ConfigError(f"no real shape named {shape!r}; known shapes: {', '.join(SHAPES)}")
    return narrow_config(SHAPES[shape], DEFAULT_FACTORS[shape] if factor is None else factor, vocab_size)


def vocab_bytes(config: dict[str, Any], element_size: int = 2) -> int:
    """Bytes of one of the embedding or the LM head (vocab x hidden), what a small vocabulary leaves out."""
    return int(config["vocab_size"]) * int(config["hidden_size"]) * element_size


# ---- per-tensor rules ---------------------------------------------------------------------------
# Each rule maps a narrow tensor to its wide one. Invariant: every wide hidden vector is the narrow one tiled,
# tile(x) = [x, x, ..., x] (F copies), including the residual stream, q/k/v, expert activations and MLA latents.
Rule = Callable[[Tensor, int], Tensor]


def _tile(t: Tensor, dims: int | tuple[int, ...], factor: int) -> Tensor:
    """t repeated `factor` times as whole blocks along each of `dims` ([t, t, ..., t], Tensor.repeat's layout), in one
    copy: a view with a broadcast axis of size F before each tiled dim, read out once by the reshape (no repeat per
    dim, no intermediate)."""
    tiled = {dims} if isinstance(dims, int) else set(dims)
    view, expanded, wide = [], [], []
    for dim, size in enumerate(t.shape):
        view += [1, size] if dim in tiled else [size]
        expanded += [factor, size] if dim in tiled else [size]
        wide.append(factor * size if dim in tiled else size)
    return t.reshape(view).expand(expanded).reshape(wide)


def _scaled(t: Tensor, factor: int) -> Tensor:
    """t / F rounded once to t's dtype (exact for F a power of two). The division is IEEE float64 division on every
    device: the divisor is a tensor on t's device, since CUDA's `/` by a CPU scalar multiplies by its rounded
    reciprocal instead."""
    if factor == 1:
        return t
    return (t.double() / torch.full((), factor, dtype=torch.float64, device=t.device)).to(t.dtype)


def embedding(t: Tensor, factor: int) -> Tensor:
    # [V, D] -> [V, FD]: row v is token v's residual stream, so the tiled row is the tiled stream (no sum: no scale).
    return _tile(t, 1, factor)


def linear(t: Tensor, factor: int) -> Tensor:
    # [O, D] -> [FO, FD], W' = tile(W / F) both ways: row block j of W' tile(x) is sum over F copies of (W/F) x = W x.
    return _tile(_scaled(t, factor), (0, 1), factor)


def reader(t: Tensor, factor: int) -> Tensor:
    # router, shared-expert gate, LM head: [O, D] -> [O, FD], output not widened: [W/F ... W/F] tile(x) = W x.
    return _tile(_scaled(t, factor), 1, factor)


def tiled_vector(t: Tensor, factor: int) -> Tensor:
    # the bias of a tiled output: tile(Wx) + tile(b) = tile(Wx + b). A norm's weight and bias: the mean and mean
    # square (LayerNorm: and variance) of tile(x) equal those of x, so norm(tile x) * tile(w) + tile(b) = tile(norm(x) * w + b).
    return _tile(t, 0, factor)


def kept(t: Tensor, factor: int) -> Tensor:
    # what lives on an axis that does not widen: the LM head's bias (vocabulary), Qwen3's per-head q/k norms (hd).
    return t


def latent_then_rope(latent: int) -> Rule:
    """kv_a_proj_with_mqa [r + dr, D]: the latent r (a widened vector) then one rope key dr shared by all heads."""
    def rule(t: Tensor, factor: int) -> Tensor:
        # latent rows tiled (tile(c)), the shared rope key's rows kept (one key of fixed size dr); input side /F.
        rows = torch.cat([_tile(t[:latent], 0, factor), t[latent:]], dim=0)
        return _tile(_scaled(rows, factor), 1, factor) if t.dim() == 2 else rows
    return rule


def fused_gate_up(t: Tensor, factor: int) -> Tensor:
    # [E, 2I, D] -> [E, 2FI, FD]: each half tiled on its own, so gate'[j*I + i] still pairs with up'[j*I + i]
    # (`fused_linear` of each half, side by side, written in one copy).
    halves = _scaled(t, factor).unflatten(1, (2, t.shape[1] // 2))  # [E, 2, I, D]
    return _tile(halves, (2, 3), factor).flatten(1, 2)


def fused_linear(t: Tensor, factor: int) -> Tensor:
    # [E, O, D] -> [E, FO, FD]: `linear` per expert.
    return _tile(_scaled(t, factor), (1, 2), factor)


_NORMS = {"norm", "input_layernorm", "post_attention_layernorm", "kv_a_layernorm", "q_a_layernorm"}
_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
            "w1", "w2", "w3"}
# Heads: q_proj's rows are H whole heads; tiling the whole row block makes wide head j*H + h narrow head h and wide kv
# head j*Hkv + g narrow kv head g, so query head i = j*H + h still reads kv head i // G = j*Hkv + h // G (G = H / Hkv,
# unchanged), i.e. narrow kv head h // G; hd (and the softmax scale) is unchanged. MLA's q_proj / q_b_proj / kv_b_proj
# rows are H heads too, the same way: kv_b_proj (a `linear`) gives each head's no-rope key and value, W_uk c and W_uv c,
# unchanged from the tiled latent, so the engine's absorbed score (W_uk^T q_nope) . c is too, and the rope key is kept.


def tensor_rule(name: str, spec: ModelSpec) -> Rule:
    """How the narrow tensor `name` (its on-disk name) widens; CheckpointError for a tensor no rule covers."""
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        return embedding
    if name == "lm_head.weight":
        return reader
    if name == "lm_head.bias":
        return kept
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in ("gate_up_proj", "gate_proj", "up_proj", "down_proj"):
        return fused_gate_up if parts[-1] == "gate_up_proj" else fused_linear  # transformers v5's fused 3-D experts
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        raise _no_rule(name)
    module, kind = parts[-2], parts[-1]
    if module in _NORMS:
        return tiled_vector
    if module in ("q_norm", "k_norm"):
        return kept if spec.qk_norm == "head" else tiled_vector  # OLMoE's norm the whole projection: tiled like a norm
    if module == "kv_a_proj_with_mqa":
        assert isinstance(spec, DeepseekSpec), f"'{name}' is an MLA tensor, but the checkpoint is {spec.family}"
        return latent_then_rope(spec.kv_lora_rank)
    if module == "shared_expert_gate" or (module == "gate" and parts[-3] in ("mlp", "block_sparse_moe")):
        return reader if kind == "weight" else kept
    if module in _LINEARS:
        return linear if kind == "weight" else tiled_vector
    raise _no_rule(name)


def _no_rule(name: str) -> CheckpointError:
    return CheckpointError(f"tensor '{name}': no widening rule for it; specter.bench.widen knows the tensors of "
                           "mixtral, qwen2_moe, qwen3_moe, olmoe, phimoe and deepseek_v2 checkpoints as transformers writes them")


def widen_tensor(name: str, tensor: Tensor, spec: ModelSpec, factor: int) -> Tensor:
    """The wide tensor of the narrow `name` (spec: the narrow model's)."""
    return tensor_rule(name, spec)(tensor, factor).contiguous()


def widen_state_dict(narrow_sd: dict[str, Tensor], narrow_config: dict[str, Any], factor: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Widen a whole state dict (on-disk names) and its config.json; tied embeddings get an explicit LM head."""
    check_factor(factor)
    spec = spec_from_config(narrow_config, "narrow config")
    wide_config = widen_config(narrow_config, factor)
    wide = {name: widen_tensor(name, tensor, spec, factor) for name, tensor in narrow_sd.items()}
    if spec.tie_word_embeddings and "lm_head.weight" not in narrow_sd:  # tied: the head is the embedding read as a linear map
        wide["lm_head.weight"] = widen_tensor("lm_head.weight", narrow_sd["model.embed_tokens.weight"], spec, factor)
    check_wide_shapes(wide, spec_from_config(wide_config, "widened config"))
    return wide, wide_config


def check_wide_shapes(wide: dict[str, Tensor] | dict[str, tuple[int, ...]], wide_spec: ModelSpec) -> None:
    """Every widened tensor the engine reads has the shape the wide config.json implies."""
    expected = expected_shapes(wide_spec)
    for name, value in wide.items():
        shape = tuple(value.shape) if isinstance(value, Tensor) else tuple(value)
        if name in expected:
            assert shape == expected[name], f"widened '{name}' has shape {list(shape)}, the wide config implies {list(expected[name])}"


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a model with per-expert tensors (dense ones as the engine loads them), by on-disk name."""
    shapes = dict(dense_shapes(spec))
    D, inter = spec.hidden_size, spec.expert_intermediate
    for layer in spec.moe_layers:
        for expert in range(spec.num_experts):
            for which, shape in enumerate(((inter, D), (inter, D), (D, inter))):
                shapes[spec.expert_tensor_name(layer, expert, which)] = shape
    return shapes


# ---- checkpoints --------------------------------------------------------------------------------
def widen_device(device: str | torch.device) -> torch.device:
    """Where a WidenedCheckpoint widens: 'auto' is CUDA when present (as EngineConfig.device's 'auto')."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"widening device {str(device)!r}: CUDA is not available on this machine; use 'cpu' or 'auto'")
    return resolved


class WidenedCheckpoint:
    """A narrow checkpoint directory read as its widened model: each tensor is widened as it is read.

    Duck-types specter.model.checkpoint.Checkpoint (config, spec, index, has, shape, tensor, close), so the
    engine's own loaders read it (`CheckpointWeights(WidenedCheckpoint(path, F))`) without the wide copy on disk.
    `dtype`: the narrow tensors are cast to it before widening (a float32 trainer's checkpoint read as bfloat16 has
    the real model's bytes); None keeps the checkpoint's.
    `device`: where widening runs and where `tensor` returns the wide tensor ('auto': CUDA when present). The narrow
    tensor is read and cast to `dtype` on the CPU, then moved (F^2 times smaller than the wide one) and tiled and
    scaled there; the values are the same bit for bit on every device (`_scaled` divides in IEEE float64 everywhere;
    tiling copies). The engine's loaders take device tensors as they are: `load_dense` keeps them, the expert pool
    copies each packed expert from the device into its pinned slab (the one copy to the host it makes anyway) and the
    draft's quantizer reads it where it is. On CUDA this takes widening off the host, which the engine runs with one
    torch thread there; it needs device memory beyond the engine's plan for about one wide tensor at a time (fused 3-D
    experts: one layer's) and the packed expert made from it; the draft's quantizer keeps a layer's experts on the device
    as they arrive rather than on the host (its peak, a layer's experts and their stack there, is the same). The
    default, the CPU, is what `widen_checkpoint` (safetensors files) and llama.cpp's GGUF need.
    """

    def __init__(self, path: str | Path, factor: int, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> None:
        self.factor, self.dtype, self.device = check_factor(factor), dtype, widen_device(device)  # before opening anything
        self.narrow = Checkpoint(path)
        self.path, self.files = self.narrow.path, self.narrow.files
        self.config = widen_config(self.narrow.config, factor)
        for key in ([key for key in ("torch_dtype", "dtype") if key in self.config] or ["torch_dtype"]) if dtype else []:
            self.config[key] = str(dtype).removeprefix("torch.")  # transformers v4 and v5 spellings
        self.spec: ModelSpec = spec_from_config(self.config, f"{self.path}/config.json widened x{factor}")
        if dtype is None:  # the narrow checkpoint's dtype, its stored one when config.json declares none
            self.spec = dataclasses.replace(self.spec, dtype=self.narrow.spec.dtype)
        self.index = dict(self.narrow.index)
        self.tied = self.narrow.spec.tie_word_embeddings and "lm_head.weight" not in self.index
        if self.tied:
            self.index["lm_head.weight"] = self.index["model.embed_tokens.weight"]
        self.spec = Checkpoint._adapt_expert_prefix(self, self.spec)  # type: ignore[arg-type]
        self._expected = expected_shapes(self.spec)

    def has(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensor(name).shape)  # widened to know it: only the loaders' error paths ask

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        source = "model.embed_tokens.weight" if self.tied and name == "lm_head.weight" else name
        narrow = self.narrow.tensor(source)
        narrow = narrow if self.dtype is None else narrow.to(self.dtype)  # on the CPU whatever the device: the same rounding
        wide = widen_tensor(name, narrow.to(self.device), self.narrow.spec, self.factor)
        assert name not in self._expected or tuple(wide.shape) == self._expected[name], \
            f"widened '{name}' has shape {list(wide.shape)}, the wide config implies {list(self._expected[name])}"
        if shape is not None and tuple(wide.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: widened tensor '{name}' has shape {list(wide.shape)}, expected {list(shape)}")
        return wide

    def names(self) -> list[str]:
        return list(self.index)

    def close(self) -> None:
        self.narrow.close()


def widen_checkpoint(src_dir: str | Path, dst_dir: str | Path, factor: int, shard_bytes: int = SHARD_BYTES,
                     dtype: torch.dtype | None = None) -> Path:
    """Write the widened model of the narrow checkpoint `src_dir` to `dst_dir` (config.json, safetensors shards of at
    most `shard_bytes` with an index when there are several, tokenizer files), in `dtype` (None: the checkpoint's);
    one tensor in memory at a time beyond the shard being filled."""
    src, dst = Path(src_dir), Path(dst_dir)
    if dst.resolve() == src.resolve():
        raise ConfigError(f"--dst {dst} is the source checkpoint; write the widened model to another directory")
    wide = WidenedCheckpoint(src, factor, dtype)
    dst.mkdir(parents=True, exist_ok=True)
    shards = list(_write_shards(wide, dst, shard_bytes))
    _name_shards(dst, shards)
    (dst / "config.json").write_text(json.dumps(wide.config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    provenance = {"source": str(src.resolve()), "factor": factor, "dtype": str(dtype).removeprefix("torch.") if dtype else "as source"}
    (dst / "widened.json").write_text(json.dumps(provenance, indent=2) + "\n")
    wide.close()
    return dst


def _write_shards(wide: WidenedCheckpoint, dst: Path, shard_bytes: int) -> Iterator[tuple[Path, list[str], int]]:
    """(temporary file, names, bytes) per shard written."""
    batch: dict[str, Tensor] = {}
    size = 0
    for name in wide.names():
        tensor = wide.tensor(name)
        if batch and size + tensor.nbytes > shard_bytes:
            yield _save_shard(dst, batch, size)
            batch, size = {}, 0
        batch[name], size = tensor, size + tensor.nbytes
    if batch:
        yield _save_shard(dst, batch, size)


def _save_shard(dst: Path, batch: dict[str, Tensor], size: int) -> tuple[Path, list[str], int]:
    path = dst / f"part-{len(list(dst.glob('part-*.safetensors'))):05d}.safetensors"
    save_file(batch, str(path), metadata={"format": "pt"})
    return path, list(batch), size


def _name_shards(dst: Path, shards: list[tuple[Path, list[str], int]]) -> None:
    """model.safetensors for one shard; model-0000i-of-0000N.safetensors plus the index for several."""
    for stale in [*dst.glob("model*.safetensors"), dst / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        shards[0][0].rename(dst / "model.safetensors")
        return
    weight_map, total = {}, 0
    for number, (path, names, size) in enumerate(shards, start=1):
        final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        path.rename(dst / final)
        weight_map |= {name: final for name in names}
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---- sizes --------------------------------------------------------------------------------------
def layer_bytes(spec: ModelSpec, element_size: int = 2) -> list[int]:
    """Bytes of each decoder layer (attention, norms, router, shared expert, dense MLP and routed experts)."""
    per_layer = [0] * spec.num_layers
    for name, shape in dense_shapes(spec).items():
        if name.startswith("model.layers."):
            per_layer[int(name.split(".")[2])] += _numel(shape) * element_size
    for layer in spec.moe_layers:
        per_layer[layer] += spec.num_experts * spec.expert_bytes(element_size)
    return per_layer


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def narrow_table(vocab_size: int = 256) -> list[dict[str, Any]]:
    """Each real shape at its default factor: the narrow dims, and the sizes the widened model has."""
    rows = []
    for shape, factor in DEFAULT_FACTORS.items():
        narrow = shape_narrow_config(shape, factor, vocab_size)
        spec, real = spec_from_config(narrow), spec_from_config(SHAPES[shape])
        narrow_params = sum(layer_bytes(spec, 1))
        narrow_active = narrow_params - len(spec.moe_layers) * (spec.num_experts - spec.top_k) * spec.expert_numel
        rows.append(dict(shape=shape, F=factor, hidden=spec.hidden_size, heads=spec.num_heads,
                         kv_heads=narrow.get("num_key_value_heads", spec.num_heads), head_dims=_head_dims(narrow)[:-1],
                         expert_width=spec.expert_intermediate, shared_width=spec.shared_intermediate,
                         dense_width=spec.dense_intermediate if spec.dense_layers else 0,
                         kv_lora_rank=narrow.get("kv_lora_rank"), layers=spec.num_layers, experts=spec.num_experts,
                         top_k=spec.top_k, narrow_layer_params_M=round(narrow_params / 1e6, 1),
                         narrow_active_params_M=round(narrow_active / 1e6, 1),
                         wide_expert_MB=round(real.expert_bytes(2) / 1e6, 2), wide_layer_MB=round(max(layer_bytes(real)) / 1e6, 1),
                         left_out_vocab_MB=round(2 * vocab_bytes(SHAPES[shape]) / 1e6, 1)))
    return rows


# ---- CLI ----------------------------------------------------------------------------------------
def check_matches_shape(narrow_cfg: dict[str, Any], shape: str, factor: int) -> None:
    """The narrow checkpoint widens to `shape`: its width, depth and expert fields equal narrow_config(shape, F)'s."""
    expected = shape_narrow_config(shape, factor)
    fields = WIDTH_FIELDS + ("model_type", "num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts",
                             "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "qk_nope_head_dim",
                             "qk_rope_head_dim", "v_head_dim", "head_dim")
    wrong = [f"{f} = {narrow_cfg.get(f)!r} (expected {expected[f]!r})" for f in fields
             if f in expected and narrow_cfg.get(f) != expected[f]]
    if wrong:
        raise ConfigError(f"the source checkpoint is not {shape} at 1/{factor} width: {'; '.join(wrong)}; "
                          f"see `python -m specter.bench.widen --shape {shape} --factor {factor} --narrow-config`")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specter.bench.widen", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="the real shape (checks the source against it)")
    parser.add_argument("--factor", type=int, default=None, help="F; default: the shape's DEFAULT_FACTORS entry")
    parser.add_argument("--src", type=Path, help="the narrow checkpoint directory")
    parser.add_argument("--dst", type=Path, help="where to write the widened checkpoint")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                        help="the widened tensors' dtype ('source' keeps the checkpoint's; the real models ship in bfloat16)")
    parser.add_argument("--shard-gb", type=float, default=SHARD_BYTES / 2**30, help="largest safetensors shard, GiB")
    parser.add_argument("--narrow-config", action="store_true", help="print the narrow config.json of --shape and exit")
    parser.add_argument("--vocab-size", type=int, default=None, help="with --narrow-config: a smaller vocabulary")
    parser.add_argument("--table", action="store_true", help="print every shape's narrow dims at its default factor")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    if args.table:
        print(json.dumps(narrow_table(), indent=1))
        return 0
    if args.narrow_config:
        if args.shape is None:
            raise ConfigError("--narrow-config needs --shape")
        print(json.dumps(shape_narrow_config(args.shape, args.factor, args.vocab_size), indent=2))
        return 0
    if args.src is None or args.dst is None:
        raise ConfigError("widening needs --src NARROW_DIR and --dst WIDE_DIR (or use --narrow-config / --table)")
    if args.factor is None and args.shape is None:
        raise ConfigError("widening needs --factor F, or --shape to take that shape's default factor")
    factor = args.factor if args.factor is not None else DEFAULT_FACTORS[args.shape]
    if args.shape is not None:
        check_matches_shape(Checkpoint(args.src).config, args.shape, check_factor(factor))
    out = widen_checkpoint(args.src, args.dst, check_factor(factor), int(args.shard_gb * 2**30), _DTYPES[args.dtype])
    print(f"widened {args.src} x{factor} ({args.dtype}) -> {out}")
    return 0

