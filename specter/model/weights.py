"""Loading weights: non-expert tensors by their on-disk names, routed experts one (layer, expert) at a time.

An expert is packed as one flat tensor [gate; up] [2I, D] followed by down [D, I], so it can be moved
over PCIe in one copy. Checkpoints that store a layer's experts as fused 3-D tensors load too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from tqdm.auto import tqdm

from specter.errors import CheckpointError
from specter.model.checkpoint import Checkpoint
from specter.model.spec import ModelSpec

DenseShapes = Callable[[ModelSpec], dict[str, tuple[int, ...]]]


def attention_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """Standard multi-head attention with grouped KV; biases and q/k norms as the spec says."""
    D, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes = {
        f"{prefix}.q_proj.weight": (q_out, D),
        f"{prefix}.k_proj.weight": (kv_out, D),
        f"{prefix}.v_proj.weight": (kv_out, D),
        f"{prefix}.o_proj.weight": (D, q_out),
    }
    if spec.qkv_bias:
        shapes |= {f"{prefix}.q_proj.bias": (q_out,), f"{prefix}.k_proj.bias": (kv_out,), f"{prefix}.v_proj.bias": (kv_out,)}
    if spec.o_bias:
        shapes[f"{prefix}.o_proj.bias"] = (D,)
    if spec.qk_norm == "head":
        shapes |= {f"{prefix}.q_norm.weight": (hd,), f"{prefix}.k_norm.weight": (hd,)}
    elif spec.qk_norm == "full":
        shapes |= {f"{prefix}.q_norm.weight": (q_out,), f"{prefix}.k_norm.weight": (kv_out,)}
    return shapes


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def standard_dense_shapes(spec: ModelSpec, attention: Callable[[ModelSpec, str], dict[str, tuple[int, ...]]] = attention_shapes,
                          shared_name: str = "shared_expert") -> dict[str, tuple[int, ...]]:
    """Every non-routed-expert tensor of the model and its shape, by on-disk name.

    Families with another attention (DeepSeek's MLA) or shared-expert name pass their own.
    """
    D = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, D), "model.norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    for layer in range(spec.num_layers):
        prefix = spec.layer_prefix(layer)
        shapes[f"{prefix}.input_layernorm.weight"] = (D,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (D,)
        shapes |= attention(spec, f"{prefix}.self_attn")
        if layer in spec.dense_layers:
            shapes |= mlp_shapes(f"{prefix}.mlp", D, spec.dense_intermediate)
            continue
        shapes[spec.router_name(layer)] = (spec.num_experts, D)
        if spec.shared_intermediate:
            shapes |= mlp_shapes(f"{prefix}.mlp.{shared_name}", D, spec.shared_intermediate)
        if spec.shared_gate:
            shapes[f"{prefix}.mlp.shared_expert_gate.weight"] = (1, D)
    return shapes


DENSE_SHAPES: dict[str, DenseShapes] = {}


def dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return DENSE_SHAPES.get(spec.family, standard_dense_shapes)(spec)


def layer_kinds(spec: ModelSpec) -> dict[tuple[bool, bool], int]:
    """How many of the model's layers are of each kind, (dense MLP, full attention), counted from the spec's layer
    sets alone; kinds no layer has are left out."""
    layers = range(spec.num_layers)
    dense = {layer for layer in spec.dense_layers if layer in layers}
    full = {layer for layer in spec.full_attention_layers if layer in layers} if spec.sliding_window is not None else set()
    both = len(dense & full)
    counts = {(True, True): both, (True, False): len(dense) - both, (False, True): len(full) - both,
              (False, False): spec.num_layers - len(dense | full)}
    return {kind: count for kind, count in counts.items() if count}


def dense_numel(spec: ModelSpec) -> int:
    """The elements of every non-routed-expert tensor: the sum over `dense_shapes`, counted per kind of layer (one layer
    of each kind times the layers of that kind) rather than from every layer's names, so that a plan of a config.json
    claiming millions of layers (`specter info` beside an empty safetensors file plans from the config alone) costs
    what a real one does. A family's tensors differ between layers only by their kind (`layer_kinds`):
    tests/test_checkpoint_shapes.py compares this with the listing on every family's real config."""
    kinds = layer_kinds(spec)
    order = list(kinds)
    sample = dataclasses.replace(
        spec, num_layers=len(order), dense_layers=frozenset(i for i, (dense, _) in enumerate(order) if dense),
        full_attention_layers=frozenset(i for i, (_, full) in enumerate(order) if full))
    prefixes = [f"{sample.layer_prefix(i)}." for i in range(len(order))]
    per_layer = [0] * len(order)
    total = 0
    for name, shape in dense_shapes(sample).items():
        numel = _numel(shape)
        layer = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), None)
        if layer is None:
            total += numel  # the embedding, the final norm, the LM head
        else:
            per_layer[layer] += numel
    return total + sum(kinds[kind] * numel for kind, numel in zip(order, per_layer))


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def load_dense(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, progress: bool = False) -> dict[str, torch.Tensor]:
    """Read every non-expert tensor, checked against the shape config.json implies, onto the device."""
    shapes = dense_shapes(ckpt.spec)
    dense: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes.items(), desc="dense weights", disable=not progress, unit="tensor"):
        dense[name] = ckpt.tensor(name, shape).to(device=device, dtype=dtype)
    if ckpt.spec.tie_word_embeddings and "lm_head.weight" not in dense:
        dense["lm_head.weight"] = dense["model.embed_tokens.weight"]
    return dense


