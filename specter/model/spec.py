"""ModelSpec: one normalised description of an MoE decoder, read from a checkpoint's config.json.

Each supported `model_type` has a reader that maps its config fields (as Hugging Face writes them) to a
ModelSpec and names its tensors as they are on disk; the rest of the engine sees only ModelSpec.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from specter.config import MIN_CONTEXT
from specter.errors import CheckpointError, abbreviate


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Architecture of one MoE decoder. D hidden, H heads, Hkv kv heads, E experts, A active, I expert width."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    dense_intermediate: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    norm_topk_prob: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (per head, Qwen3) | "full" (whole projection, OLMoE)
    clip_qkv: float | None = None
    shared_intermediate: int = 0  # shared expert width (Qwen2-MoE); 0 = none
    shared_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE)
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead of experts
    sliding_window: int | None = None  # the window of every layer not in full_attention_layers; None: no window
    full_attention_layers: frozenset[int] = frozenset()  # layers that see the whole context (Qwen2-MoE's layer_types)
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # the checkpoint's torch dtype: declared in config.json, else its tensors' (Checkpoint)
    eos_token_ids: tuple[int, ...] = ()
    expert_prefix: str = "mlp"  # "block_sparse_moe" for Mixtral
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down on disk
    router: str = "gate"  # the router's name under expert_prefix ("router" in Phi-MoE's transformers v5 layout)

    @property
    def moe_layers(self) -> list[int]:
        if not self.dense_layers:
            return list(range(self.num_layers))
        return [layer for layer in range(self.num_layers) if layer not in self.dense_layers]

    @property
    def num_moe_layers(self) -> int:
        """len(moe_layers), counted from the dense layers alone (no list of every layer)."""
        return self.num_layers - sum(1 for layer in self.dense_layers if 0 <= layer < self.num_layers)

    @property
    def expert_numel(self) -> int:
        """Elements of one packed expert: gate and up [2I, D] then down [D, I]."""
        return 3 * self.expert_intermediate * self.hidden_size

    def expert_bytes(self, element_size: int) -> int:
        return self.expert_numel * element_size

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention (keys within the last `window` positions), or None: all of them."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def layer_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}"

    def router_name(self, layer: int) -> str:
        return f"{self.layer_prefix(layer)}.{self.expert_prefix}.{self.router}.weight"

    def expert_tensor_name(self, layer: int, expert: int, which: int) -> str:
        """Per-expert tensor name on disk; which: 0 gate, 1 up, 2 down."""
        return f"{self.layer_prefix(layer)}.{self.expert_prefix}.experts.{expert}.{self.expert_names[which]}.weight"


_POSITIVE = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    "max_position_embeddings", "original_max_position_embeddings", "sliding_window", "rms_norm_eps", "rope_theta", "factor",
    "short_factor", "long_factor", "clip_qkv", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "n_group", "topk_group",
})
"""Sizes, counts, epsilons and rope bases: a zero or negative one gives a model that loads, runs and emits garbage
(token 0 forever for a negative rope_theta), so it is refused when config.json is read."""
_NON_NEGATIVE = frozenset({"shared_expert_intermediate_size", "n_shared_experts", "router_jitter_noise"})
MAX_LAYERS = 1 << 24
"""The most decoder layers config.json may claim (real models have tens, a few over a hundred): the spec's layer sets,
and everything sized by the layer count before the tensors are checked against it, are built from the claim, so a
num_hidden_layers of 10**30 would run forever there. Any count up to this one is refused by the tensor check instead
(the first layer the files lack), in seconds."""
_AT_MOST = {"num_hidden_layers": MAX_LAYERS}
# A model whose positions are fewer than the shortest context the engine runs would leave no --max-context to give
_AT_LEAST = {"max_position_embeddings": MIN_CONTEXT}


class _Fields:
    """Reads config.json fields, naming the file and field when one is missing, malformed or out of range."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def need(self, name: str, kind: type = int) -> Any:
        if name not in self.config or self.config[name] is None:
            model_type = self.config.get("model_type")
            required = f"it is required for model_type '{model_type}'" if model_type else "it is required"
            raise CheckpointError(f"{self.source}: config field '{name}' is missing; {required}")
        return self.typed(name, self.config[name], kind)

    def need_any(self, names: tuple[str, ...], kind: type = int) -> Any:
        """The first present of several spellings (e.g. num_experts / num_local_experts across versions)."""
        for name in names:
            if self.config.get(name) is not None:
                return self.typed(name, self.config[name], kind)
        return self.need(names[0], kind)

    def get(self, name: str, default: Any, kind: type = int) -> Any:
        value = self.config.get(name)
        return default if value is None else self.typed(name, value, kind)

    def get_list(self, name: str, kind: type, what: str) -> list[Any] | None:
        """A list field whose every item is of `kind` (an int not a bool), or None where config.json leaves it out;
        `what` says what its items are, for the message (a list of lists would be an unhashable set member)."""
        items = self.get(name, None, list)
        if items is not None and not all(isinstance(item, kind) and not (kind is int and isinstance(item, bool)) for item in items):
            raise CheckpointError(f"{self.source}: config field '{name}' = {abbreviate(items, 120)} should be a list of "
                                  f"{kind.__name__}s ({what}); set it to the model's value (as in its published config.json)")
        return items

    def get_or_null(self, name: str, absent: Any, null: Any, kind: type = int) -> Any:
        """A field whose transformers default (`absent`, where config.json leaves it out) differs from what an explicit
        null means (`null`): e.g. DeepSeek's q_lora_rank, 1536 when left out and no q LoRA when null."""
        if name not in self.config:
            return absent
        return self.get(name, null, kind)

    def typed(self, name: str, value: Any, kind: type) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                checked = float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise CheckpointError(f"{self.source}: config field '{name}' = {value!r:.40} must be a finite number; "
                                      "set it to the model's value (as in its published config.json)") from None
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(f"{self.source}: config field '{name}' = {value!r} should be of type {kind.__name__}")
        else:
            checked = value
        if kind in (int, float):
            self.check_range(name, value, checked)
        return checked

    def check_range(self, name: str, value: Any, number: float) -> None:
        # JSON as Python reads it admits NaN and Infinity, which no field can mean
        if name in _POSITIVE and not 0 < number < math.inf:
            rule = "must be positive"
        elif name in _NON_NEGATIVE and not 0 <= number < math.inf:
            rule = "must be zero or positive"
        elif isinstance(number, float) and not math.isfinite(number):  # an int is finite, however long
            rule = "must be a finite number"
        elif name in _AT_MOST and number > _AT_MOST[name]:
            rule = f"is more than {_AT_MOST[name]}, far beyond any model's"
        elif name in _AT_LEAST and number < _AT_LEAST[name]:
            rule = f"is less than {_AT_LEAST[name]}, the shortest context Specter runs"
        else:
            return
        raise CheckpointError(f"{self.source}: config field '{name}' = {value!r:.40} {rule}; "
                              "set it to the model's value (as in its published config.json)")

    def rope(self, default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
        """rope_theta and scaling, from transformers v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`);
        `default_theta`: the family's where both leave it out (transformers' `default_theta` of its config class)."""
        params = self.get("rope_parameters", None, dict) or {}
        theta = params.get("rope_theta", self.config.get("rope_theta"))
        theta = default_theta if theta is None else self.typed("rope_theta", theta, float)
        scaling = self.get("rope_scaling", None, dict) or None
        if params.get("rope_type", "default") != "default":
            scaling = dict(params)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return theta, scaling

    def eos(self, vocab_size: int) -> tuple[int, ...]:
        """The end-of-sequence ids: none where config.json leaves eos_token_id out or null (as many do), else ids the
        model can emit (a -1 or an id past the vocabulary is never sampled, so generation would never stop there)."""
        eos = self.config.get("eos_token_id")
        if eos is None:
            return ()
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
            raise CheckpointError(f"{self.source}: config field 'eos_token_id' = {eos!r} should be of type int, or a list of ints")
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            what = f"holds {abbreviate(outside[0], 40)}, not" if isinstance(eos, list) else "is not"
            raise CheckpointError(f"{self.source}: config field 'eos_token_id' = {abbreviate(eos, 120)} {what} a token "
                                  f"id of this model's vocabulary of {vocab_size} (0 to {vocab_size - 1}); set it to the "
                                  "model's end-of-sequence id (as in its published config.json), or null for none")
        return tuple(ids)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What transformers' config class of a family (v5: MixtralConfig, Qwen2MoeConfig, ...) puts where config.json
    leaves a field out: a checkpoint that relies on them must run as it does in transformers (a Mixtral config without
    rope_theta is a 1e6 base, and one rotated with 10000 emits other tokens). kv_heads None: num_attention_heads."""

    rms_eps: float
    max_position: int
    rope_theta: float = 10000.0
    kv_heads: int | None = None


def declared_dtype(config: dict[str, Any]) -> str | None:
    """The dtype config.json declares (`torch_dtype` in transformers v4, `dtype` in v5) as a torch name, or None where
    it declares none (or "auto", which is no dtype either): transformers then takes its tensors'. Where both are
    declared, `dtype` wins, as in transformers v5 (a file saved by v5 keeps a stale `torch_dtype` beside it)."""
    value = config.get("dtype") or config.get("torch_dtype")
    name = str(value).removeprefix("torch.") if value else None
    return None if name in (None, "auto") else name


def _common(fields: _Fields, defaults: Defaults) -> dict[str, Any]:
    hidden = fields.need("hidden_size")
    heads = fields.need("num_attention_heads")
    theta, scaling = fields.rope(defaults.rope_theta)
    vocab_size = fields.need("vocab_size")
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=fields.need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=fields.get_or_null("num_key_value_heads", defaults.kv_heads or heads, heads),
        head_dim=fields.get("head_dim", hidden // heads),
        rms_eps=fields.get("rms_norm_eps", defaults.rms_eps, float),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=fields.get("max_position_embeddings", defaults.max_position),
        tie_word_embeddings=fields.get("tie_word_embeddings", False, bool),
        dtype=declared_dtype(fields.config) or "float32",  # Checkpoint puts the tensors' where config.json declares none
        eos_token_ids=fields.eos(vocab_size),
    )


def _sparse_layers(fields: _Fields, num_layers: int) -> frozenset[int]:
    """Qwen-style dense layers: `mlp_only_layers` plus layers skipped by `decoder_sparse_step`."""
    step = fields.get("decoder_sparse_step", 1)
    only_dense = set(fields.get_list("mlp_only_layers", int, "layer indices") or ())
    if step == 1:  # every layer sparse but those listed: no need to visit every layer
        return frozenset(layer for layer in only_dense if 0 <= layer < num_layers)
    return frozenset(layer for layer in range(num_layers) if layer in only_dense or step <= 0 or (layer + 1) % step != 0)


MIXTRAL = Defaults(rms_eps=1e-5, max_position=4096 * 32, rope_theta=1e6, kv_heads=8)
QWEN2_MOE = Defaults(rms_eps=1e-6, max_position=32768, kv_heads=16)
QWEN3_MOE = Defaults(rms_eps=1e-6, max_position=32768, kv_heads=4)
OLMOE = Defaults(rms_eps=1e-5, max_position=4096)


def _mixtral(fields: _Fields) -> ModelSpec:
    common = _common(fields, MIXTRAL)
    window = fields.get("sliding_window", None)
    return ModelSpec(
        family="mixtral", **common,
        num_experts=fields.need_any(("num_local_experts", "num_experts")), top_k=fields.need("num_experts_per_tok"),
        expert_intermediate=fields.need("intermediate_size"), dense_intermediate=0, norm_topk_prob=True,
        sliding_window=window, expert_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
    )


def _qwen_window(fields: _Fields) -> int | None:
    """Qwen's sliding window: `sliding_window` (4096 where left out) with `use_sliding_window`, else none (transformers
    writes sliding_window 0 then)."""
    if not fields.get("use_sliding_window", False, bool):
        return None
    return fields.get_or_null("sliding_window", 4096, None)


def _qwen2_windows(fields: _Fields, num_layers: int) -> dict[str, Any]:
    """Qwen2-MoE windows some layers only: those `layer_types` calls "sliding_attention"; a config without it (written
    before transformers v5) means transformers' rule, every other layer from the first below `max_window_layers`."""
    window = _qwen_window(fields)
    if window is None:
        return dict(sliding_window=None)
    types = fields.get("layer_types", None, list)
    if types is None:
        below = fields.get("max_window_layers", 28)
        sliding = set(range(0, min(num_layers, below), 2))
    elif len(types) != num_layers or not all(kind in ("sliding_attention", "full_attention") for kind in types):  # compared, not hashed
        raise CheckpointError(f"{fields.source}: config field 'layer_types' = {abbreviate(types, 120)} should list 'sliding_attention' or "
                              f"'full_attention' for each of the {num_layers} layers (num_hidden_layers)")
    else:
        sliding = {layer for layer, kind in enumerate(types) if kind == "sliding_attention"}
    if not sliding:
        return dict(sliding_window=None)
    return dict(sliding_window=window, full_attention_layers=frozenset(set(range(num_layers)) - sliding))


