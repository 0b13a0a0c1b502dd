"""Train the benchmark's reference MoE: a Mixtral-format model on the Python standard library's text, byte-level.

Random weights route at random; this model has learned routing, so it gives realistic routing locality
and draft acceptance. Its experts are sized so that copying one over PCIe takes at least 20 times as long
as computing it (printed, and recorded in reference.json). GPU: `python benchmarks/reference_model.py --out DIR`
(trains for --minutes, default 5). CPU smoke test: `--tiny` (seconds). The checkpoint loads with
`Runtime.load(DIR)` and `python -m specter.bench --model DIR`, which reads DIR/prompts.json.

`--family qwen2_moe` trains the Qwen1.5-MoE-A2.7B shape instead (first 8 of its 24 layers: hidden 2048,
60 experts top-4 of width 1408, a shared expert of width 5632; 17.3 MB per bf16 expert): the issue-4
figures on that shape with learned routing rather than random weights.

`--shape NAME` trains a real shape at full depth, narrow: `specter.bench.widen.shape_narrow_config(NAME, F)`
keeps the depth, expert count, top-k, routing function and shared-expert layout at 1/F of the width (same head dim,
fewer heads), with a byte vocabulary. Each MoE layer's router gets its own load-balancing loss (see BalanceLoss), with
the family's coefficient; DeepSeek-V2's is its sequence-level loss. The output directory holds the narrow checkpoint,
train.json (held-out loss, tokens/s, the balance loss), held_out.json (held-out windows for
`python -m specter.bench.realism`) and prompts.json; the bench reads it widened, lazily (`WidenedCheckpoint(DIR, F)`), or
`--widen DST` writes the widened checkpoint. `--reuse` keeps a finished run of the same settings (a warm machine's cache).
CPU smoke test: `--shape NAME --tiny` (2 layers, at most 8 experts, the largest factor; seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script from anywhere: specter is importable without an install

# Measured on the H200 (2026-11-29): hidden 1024 / width 6144 experts (36 MiB) copy in 0.69 ms but compute in
# 0.07 ms, only 9.7x; width 16384 at hidden 1536 (151 MB per expert) gives about 2.7 ms of copy per expert.
GPU_SHAPE = dict(hidden_size=1536, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4, num_local_experts=8,
                 num_experts_per_tok=2, intermediate_size=16384)
SMALL_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                   num_experts_per_tok=2, intermediate_size=512)  # trainable on a CPU in minutes: routing with structure
QWEN_SHAPE = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                  num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, intermediate_size=5632)
QWEN_SMALL_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, num_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512,
                        intermediate_size=512)  # the Qwen2-MoE layout (fine-grained top-4 + shared expert) a CPU trains in minutes
QWEN_TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128, intermediate_size=128)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, intermediate_size=128)
GEN5_BYTES_PER_S = 55e9  # measured pinned H2D on the H200 machine (shared/device/README.md)
HELD_OUT_EVERY = 20  # every 20th file is held out: evaluation text and benchmark prompts
HELD_OUT_WINDOWS = 8  # held-out windows saved for the realism report (held_out.json), of --length bytes each

# The router load-balancing coefficient each family was trained with (config.json of the released checkpoints;
# transformers' defaults where the release does not say): Mixtral-8x7B 0.02, Qwen1.5-MoE and Qwen3-MoE 0.001, OLMoE 0.01
# (its paper), Phi-3.5-MoE 0.001 (transformers' PhimoeConfig default), DeepSeek-V2 alpha_1 = 0.001 (expert-level,
# per sequence; transformers' DeepseekV2 has no aux loss, so BalanceLoss adds it).
BALANCE_COEF = {"mixtral": 0.02, "qwen2_moe": 0.001, "qwen3_moe": 0.001, "olmoe": 0.01, "phimoe": 0.001, "deepseek_v2": 0.001}
TINY_EXPERTS = 8  # --shape --tiny: at most this many experts (and top-k at most half of them), 2 layers
PROMPT_BYTES = 16
PROMPTS_PER_KIND = 8


# ---- corpus ----------------------------------------------------------------------------------------------

def stdlib_files(limit_bytes: int | None = None) -> list[Path]:
    """The standard library's .py files (code, docstrings, comments; pydoc_data/topics.py is the reference manual's prose)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        sys.exit(f"no standard library sources under {root}; this trainer needs them as its corpus")
    if limit_bytes is not None:
        kept, total = [], 0
        for path in files:
            kept.append(path)
            total += path.stat().st_size
            if total >= limit_bytes:
                break
        files = kept
    return files