def pack_expert(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert as one flat tensor: [gate; up] rows, then down."""
    return torch.cat([gate.reshape(-1), up.reshape(-1), down.reshape(-1)])


def unpack_expert(flat: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed expert: w13 [2I, D] (gate rows then up rows) and w2 [D, I]."""
    split = 2 * inter * hidden
    return flat[:split].view(2 * inter, hidden), flat[split:].view(hidden, inter)


def swiglu(rows: torch.Tensor, packed: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    """The families' routed expert, SwiGLU over the packed [gate; up] and down, on one block of rows [B, D] -> [B, D].
    The device path (Transformer.expert_mlp, block by block) runs it, and so does the host path with torch's kernel
    (the native one is specter.experts.native). F.linear, not the weights as GEMM's left operand (W13 @ X^T, oneDNN
    reading them unreformatted), which cost twice as much on the GPU machine's host (docs/BENCHMARKS.md, "Host expert
    path")."""
    w13, w2 = unpack_expert(packed, hidden, inter)
    gate_up = torch.nn.functional.linear(rows, w13)  # [B, 2I]
    return torch.nn.functional.linear(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2)


def iter_experts(ckpt: Checkpoint, dtype: torch.dtype, progress: bool = False) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (layer, expert, packed flat tensor) for every routed expert, reading one layer at a time; on the device
    the checkpoint's tensors are on (the CPU, or CUDA for a WidenedCheckpoint widening there)."""
    spec = ckpt.spec
    total = len(spec.moe_layers) * spec.num_experts
    bar = tqdm(total=total, desc="experts", disable=not progress, unit="expert")
    for layer in spec.moe_layers:
        read = _read_fused_layer if _is_fused(ckpt, layer) else _read_expert_layer
        for expert, (gate, up, down) in enumerate(read(ckpt, layer)):
            yield layer, expert, pack_expert(gate, up, down).to(dtype)
            bar.update(1)
    bar.close()


def _expert_shapes(spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    """One routed expert's gate, up and down on disk."""
    D, inter = spec.hidden_size, spec.expert_intermediate
    return (inter, D), (inter, D), (D, inter)


def _read_expert_layer(ckpt: Checkpoint, layer: int) -> Iterator[tuple[torch.Tensor, ...]]:
    spec = ckpt.spec
    shapes = _expert_shapes(spec)
    for expert in range(spec.num_experts):
        yield tuple(ckpt.tensor(spec.expert_tensor_name(layer, expert, which), shapes[which]) for which in range(3))


def _fused_prefix(spec: ModelSpec, layer: int) -> str:
    return f"{spec.layer_prefix(layer)}.{spec.expert_prefix}.experts"


def _is_fused(ckpt: Checkpoint, layer: int) -> bool:
    prefix = _fused_prefix(ckpt.spec, layer)
    return ckpt.has(f"{prefix}.gate_up_proj") or ckpt.has(f"{prefix}.gate_proj")


def _fused_shapes(ckpt: Checkpoint, layer: int) -> dict[str, tuple[int, ...]]:
    """A fused layer's expert tensors and their shapes, in the order the loader reads them: gate_up_proj [E, 2I, D]
    (or gate_proj and up_proj [E, I, D]), then down_proj [E, D, I]."""
    spec = ckpt.spec
    E, D, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate
    prefix = _fused_prefix(spec, layer)
    if ckpt.has(f"{prefix}.gate_up_proj"):
        shapes = {f"{prefix}.gate_up_proj": (E, 2 * inter, D)}
    else:
        shapes = {f"{prefix}.gate_proj": (E, inter, D), f"{prefix}.up_proj": (E, inter, D)}
    return shapes | {f"{prefix}.down_proj": (E, D, inter)}


def _read_fused_layer(ckpt: Checkpoint, layer: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """transformers v5 layout: gate_up_proj [E, 2I, D] (gate half first) and down_proj [E, D, I]."""
    inter = ckpt.spec.expert_intermediate
    tensors = [ckpt.tensor(name, shape) for name, shape in _fused_shapes(ckpt, layer).items()]
    if len(tensors) == 2:
        gate, up, down = tensors[0][:, :inter], tensors[0][:, inter:], tensors[1]
    else:
        gate, up, down = tensors
    for expert in range(ckpt.spec.num_experts):
        yield gate[expert], up[expert], down[expert]


def check_checkpoint(ckpt: Checkpoint) -> None:
    """Refuse what loading `ckpt` would refuse, from the safetensors headers alone (no tensor data is read): every
    tensor config.json implies present, of its shape and a float dtype (`Checkpoint.check`, the loader's own check),
    and no expert beyond its count, in the order a load reads them, so the first problem is the one `generate` names.
    `specter info` runs it before sizing anything by config.json's numbers (a billion experts were a cost model's loop)."""
    check_no_unknown_experts(ckpt)
    spec = ckpt.spec
    # Every layer has an input_layernorm, so a config claiming more layers than the files hold tensors misses one
    # among its first len(index) + 1 layers, and the load's first missing tensor is among theirs: check those rather
    # than build the shapes of every layer claimed (10 million took minutes).
    layers = min(spec.num_layers, len(ckpt.index) + 1)
    bounded = spec if layers == spec.num_layers else dataclasses.replace(spec, num_layers=layers)
    for name, shape in dense_shapes(bounded).items():
        ckpt.check(name, shape)
    shapes = _expert_shapes(spec)
    for layer in bounded.moe_layers:
        if _is_fused(ckpt, layer):
            for name, shape in _fused_shapes(ckpt, layer).items():
                ckpt.check(name, shape)
            continue
        for expert in range(spec.num_experts):  # stops at the first expert missing: no more than the files hold
            for which in range(3):
                ckpt.check(spec.expert_tensor_name(layer, expert, which), shapes[which])


def check_no_unknown_experts(ckpt: Checkpoint) -> None:
    """Fail early when the checkpoint has more layers or experts than config.json declares (a config/weights mismatch:
    the model would run cut short, the rest of its weights unread)."""
    spec = ckpt.spec
    beyond = f"{spec.layer_prefix(spec.num_layers)}.input_layernorm.weight"
    if ckpt.has(beyond):
        raise CheckpointError(f"{ckpt.index[beyond]}: tensor '{beyond}' exists but config.json declares only "
                              f"{spec.num_layers} layers (num_hidden_layers); set it to the number the weights hold")
    # the first MoE layer, found without listing every layer config.json claims (this runs before the tensor check)
    layer = next((layer for layer in range(spec.num_layers) if layer not in spec.dense_layers), None)
    if layer is None or _is_fused(ckpt, layer):
        return
    extra = spec.expert_tensor_name(layer, spec.num_experts, 0)
    if ckpt.has(extra):
        raise CheckpointError(f"{ckpt.index[extra]}: tensor '{extra}' exists but config.json declares only {spec.num_experts} experts")