def _qwen2_moe(fields: _Fields) -> ModelSpec:
    common = _common(fields, QWEN2_MOE)
    dense = _sparse_layers(fields, common["num_layers"])
    return ModelSpec(
        family="qwen2_moe", **common,
        num_experts=fields.need_any(("num_experts", "num_local_experts")), top_k=fields.need("num_experts_per_tok"),
        # transformers' default width only where some layer has a dense MLP (it would size the workspace otherwise)
        expert_intermediate=fields.need("moe_intermediate_size"), dense_intermediate=fields.get("intermediate_size", 5632 if dense else 0),
        norm_topk_prob=fields.get("norm_topk_prob", False, bool), qkv_bias=fields.get("qkv_bias", True, bool),
        shared_intermediate=fields.need("shared_expert_intermediate_size"), shared_gate=True,
        dense_layers=dense, **_qwen2_windows(fields, common["num_layers"]),
    )


def _qwen3_moe(fields: _Fields) -> ModelSpec:
    common = _common(fields, QWEN3_MOE)
    bias = fields.get("attention_bias", False, bool)
    dense = _sparse_layers(fields, common["num_layers"])
    return ModelSpec(
        family="qwen3_moe", **common,
        num_experts=fields.need_any(("num_experts", "num_local_experts")), top_k=fields.need("num_experts_per_tok"),
        expert_intermediate=fields.need("moe_intermediate_size"), dense_intermediate=fields.get("intermediate_size", 6144 if dense else 0),
        norm_topk_prob=fields.get("norm_topk_prob", False, bool), qkv_bias=bias, o_bias=bias, qk_norm="head",
        # transformers' Qwen3-MoE windows every layer (it reads neither layer_types nor max_window_layers)
        dense_layers=dense, sliding_window=_qwen_window(fields),
    )


