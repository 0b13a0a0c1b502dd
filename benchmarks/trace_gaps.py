"""Where the GPU idles in an offloaded decode: reads a torch.profiler chrome trace (profile_offloaded.py's
trace.json) and reports, for the decode after the prefill, the copy stream's busy share, and for every window in
which neither the compute stream nor the copy stream runs anything (GPU idle for at least --min-idle-us), what the
host was doing then: a sampling profile over the trace's python_function events (the innermost frame covering each
sample point, and its caller), when the trace was recorded with stacks (`profile_offloaded.py --with-stack`).

    python benchmarks/trace_gaps.py out/profile/trace.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def busy_union(events: list[dict]) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (us) covered by the events."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def idle_windows(busy: list[tuple[float, float]], lo: float, hi: float, min_us: float) -> list[tuple[float, float]]:
    """The gaps of at least min_us between merged busy intervals inside [lo, hi]."""
    out, cursor = [], lo
    for start, end in busy:
        if end <= lo:
            continue
        if start - cursor >= min_us:
            out.append((cursor, min(start, hi)))
        cursor = max(cursor, end)
        if cursor >= hi:
            break
    if hi - cursor >= min_us:
        out.append((cursor, hi))
    return out


def innermost_samples(frames: list[dict], windows: list[tuple[float, float]], step_us: float,
                      own: tuple[str, ...] = ()) -> collections.Counter:
    """Sample each window every step_us; attribute each sample to the innermost python frame covering it
    (and that frame's caller), or with `own` to the innermost frame whose name holds one of those strings (the
    project's code, under the library calls it makes). Frames of one thread nest: one sweep with a stack serves."""
    frames = sorted(frames, key=lambda e: (e["ts"], -e.get("dur", 0)))
    points = [t for lo, hi in windows for t in _range(lo + step_us / 2, hi, step_us)]
    counts: collections.Counter = collections.Counter()
    stack: list[dict] = []
    index = 0
    for t in sorted(points):
        while index < len(frames) and frames[index]["ts"] <= t:
            frame = frames[index]
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= frame["ts"]:
                stack.pop()
            stack.append(frame)
            index += 1
        while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= t:
            stack.pop()
        chain = [f["name"] for f in stack if not own or any(part in f["name"] for part in own)]
        if chain:
            counts[(chain[-1], chain[-2] if len(chain) > 1 else "-")] += 1
        else:
            counts[("(no python frame)", "-")] += 1
    return counts


def _range(start: float, stop: float, step: float) -> list[float]:
    return [start + i * step for i in range(max(0, int((stop - start) / step) + 1)) if start + i * step < stop]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--min-idle-us", type=float, default=200.0)
    parser.add_argument("--step-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--own", default="specter/,policies/", help="comma-separated parts of the project's frame "
                        "names: samples go to the innermost such frame ('' for the innermost frame of any code)")
    args = parser.parse_args()
    events = json.loads(args.trace.read_text())["traceEvents"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    copies = sorted((e for e in device if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
                     and e.get("args", {}).get("bytes", 0) > 1e6), key=lambda e: e["ts"])  # fmt: skip
    eager = [e["ts"] for e in events if e.get("name") == "aten::index_add_"]  # the eager prefill's expert sums
    decode_from = max(eager) if eager else min(e["ts"] for e in device)
    decode = [e for e in device if e["ts"] > decode_from]
    lo, hi = min(e["ts"] for e in decode), max(e["ts"] + e.get("dur", 0) for e in decode)
    span = hi - lo
    copy_busy = sum(b - a for a, b in busy_union([c for c in copies if c["ts"] > decode_from]))
    idle = idle_windows(busy_union(decode), lo, hi, args.min_idle_us)
    idle_us = sum(b - a for a, b in idle)
    print(f"decode span {span / 1e3:.1f} ms; expert copies busy {copy_busy / span:.3f} of it; GPU idle (windows >= "
          f"{args.min_idle_us:.0f} us) {idle_us / 1e3:.1f} ms = {idle_us / span:.3f} in {len(idle)} windows")
    frames = [e for e in events if e.get("cat") == "python_function" and "dur" in e]
    if not frames:
        print("no python_function events: record the trace with stacks (profile_offloaded.py --with-stack)")
        return
    threads = collections.Counter(e["tid"] for e in frames)
    main_tid = threads.most_common(1)[0][0]
    own = tuple(part for part in args.own.split(",") if part)
    counts = innermost_samples([e for e in frames if e["tid"] == main_tid], idle, args.step_us, own)
    total = sum(counts.values())
    print(f"host during GPU-idle windows ({total} samples of {args.step_us:.0f} us), innermost "
          f"{'project ' if own else ''}frame <- its caller:")
    for (inner, caller), n in counts.most_common(args.top):
        print(f"{n / total:6.1%}  {inner[:70]}  <-  {caller[:60]}")


if __name__ == "__main__":
    main()
