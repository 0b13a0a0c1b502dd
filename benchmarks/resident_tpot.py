"""Resident decoding (every weight on the GPU, batch 1, bf16) of a real-shape MoE with synthetic weights.

Reports Specter's TPOT (exact and fast mode), the HBM floor (bytes of active weights read per token over
3.3 TB/s), their ratio, and transformers' own TPOT on the same in-memory checkpoint, in one run.

    python benchmarks/resident_tpot.py --shape qwen1.5-moe-a2.7b --out out/resident
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import torch

HBM_BYTES_PER_S = 3.3e12

SHAPES = {
    "qwen1.5-moe-a2.7b": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, norm_topk_prob=False, max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])),
    "olmoe-1b-7b": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # (not yet run on the GPU: added in the tenth session for the row kernels' layers without a shared expert)
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def build_hf(shape: str, layers: int | None):
    import transformers

    config_name, model_name, fields = SHAPES[shape]
    if layers:
        fields = dict(fields, num_hidden_layers=layers)
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
    return config, model


def active_bytes(runtime) -> int:
    """Bytes a one-token step reads: every non-expert weight except the embedding table (one row), plus top-A experts."""
    spec = runtime.spec
    dense = sum(t.numel() * t.element_size() for name, t in runtime.model.w.items() if name != "model.embed_tokens.weight")
    embed_row = spec.hidden_size * 2
    experts = len(spec.moe_layers) * spec.top_k * runtime.memory.expert_bytes
    return dense + embed_row + experts


def hf_tpot(model, prompt: list[int], tokens: int) -> float:
    ids = torch.tensor([prompt], device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)  # warm-up
    return (timed(tokens) - timed(1)) / (tokens - 1)


async def specter_tpot(config_dict: dict, state: dict, prompt: list[int], tokens: int, exact: bool):
    from specter.config import DraftConfig, EngineConfig, GenerationConfig
    from specter.engine import CheckpointWeights, Runtime
    from specter.model.checkpoint import InMemoryCheckpoint

    source = CheckpointWeights(InMemoryCheckpoint(config_dict, state))
    config = EngineConfig(device="cuda", dtype="bfloat16", exact=exact, max_context=512, lookahead="fixed", draft=DraftConfig(k=0))
    runtime = await Runtime.build(source, config)
    generation = GenerationConfig(max_new_tokens=tokens)
    await runtime.complete_ids(prompt, GenerationConfig(max_new_tokens=4))  # warm-up
    result = await runtime.complete_ids(prompt, generation)
    floor = active_bytes(runtime) / HBM_BYTES_PER_S
    await runtime.aclose()
    return result.stats.tpot_s, floor, result.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen1.5-moe-a2.7b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="truncate depth (labelled in the output)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hf-tokens", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="out/resident")
    args = parser.parse_args()
    config, hf = build_hf(args.shape, args.layers)
    config_dict = config.to_dict()
    state = {name: tensor for name, tensor in hf.state_dict().items()}
    prompt = list(range(100, 116))
    rows = {}
    for exact in (True, False):
        tpot, floor, tokens = asyncio.run(specter_tpot(config_dict, state, prompt, args.tokens, exact))
        rows["specter-exact" if exact else "specter-fast"] = {"tpot_ms": tpot * 1e3, "floor_ms": floor * 1e3, "ratio": tpot / floor}
    hf_ms = None if args.skip_hf else hf_tpot(hf, prompt, args.hf_tokens) * 1e3
    label = f"{args.shape}" + (f" (first {args.layers} layers)" if args.layers else "")
    result = {"shape": label, "rows": rows, "transformers_tpot_ms": hf_ms, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resident_tpot.json").write_text(json.dumps(result, indent=1))
    print(f"\nresident decoding, {label}, bf16, batch 1")
    print(f"{'system':<16}{'TPOT ms':>10}{'floor ms':>10}{'ratio':>8}")
    for name, row in rows.items():
        print(f"{name:<16}{row['tpot_ms']:>10.2f}{row['floor_ms']:>10.2f}{row['ratio']:>8.2f}")
    if hf_ms is not None:
        print(f"{'transformers':<16}{hf_ms:>10.2f}")


if __name__ == "__main__":
    main()