def _olmoe(fields: _Fields) -> ModelSpec:
    common = _common(fields, OLMOE)
    bias = fields.get("attention_bias", False, bool)
    return ModelSpec(
        family="olmoe", **common,
        num_experts=fields.need_any(("num_experts", "num_local_experts")), top_k=fields.need("num_experts_per_tok"),
        expert_intermediate=fields.need("intermediate_size"), dense_intermediate=0,
        norm_topk_prob=fields.get("norm_topk_prob", False, bool), qkv_bias=bias, o_bias=bias, qk_norm="full",
        clip_qkv=fields.get("clip_qkv", None, float),
    )


FAMILIES: dict[str, Callable[[_Fields], ModelSpec]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
}


def register_family(model_type: str, reader: Callable[[_Fields], ModelSpec]) -> None:
    """Add a model family reader (used by the family modules that need their own attention or routing)."""
    FAMILIES[model_type] = reader


def spec_from_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Build the ModelSpec for a parsed config.json, or explain why it cannot be read."""
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):  # a list or an object would be an unhashable key
        raise CheckpointError(f"{source}: config field 'model_type' = {abbreviate(model_type, 80)} should be of type str, "
                              f"the model family's name; supported model types: {', '.join(sorted(FAMILIES))}")
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported; supported model types: {supported}")
    spec = FAMILIES[model_type](_Fields(config, source))
    _check(spec, source)
    return spec


def _check(spec: ModelSpec, source: str) -> None:
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {spec.num_heads} is not a multiple of num_key_value_heads {spec.num_kv_heads}")
    if not 1 <= spec.top_k <= spec.num_experts:
        raise CheckpointError(f"{source}: num_experts_per_tok {spec.top_k} must be between 1 and the number of experts {spec.num_experts}")
    if spec.head_dim <= 0 or spec.head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {spec.head_dim} (head_dim, else hidden_size // num_attention_heads) "
                              "must be positive and even for rotary embeddings")
    if spec.rope_scaling is not None:
        kind = spec.rope_scaling.get("rope_type", spec.rope_scaling.get("type"))
        if kind not in ("linear",):
            raise CheckpointError(f"{source}: rope scaling type {kind!r} is not supported for {spec.family}; supported: default, linear")
        _Fields(spec.rope_scaling, f"{source} (rope_scaling)").need("factor", float)
