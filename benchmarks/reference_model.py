"""Train the benchmark's reference MoE: a Mixtral-format model on the Python standard library's text, byte-level.

Random weights route at random; this model has learned routing, so it gives realistic routing locality
and draft acceptance. Its experts are sized so that copying one over PCIe takes at least 20 times as long
as computing it (printed, and recorded in reference.json). GPU: `python benchmarks/reference_model.py --out DIR`
(trains for --minutes, default 5). CPU smoke test: `--tiny` (seconds). The checkpoint loads with
`Runtime.load(DIR)` and `python -m specter.bench --model DIR`, which reads DIR/prompts.json.

`--family qwen2_moe` trains the Qwen1.5-MoE-A2.7B shape instead (first 8 of its 24 layers: hidden 2048,
60 experts top-4 of width 1408, a shared expert of width 5632; 17.3 MB per bf16 expert): the issue-4
figures on that shape with learned routing rather than random weights.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

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

def train(model, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """AdamW with warm-up and cosine decay until the time or step limit; bf16 autocast on CUDA."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")  # fused: no per-tensor temporaries (the Qwen shape is 4.6 B parameters)
    generator = torch.Generator().manual_seed(0)
    stream = batches(data, args.batch, args.length, generator)
    started, step, loss_value = time.monotonic(), 0, float("nan")
    model.train()
    while step < args.max_steps and time.monotonic() - started < 60 * args.minutes:
        fraction = min(1.0, (time.monotonic() - started) / (60 * args.minutes))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction)))
        tokens = next(stream).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1].clone()).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % args.log_every == 0:
            loss_value = float(loss.detach())
            print(f"step {step} loss {loss_value:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    return {"steps": step, "tokens": step * args.batch * args.length, "seconds": time.monotonic() - started, "last_loss": float(loss.detach())}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny model for tests: CPU, a few steps, seconds")
    parser.add_argument("--family", default="mixtral", choices=["mixtral", "qwen2_moe"],
                        help="mixtral: the reference shape; qwen2_moe: the Qwen1.5-MoE-A2.7B shape, first 8 layers")
    parser.add_argument("--small", action="store_true",
                        help="a small model a CPU trains in minutes (hidden 256, 4 layers; mixtral: 8 experts top-2, qwen2_moe: 16 "
                             "top-4 and a shared expert): trained routing off the GPU")
    parser.add_argument("--minutes", type=float, default=5.0, help="training time limit")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
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

    files = stdlib_files(limit_bytes=2_000_000 if tiny else None)
    train_bytes, held = split_corpus(files)
    held_bytes = b"\n".join(p.read_bytes() for p in held)
    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    held_data = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8).long()
    print(f"corpus: {len(files)} files, {len(train_bytes) / 1e6:.1f} MB training, {len(held_bytes) / 1e6:.2f} MB held out")

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
                                                         "corpus_files": len(files), "tiny": tiny, "small": small,
                                                         "family": args.family}, indent=1))
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
