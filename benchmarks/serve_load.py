"""Load on `specter serve`: time to first token and tokens per second at 1, 4 and 16 concurrent clients.

Starts the server itself (any option it does not know goes to `specter serve`: --budget, --residents, --link,
--k, ...), or drives one already running (--url). Each client sends `--requests` streamed completions one
after another (greedy, the same prompt); a level's tokens/s is all its tokens over its wall time.

    python benchmarks/serve_load.py --model PATH --budget 24GiB --out benchmarks/results/serve_load.json
    python benchmarks/serve_load.py --model tiny --device cpu --residents 2 --max-tokens 8 --concurrency 1 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PROMPT = "Once upon a time there was a small model that could not hold all of its experts in memory, so"
ANNOUNCE = re.compile(r"specter serve: (\S+) on (http://\S+)/v1")


def _count(noun: str) -> Any:
    """An argparse type: a whole number of `noun` from 1 (0 clients measure nothing, and the medians of nothing are an
    error, not a result)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of {noun}, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be 1 or more {noun}, got {value}")
        return value
    parse.__name__ = noun  # argparse names the type in its own messages
    return parse


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="checkpoint or built-in model for the server it starts")
    parser.add_argument("--url", default=None, help="a running server (http://HOST:PORT) instead of starting one")
    parser.add_argument("--served-model-name", default=None, help="model name to ask for (default: the server's only one)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--concurrency", type=_count("clients"), nargs="+", default=[1, 4, 16], metavar="N")
    parser.add_argument("--requests", type=_count("requests"), default=2, metavar="N", help="requests per client per level (default 2)")
    parser.add_argument("--max-tokens", type=_count("tokens"), default=64)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--out", default="serve_load.json", help="JSON results (default: ./serve_load.json)")
    return parser.parse_known_args(argv)


def start_server(model: str, server_args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """`python -m specter serve` on a free loopback port; returns once it listens."""
    command = [sys.executable, "-m", "specter", "serve", "--model", model, "--port", "0", *server_args]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    for line in process.stderr:
        sys.stderr.write(line)
        if match := ANNOUNCE.search(line):
            # Keep reading its log, or a chatty server would block on a full pipe.
            threading.Thread(target=lambda: [sys.stderr.write(rest) for rest in process.stderr], daemon=True).start()
            return process, match.group(2)
    raise SystemExit(f"the server exited ({process.wait()}) before listening: {' '.join(command)}")


async def one_request(client: Any, model: str, args: argparse.Namespace) -> dict[str, float]:
    """One streamed completion, read as server-sent events (plain httpx: the GPU machine has no openai client)."""
    body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft_s": first - start, "tokens": tokens, "seconds": end - start,
            "decode_tokens_per_s": (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0}


async def level(client: Any, model: str, clients: int, args: argparse.Namespace) -> dict[str, Any]:
    async def one_client() -> list[dict[str, float]]:
        return [await one_request(client, model, args) for _ in range(args.requests)]

    start = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(one_client() for _ in range(clients))) for r in rs]
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "decode_tokens_per_s_per_request": statistics.mean(r["decode_tokens_per_s"] for r in results),
            "raw": results}


def server_metrics(url: str) -> dict[str, float]:
    import httpx

    wanted = ("specter_acceptance_rate", "specter_mean_accepted_length", "specter_expert_hit_rate",
              "specter_h2d_bytes_per_token", "specter_stall_seconds_total", "specter_generation_tokens_total")
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout,
                                 limits=httpx.Limits(max_connections=max(args.concurrency) + 4)) as client:
        listed = (await client.get("/v1/models")).json()
        model = args.served_model_name or listed["data"][0]["id"]
        await one_request(client, model, args)  # warm-up: first-request costs stay out of the table
        levels = [await level(client, model, clients, args) for clients in args.concurrency]
    return {"model": model, "levels": levels}


def table(levels: list[dict[str, Any]]) -> str:
    rows = [f"{'clients':>7}  {'requests':>8}  {'tokens/s':>9}  {'TTFT p50 ms':>11}  {'TTFT p90 ms':>11}  {'per-request tok/s':>17}"]
    for r in levels:
        rows.append(f"{r['clients']:>7}  {r['requests']:>8}  {r['tokens_per_s']:>9.1f}  {r['ttft_p50_s'] * 1e3:>11.1f}  "
                    f"{r['ttft_p90_s'] * 1e3:>11.1f}  {r['decode_tokens_per_s_per_request']:>17.1f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(argv)
    process = None
    if args.url is None:
        process, url = start_server(args.model, server_args)
    elif server_args:
        raise SystemExit(f"options {server_args} are for a server this script starts; drop them or drop --url")
    else:
        url = args.url.rstrip("/")
    try:
        results = asyncio.run(run(args, url))
        results |= {"server_metrics": server_metrics(url), "command": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
                    "server_args": server_args, "max_tokens": args.max_tokens, "requests_per_client": args.requests,
                    "machine": platform.platform(), "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=120)
    print(table(results["levels"]))
    print("server: " + ", ".join(f"{k.removeprefix('specter_')} {v:.3g}" for k, v in results["server_metrics"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