def split_corpus(files: list[Path]) -> tuple[bytes, list[Path]]:
    """Training bytes (all files but every HELD_OUT_EVERY-th) and the held-out files."""
    train, held = [], []
    for index, path in enumerate(files):
        (held if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(path)
    return b"\n".join(p.read_bytes() for p in train), held


def prompt_snippets(held: list[Path]) -> dict[str, list[list[int]]]:
    """16-byte prompts of three kinds from held-out files: code lines, docstrings, and comment prose."""
    patterns = {"code": rb"\n    (?:def |if |for |return |self\.)", "docs": rb'"""[A-Z][a-z]', "prose": rb"\n\s*# [A-Z][a-z]+ [a-z]"}
    kinds: dict[str, list[list[int]]] = {kind: [] for kind in patterns}
    for path in held:
        text = path.read_bytes()
        for kind, pattern in patterns.items():
            for match in re.finditer(pattern, text):
                start = match.start() + (3 if kind == "docs" else len(match.group(0)) - len(match.group(0).lstrip()))
                snippet = text[start : start + PROMPT_BYTES]
                if len(snippet) == PROMPT_BYTES and len(kinds[kind]) < PROMPTS_PER_KIND:
                    kinds[kind].append(list(snippet))
                    break
    return kinds


def batches(data: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    """Endless random windows [batch, length + 1] of the byte stream."""
    while True:
        starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=generator)
        yield torch.stack([data[s : s + length + 1] for s in starts.tolist()])


# ---- model -----------------------------------------------------------------------------------------------

def make_model(shape: dict, device: torch.device, family: str = "mixtral"):
    common = dict(vocab_size=256, max_position_embeddings=4096, tie_word_embeddings=False, output_router_logits=True,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    if family == "qwen2_moe":  # Qwen1.5-MoE's choices: unnormalised top-k weights, every layer sparse, q/k/v biases
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(router_aux_loss_coef=0.001, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                                use_sliding_window=False, **common)
        with torch.device(device):  # built where it trains: 18 GB of fp32 weights need not pass through the host
            return Qwen2MoeForCausalLM(config)
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(rope_theta=10000.0, router_aux_loss_coef=0.01, sliding_window=None, **common)
    with torch.device(device):
        return MixtralForCausalLM(config)


# ---- real shapes, narrow and at full depth -------------------------------------------------------------------

def shape_config(shape: str, factor: int | None = None, layers: int | None = None, tiny: bool = False) -> dict:
    """The narrow config.json of a real shape with the byte vocabulary; `layers` cuts the depth (smoke tests only);
    tiny: 2 layers, the largest factor, at most TINY_EXPERTS experts."""
    from specter.bench.widen import DEFAULT_FACTORS, shape_narrow_config

    if tiny and factor is None:
        factor = max(f for f in (1, 2, 4, 8, 16) if _divides(shape, f))
    config = shape_narrow_config(shape, DEFAULT_FACTORS[shape] if factor is None else factor, vocab_size=256)
    if tiny:
        layers = layers or 2
        for field in ("num_experts", "num_local_experts", "n_routed_experts"):
            if field in config:
                config[field] = min(config[field], TINY_EXPERTS)
                config["num_experts_per_tok"] = min(config["num_experts_per_tok"], config[field] // 2)
    if layers is not None:
        config["num_hidden_layers"] = layers
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[field] = None  # bytes have no special tokens (transformers' class defaults lie beyond 256)
    config["max_position_embeddings"] = min(config.get("max_position_embeddings", 4096), 4096)
    return config


def _divides(shape: str, factor: int) -> bool:
    from specter.bench.widen import shape_narrow_config
    from specter.errors import ConfigError

    try:
        shape_narrow_config(shape, factor)
    except ConfigError:
        return False
    return True


def make_shape_model(config: dict, device: torch.device):
    """transformers' own model of the config's family; routers' balance losses come from BalanceLoss, not from
    transformers (whose loss pools every layer's routing: one layer can stay unbalanced while others make up for it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    family = config["model_type"]
    hf_config = AutoConfig.for_model(family, **fields, output_router_logits=False, router_aux_loss_coef=BALANCE_COEF[family])
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config)


def recompute_activations(model, count: int) -> None:
    """The first `count` decoder layers run under non-reentrant activation checkpointing: their forward keeps only its
    inputs, and the backward pass runs it again. Not a setting of the run (`--reuse` ignores it): the recomputed forward
    is the same function of the same inputs, so the weights are those of a run without it, up to the GPU's
    non-deterministic sums. transformers' own switch is all layers or none, and its flag has moved between versions."""
    from torch.utils.checkpoint import checkpoint

    layers = model.model.layers
    if not 0 <= count <= len(layers):
        raise SystemExit(f"--recompute-layers {count}: the model has {len(layers)} decoder layers; give 0 to {len(layers)}")
    for layer in list(layers)[:count]:
        forward = layer.forward
        layer.forward = functools.partial(checkpoint, forward, use_reentrant=False)


class BalanceLoss:
    """Each MoE layer's router load-balancing loss, from hooks on the routers' inputs, summed over layers.

    Per layer (Switch / Megatron, what the real models' trainers compute per layer): E * sum_i f_i * P_i, f_i the share
    of the batch's top-k assignments that go to expert i, P_i the mean router probability of expert i; 1 when balanced.
    DeepSeek-V2 (per_sequence): the same per sequence, averaged over sequences (its `seq_aux` loss, alpha_1). The
    probabilities are softmax(x W^T) of the router's own input and weight, whatever the router module returns, so
    this works across transformers versions. `loss()` is coef * the sum; call `start(batch, length)` before a forward.
    """

    def __init__(self, model, family: str, top_k: int, num_experts: int) -> None:
        self.coef, self.top_k, self.num_experts = BALANCE_COEF[family], top_k, num_experts
        self.per_sequence = family == "deepseek_v2"
        self.routers = [(name, module) for name, module in model.named_modules()
                        if name.rsplit(".", 1)[-1] in ("gate", "router") and _router_weight(module, num_experts) is not None]
        assert self.routers, f"no router found in the {family} model (modules named *.gate or *.router with [E, D] weights)"
        self.inputs: list[torch.Tensor] = []
        self.shape = (1, -1)
        self.handles = [module.register_forward_pre_hook(self._keep) for _, module in self.routers]

    def _keep(self, module, args) -> None:
        if len(self.inputs) == len(self.routers):  # a layer's forward run again in the backward pass (--recompute-layers)
            return
        self.inputs.append((args[0], _router_weight(module, self.num_experts)))

    def start(self, batch: int, length: int) -> None:
        self.inputs, self.shape = [], (batch, length)

    def layer_losses(self) -> torch.Tensor:
        """[MoE layers] the unscaled loss of each router called since `start`."""
        losses = []
        for x, weight in self.inputs:
            logits = F.linear(x.float(), weight.float()).reshape(*self.shape, self.num_experts)  # [B, T, E]
            probs = logits.softmax(-1)
            chosen = F.one_hot(logits.topk(self.top_k, dim=-1).indices, self.num_experts).sum(-2).float()  # [B, T, E]
            dims = (1,) if self.per_sequence else (0, 1)
            f = chosen.mean(dims) / self.top_k  # shares of the assignments: sum to 1
            p = probs.mean(dims)
            losses.append((self.num_experts * (f * p).sum(-1)).mean())
        return torch.stack(losses)

    def loss(self) -> torch.Tensor:
        return self.coef * self.layer_losses().sum()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _router_weight(module, num_experts: int) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts else None


def num_experts_of(config: dict) -> int:
    return next(config[f] for f in ("num_experts", "num_local_experts", "n_routed_experts") if f in config)


def expert_width(shape: dict) -> int:
    return shape.get("moe_intermediate_size", shape["intermediate_size"])


def copy_compute_ratio(shape: dict, device: torch.device) -> dict[str, float]:
    """One expert's PCIe copy time over its compute time at 1 token (measured on CUDA; estimated elsewhere)."""
    hidden, inter = shape["hidden_size"], expert_width(shape)
    expert_bytes = 3 * hidden * inter * 2  # bf16
    if device.type != "cuda":
        return {"expert_bytes": expert_bytes, "copy_ms": 1e3 * expert_bytes / GEN5_BYTES_PER_S, "compute_ms": float("nan"),
                "ratio": float("nan"), "measured": False}
    host = torch.empty(expert_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    target = torch.empty_like(host, device=device)
    w13 = torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(hidden, inter, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)

    def expert() -> None:
        gate_up = F.linear(x, w13)
        F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2)

    copy_ms = _cuda_ms(lambda: target.copy_(host, non_blocking=True))
    compute_ms = _cuda_ms(expert)
    return {"expert_bytes": expert_bytes, "copy_ms": copy_ms, "compute_ms": compute_ms, "ratio": copy_ms / compute_ms, "measured": True}


def _cuda_ms(work, repeats: int = 30) -> float:
    for _ in range(3):
        work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# ---- training ----------------------------------------------------------------------------------------------

def train(model, data: torch.Tensor, args: argparse.Namespace, device: torch.device,
          balance: BalanceLoss | None = None) -> dict[str, float]:
    """AdamW with warm-up and cosine decay until the time or step limit; bf16 autocast on CUDA. With `balance`, the
    loss is the next-byte cross-entropy plus every router's balance loss (else transformers' own loss). The cosine
    runs over the steps where `--max-steps` was given (`args.by_steps`: each step's rate then does not depend on the
    machine's speed, so the same steps train the same model anywhere), else over the minutes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")  # fused: no per-tensor temporaries (the Qwen shape is 4.6 B parameters)
    generator = torch.Generator().manual_seed(0)
    stream = batches(data, args.batch, args.length, generator)
    started, step, balance_value = time.monotonic(), 0, float("nan")
    model.train()
    while step < args.max_steps and time.monotonic() - started < 60 * args.minutes:
        fraction = (step / args.max_steps if args.by_steps
                    else min(1.0, (time.monotonic() - started) / (60 * args.minutes)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction)))
        tokens = next(stream).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if balance is None:
                loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1].clone()).loss
            else:
                loss, aux = balanced_loss(model, tokens, balance)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % args.log_every == 0:
            elapsed = time.monotonic() - started
            balance_value = float(aux) if balance is not None else float("nan")  # await point: a host read per log line
            print(f"step {step} loss {float(loss.detach()):.3f} balance {balance_value:.4f} ({elapsed:.0f} s, "
                  f"{step * args.batch * args.length / elapsed:,.0f} tokens/s)", flush=True)
    seconds = time.monotonic() - started
    tokens_seen = step * args.batch * args.length
    stats = {"steps": step, "tokens": tokens_seen, "seconds": seconds, "tokens_per_s": tokens_seen / seconds,
             "last_loss": float(loss.detach())}
    if balance is not None:
        stats["last_balance_loss"] = float(aux)
    if device.type == "cuda":
        stats["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return stats


def balanced_loss(model, tokens: torch.Tensor, balance: BalanceLoss) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy + balance loss, the balance loss alone, detached) of one batch [B, T + 1]."""
    balance.start(tokens.shape[0], tokens.shape[1] - 1)
    logits = model(input_ids=tokens[:, :-1]).logits
    cross_entropy = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    aux = balance.loss()
    return cross_entropy + aux, aux.detach()


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    model.eval()
    stream = batches(data, args.batch, args.length, torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        tokens = next(stream).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=tokens[:, :-1]).logits
        losses.append(float(F.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))))
    return sum(losses) / len(losses)


# ---- saving ------------------------------------------------------------------------------------------------

def save_tokenizer(out: Path) -> None:
    """A byte-level tokenizer (id = byte value, no merges) in Hugging Face format."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("tokenizers not installed: no tokenizer saved (ids are byte values)")
        return
    symbols = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(out)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


def build_parser() -> argparse.ArgumentParser:
    from specter.bench.widen import DEFAULT_FACTORS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny model for tests: CPU, a few steps, seconds")
    parser.add_argument("--family", default="mixtral", choices=["mixtral", "qwen2_moe"],
                        help="mixtral: the reference shape; qwen2_moe: the Qwen1.5-MoE-A2.7B shape, first 8 layers")
    parser.add_argument("--shape", choices=sorted(DEFAULT_FACTORS), default=None,
                        help="a real shape, narrow at full depth; overrides --family and --small")
    parser.add_argument("--factor", type=int, default=None, help="with --shape: F (default: widen's DEFAULT_FACTORS)")
    parser.add_argument("--layers", type=int, default=None, help="with --shape: cut the depth (smoke tests only)")
    parser.add_argument("--widen", type=Path, default=None, help="with --shape: also write the widened (bf16) checkpoint here")
    parser.add_argument("--reuse", action="store_true", help="with --shape: keep OUT when its train.json has these settings")
    parser.add_argument("--small", action="store_true",
                        help="a small model a CPU trains in minutes (hidden 256, 4 layers; mixtral: 8 experts top-2, qwen2_moe: 16 "
                             "top-4 and a shared expert): trained routing off the GPU")
    parser.add_argument("--minutes", type=float, default=5.0, help="training time limit")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="train this many steps, the learning rate's cosine over them (--minutes then only caps it)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--recompute-layers", type=int, default=0, metavar="N",
                        help="with --shape: the first N decoder layers keep no activations and recompute them in the "
                             "backward pass (the same weights, less GPU memory: Qwen3-30B-A3B's batch 32 peaks at 91 GiB "
                             "without, beyond an H100's 80)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def load_corpus(tiny: bool) -> tuple[torch.Tensor, torch.Tensor, list[Path], int]:
    """(training bytes, held-out bytes, held-out files, number of files) of the standard-library corpus."""
    files = stdlib_files(limit_bytes=2_000_000 if tiny else None)
    train_bytes, held = split_corpus(files)
    held_bytes = b"\n".join(p.read_bytes() for p in held)
    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    held_data = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8).long()
    print(f"corpus: {len(files)} files, {len(train_bytes) / 1e6:.1f} MB training, {len(held_bytes) / 1e6:.2f} MB held out")
    return data, held_data, held, len(files)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.by_steps = args.max_steps is not None  # before either path gives max_steps its default
    if args.shape is not None:
        return main_shape(args)
    tiny, small = args.tiny, args.small and not args.tiny
    args.max_steps = args.max_steps or (30 if tiny else 10**9)
    args.batch = args.batch or (4 if tiny else 8 if small else 16 if args.family == "qwen2_moe" else 32)
    args.length = args.length or (64 if tiny else 128 if small else 512)
    args.lr = args.lr or (3e-3 if tiny or small else 6e-4)
    device = torch.device(args.device)
    if device.type == "cpu" and not small:
        torch.set_num_threads(1)  # small matrices: thread hand-offs cost more than they bring
    if args.family == "qwen2_moe":
        shape = QWEN_TINY_SHAPE if tiny else QWEN_SMALL_SHAPE if small else QWEN_SHAPE
    else:
        shape = TINY_SHAPE if tiny else SMALL_SHAPE if small else GPU_SHAPE
    torch.manual_seed(0)

    ratio = copy_compute_ratio(shape, device)
    print(f"one expert: {ratio['expert_bytes'] / 2**20:.1f} MiB bf16; copy {ratio['copy_ms']:.3f} ms at Gen5, compute "
          f"{ratio['compute_ms']:.4f} ms at 1 token: copy/compute = {ratio['ratio']:.1f}x ({'measured' if ratio['measured'] else 'not measured off CUDA'})")
    if ratio["measured"] and ratio["ratio"] < 20 and args.family == "mixtral":  # the Qwen shape's experts are fixed by the model
        print("warning: an expert's copy takes less than 20x its compute; raise intermediate_size", file=sys.stderr)

    data, held_data, held, file_count = load_corpus(tiny)
    model = make_model(shape, device, args.family)
    stats = train(model, data, args, device)
    stats["held_out_loss"] = held_out_loss(model, held_data, args, device)
    print(f"trained {stats['steps']} steps ({stats['tokens'] / 1e6:.1f} M tokens) in {stats['seconds']:.0f} s; "
          f"held-out loss {stats['held_out_loss']:.3f} nats/byte")

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32 if tiny or small else torch.bfloat16).save_pretrained(args.out)
    save_tokenizer(args.out)
    (args.out / "prompts.json").write_text(json.dumps({"kinds": prompt_snippets(held)}))
    (args.out / "reference.json").write_text(json.dumps({"shape": shape, "copy_compute": ratio, "training": stats,
                                                         "corpus_files": file_count, "tiny": tiny, "small": small,
                                                         "family": args.family}, indent=1))
    print(f"saved to {args.out}")
    return 0


def main_shape(args: argparse.Namespace) -> int:
    """--shape: train the narrow full-depth model, save it with train.json and held_out.json, optionally widen it."""
    from specter.bench.widen import DEFAULT_FACTORS

    tiny = args.tiny
    factor = args.factor if args.factor is not None or tiny else DEFAULT_FACTORS[args.shape]
    config = shape_config(args.shape, factor, args.layers, tiny)
    factor = factor if factor is not None else _tiny_factor(args.shape)
    args.max_steps = args.max_steps or (20 if tiny else 10**9)
    args.batch = args.batch or (2 if tiny else 32)
    args.length = args.length or (32 if tiny else 512)
    args.lr = args.lr or (3e-3 if tiny else 1e-3)
    settings = {"shape": args.shape, "factor": factor, "layers": config["num_hidden_layers"], "tiny": tiny,
                "minutes": args.minutes, "max_steps": args.max_steps, "by_steps": args.by_steps, "batch": args.batch,
                "length": args.length, "lr": args.lr}
    if args.reuse and _finished(args.out, settings):
        print(f"{args.out} already holds this run (train.json); kept")
        return _maybe_widen(args, factor)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # small matrices: thread hand-offs cost more than they bring
    torch.manual_seed(0)
    data, held_data, held, file_count = load_corpus(tiny)
    model = make_shape_model(config, device)
    recompute_activations(model, args.recompute_layers)
    experts = num_experts_of(config)
    balance = BalanceLoss(model, config["model_type"], config["num_experts_per_tok"], experts)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape} at 1/{factor} width, {config['num_hidden_layers']} layers, {experts} experts top-"
          f"{config['num_experts_per_tok']}, hidden {config['hidden_size']}: {params / 1e6:.1f} M parameters; balance loss "
          f"coefficient {balance.coef} over {len(balance.routers)} routers{' per sequence' if balance.per_sequence else ''}")
    stats = train(model, data, args, device, balance)
    stats["held_out_loss"] = held_out_loss(model, held_data, args, device)
    stats["held_out_balance"] = held_out_balance(model, held_data, args, device, balance)
    balance.close()
    print(f"trained {stats['steps']} steps ({stats['tokens'] / 1e6:.1f} M tokens, {stats['tokens_per_s']:,.0f} tokens/s) in "
          f"{stats['seconds']:.0f} s; held-out loss {stats['held_out_loss']:.3f} nats/byte; per-layer balance loss "
          f"{stats['held_out_balance']['mean']:.3f} (1 is balanced); peak GPU {stats.get('peak_gpu_gib', 0):.1f} GiB")
    save_shape_run(args.out, model, config, held, held_data, args, {**settings, "training": stats, "params": params,
                                                                    "corpus_files": file_count, "device": str(device),
                                                                    "balance_coef": balance.coef,
                                                                    "balance_per_sequence": balance.per_sequence})
    return _maybe_widen(args, factor)


def _tiny_factor(shape: str) -> int:
    return max(f for f in (1, 2, 4, 8, 16) if _divides(shape, f))


@torch.no_grad()
def held_out_balance(model, data: torch.Tensor, args: argparse.Namespace, device: torch.device, balance: BalanceLoss) -> dict:
    """Each router's unscaled balance loss on held-out text (1: balanced; E / k: every token to the same k experts)."""
    model.eval()
    tokens = next(batches(data, args.batch, args.length, torch.Generator().manual_seed(2))).to(device)
    balance.start(tokens.shape[0], tokens.shape[1] - 1)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        model(input_ids=tokens[:, :-1])
    layers = [round(v, 4) for v in balance.layer_losses().tolist()]
    return {"mean": sum(layers) / len(layers), "max": max(layers), "per_router": layers}


def held_out_windows(data: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """`count` seeded windows of `length` held-out bytes, for the realism report."""
    starts = torch.randint(0, data.numel() - length, (count,), generator=torch.Generator().manual_seed(3))
    return [data[s : s + length].tolist() for s in starts.tolist()]


def save_shape_run(out: Path, model, config: dict, held: list[Path], held_data: torch.Tensor, args: argparse.Namespace,
                   record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32 if args.tiny else torch.bfloat16).save_pretrained(out)
    save_tokenizer(out)
    (out / "prompts.json").write_text(json.dumps({"kinds": prompt_snippets(held)}))
    (out / "held_out.json").write_text(json.dumps({"windows": held_out_windows(held_data, HELD_OUT_WINDOWS, args.length)}))
    (out / "train.json").write_text(json.dumps({**record, "narrow_config": config}, indent=1))
    print(f"saved to {out}")


def _finished(out: Path, settings: dict) -> bool:
    """Whether `out` holds a finished run of exactly `settings`; where it holds one of other settings, say which
    differ (a warm machine's checkpoint is then trained again: give the first call's settings to reuse it)."""
    record = out / "train.json"
    if not record.is_file() or not (out / "config.json").is_file():
        return False
    saved = json.loads(record.read_text())
    differ = {key: (saved.get(key), value) for key, value in settings.items() if saved.get(key) != value}
    if differ:
        print(f"{out} holds a run of other settings, trained again: "
              + ", ".join(f"{key} {old} there, {new} asked" for key, (old, new) in differ.items()), flush=True)
    return not differ


def _maybe_widen(args: argparse.Namespace, factor: int) -> int:
    if args.widen is None:
        return 0
    import shutil

    from specter.bench.widen import widen_checkpoint

    started = time.monotonic()
    widen_checkpoint(args.out, args.widen, factor, dtype=torch.bfloat16)
    for name in ("train.json", "held_out.json"):  # widen copies prompts.json and the tokenizer itself
        shutil.copyfile(args.out / name, args.widen / name)
    print(f"widened x{factor} to {args.widen} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
