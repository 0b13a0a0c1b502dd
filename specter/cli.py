"""The command line: `specter generate` and `specter info`. Errors exit non-zero with the message on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from specter.errors import SpecterError


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specter", description="Speculative expert-offloaded MoE inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate tokens from a prompt")
    gen.add_argument("--model", default="tiny", help="checkpoint directory, or the name of a built-in model (default: tiny)")
    gen.add_argument("--prompt-ids", type=_ids, default=None, help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    gen.add_argument("--max-context", type=int, default=2048)
    gen.add_argument("--json", action="store_true", help="print one JSON object with `tokens` and `stats`")
    gen.add_argument("--log-json", action="store_true", help="structured logs as JSON lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specter import log

    log.configure(json=args.log_json)
    try:
        return {"generate": cmd_generate}[args.command](args)
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def cmd_generate(args: argparse.Namespace) -> int:
    from specter.builtin import resolve_model
    from specter.config import EngineConfig, GenerationConfig
    from specter.decode import greedy_decode, run_sync
    from specter.loader import load_resident

    engine_config = EngineConfig.build(device=args.device, dtype=args.dtype, max_context=args.max_context)
    generation = GenerationConfig.build(max_new_tokens=args.max_new_tokens)
    loaded = load_resident(resolve_model(args.model), engine_config)
    prompt = args.prompt_ids or [1, 2, 3, 4]
    started = time.perf_counter()
    tokens = run_sync(greedy_decode(loaded.model, loaded.experts, prompt, generation.max_new_tokens, generation.stop_token_ids))
    elapsed = time.perf_counter() - started
    stats = {"prompt_tokens": len(prompt), "new_tokens": len(tokens), "seconds": round(elapsed, 4),
             "tokens_per_s": round(len(tokens) / elapsed, 2)}
    if args.json:
        print(json.dumps({"tokens": tokens, "stats": stats}))
    else:
        print(" ".join(map(str, tokens)))
        print(f"[{stats['new_tokens']} tokens in {stats['seconds']} s, {stats['tokens_per_s']} tok/s]", file=sys.stderr)
    return 0
