"""Seconds per GB of widening a narrow checkpoint's routed experts as the engine's load reads them (specter.bench.widen).

    python benchmarks/widen_speed.py [SHAPE] [LAYERS] [DEVICE] [THREADS] [LAYOUT]
    python benchmarks/widen_speed.py mixtral-8x7b 2 cpu 1 experts

Writes a random bf16 narrow checkpoint of SHAPE (a name of specter.bench.synthetic.SHAPES) at its default factor
(widen.DEFAULT_FACTORS) with LAYERS decoder layers (default 2) into a temporary directory, LAYOUT `experts` (per-expert
tensors, as released checkpoints) or `fused` (transformers v5's [E, 2I, D] and [E, D, I]), then reads it as the
engine's loader does: `CheckpointWeights(WidenedCheckpoint(DIR, F, bfloat16, device=DEVICE)).experts(bfloat16)`, each
flat expert copied into one reused host buffer (pinned on CUDA), as `ExpertPool.write` copies it into the pool. DEVICE
is where widening runs (default cpu; `auto`: CUDA when present), THREADS torch's intra-op threads (default 1: what the
engine sets on CUDA, and on a CPU of fewer than 4 cores). The narrow file is read once before timing (page cache).
Prints one JSON line: widened expert bytes, seconds, seconds per GB (1e9 bytes), best of 3 passes. Whichever tree is
on PYTHONPATH is timed; DEVICE cpu also times one whose WidenedCheckpoint has no `device` yet (a before).
"""

from __future__ import annotations

import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specter.bench import widen
from specter.bench.widen import WidenedCheckpoint
from specter.build import CheckpointWeights
from specter.model.spec import spec_from_config


def write_narrow(shape: str, layers: int, layout: str, out: Path) -> int:
    """A random bf16 narrow checkpoint of `shape` with `layers` layers in `out`; returns F."""
    factor = widen.DEFAULT_FACTORS[shape]
    config = widen.shape_narrow_config(shape, vocab_size=256)
    config["num_hidden_layers"] = layers
    spec = spec_from_config(config)
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(dims, generator=generator) / 16).to(torch.bfloat16)
             for name, dims in widen.expected_shapes(spec).items()}
    if layout == "fused":
        for layer in spec.moe_layers:
            names = [[spec.expert_tensor_name(layer, e, which) for e in range(spec.num_experts)] for which in range(3)]
            gate, up, down = ([state.pop(name) for name in group] for group in names)
            prefix = f"{spec.layer_prefix(layer)}.mlp.experts"
            state[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
            state[f"{prefix}.down_proj"] = torch.stack(down)
            router = spec.router_name(layer)
            state[f"{spec.layer_prefix(layer)}.mlp.gate.weight"] = state.pop(router)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return factor


def time_experts(path: Path, factor: int, device: str) -> tuple[int, float]:
    """(widened expert bytes, seconds) of one pass of the engine's expert reader over the widened checkpoint."""
    options = {} if device == "cpu" and "device" not in inspect.signature(WidenedCheckpoint).parameters else {"device": device}
    source = CheckpointWeights(WidenedCheckpoint(path, factor, torch.bfloat16, **options))
    pinned = torch.cuda.is_available() and device != "cpu"
    sink = torch.empty(source.spec.expert_numel, dtype=torch.bfloat16, pin_memory=pinned)
    total = 0
    start = time.perf_counter()
    for _layer, _expert, flat in source.experts(torch.bfloat16, False):
        sink.copy_(flat.reshape(-1))
        total += flat.numel() * flat.element_size()
    seconds = time.perf_counter() - start
    source.close()
    return total, seconds


def main(argv: list[str]) -> int:
    shape = argv[0] if len(argv) > 0 else "mixtral-8x7b"
    layers = int(argv[1]) if len(argv) > 1 else 2
    device = argv[2] if len(argv) > 2 else "cpu"
    threads = int(argv[3]) if len(argv) > 3 else 1
    layout = argv[4] if len(argv) > 4 else "experts"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="widen-speed-") as tmp:
        factor = write_narrow(shape, layers, layout, Path(tmp))
        time_experts(Path(tmp), factor, device)  # warm: the page cache, the allocator, CUDA's context
        runs = [time_experts(Path(tmp), factor, device) for _ in range(3)]
    total, seconds = runs[0][0], min(s for _, s in runs)
    print(json.dumps({"shape": shape, "factor": factor, "layers": layers, "layout": layout, "device": device,
                      "threads": threads, "expert_bytes": total, "seconds": round(seconds, 3),
                      "s_per_GB": round(seconds / (total / 1e9), 3), "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
