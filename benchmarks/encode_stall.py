"""How long encoding a long prompt holds other threads (the server's event loop among them): a thread encodes TEXT_MB
of text with the built-in tokenizer while the main thread sleeps 2 ms at a time; the longest gap between its
wake-ups is the stall. Both ways the tokenizers library offers for a batch, in one process: `encode_batch` (offsets
kept) and `encode_batch_fast` (what `Tokenizer.encode` takes for a long text), each REPEATS times.

    python benchmarks/encode_stall.py [TEXT_MB] [REPEATS]
"""

from __future__ import annotations

import sys
import threading
import time

from specter.builtin import builtin_path
from specter.tokenizer import Tokenizer


def stall(work) -> tuple[float, float]:
    """(the longest gap between the main thread's 2 ms wake-ups while `work` ran in another thread, its seconds)."""
    worker = threading.Thread(target=work)
    started = last = time.perf_counter()
    worst = 0.0
    worker.start()
    while worker.is_alive():
        time.sleep(0.002)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst, last - started


def main() -> int:
    megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tokenizer = Tokenizer.from_dir(builtin_path("tiny"))
    assert tokenizer is not None
    sentence = "the draft proposes tokens and the target verifies them. "
    text = (sentence * (int(megabytes * 1e6) // len(sentence) + 1))[:int(megabytes * 1e6)]
    backend = tokenizer.backend
    print(f"| way | longest stall ms (of {repeats}) | encode s (median) |")
    print("|---|---|---|")
    for name in ("encode_batch", "encode_batch_fast"):
        encode = getattr(backend, name)
        runs = [stall(lambda: list(encode([text])[0].ids)) for _ in range(repeats)]
        print(f"| {name} | {max(gap for gap, _ in runs) * 1e3:.0f} | {sorted(s for _, s in runs)[len(runs) // 2]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
