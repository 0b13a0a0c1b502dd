"""plan's N for the widened model from tensor shapes alone (no GGUF): HF names -> (routed expert per layer, GPU, host)."""
import json, re, sys, math, torch
sys.path.insert(0, "/work/wt/llamadry2/benchmarks")
import llamacpp as L
from specter.bench.widen import WidenedCheckpoint, widen_tensor
from specter.model.checkpoint import Checkpoint

ROUTED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")  # routed experts (not shared_expert(s))

def split(model_dir, widen):
    if widen:
        wide = WidenedCheckpoint(model_dir, widen, torch.bfloat16)
        names = list(wide.names())
        def numel(name):
            src = "model.embed_tokens.weight" if wide.tied and name == "lm_head.weight" else name
            meta = torch.empty(wide.narrow.shape(src), dtype=torch.bfloat16, device="meta")
            return widen_tensor(name, meta, wide.narrow.spec, widen).numel()
    else:
        ck = Checkpoint(model_dir); names = list(ck.index); numel = lambda n: math.prod(ck.shape(n))
    layers, gpu, host = {}, 0, 0
    for name in names:
        # GGUF: 1-D tensors (norms) and routers (ffn_gate_inp) are F32, everything else BF16
        size = numel(name) * (4 if "norm" in name or name.endswith(".mlp.gate.weight") else 2)
        m = ROUTED.match(name)
        if m: layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + size
        elif name == "model.embed_tokens.weight": host += size
        else: gpu += size
    return [layers.get(i, 0) for i in range(max(layers) + 1)], gpu, host

model_dir, widen = sys.argv[1], int(sys.argv[2])
per_layer, gpu, host = split(model_dir, widen or None)
print(f"{model_dir} x{widen}: experts {sum(per_layer)/2**30:.2f} GiB ({per_layer[1]/2**20:.1f} MiB/layer, {sum(1 for b in per_layer if b)} MoE layers), "
      f"fixed GPU {gpu/2**30:.3f} GiB, host {host/2**20:.1f} MiB, total {(sum(per_layer)+gpu+host)/2**30:.2f} GiB")
for budget in map(float, sys.argv[3:]):
    p = L.choose_n_cpu_moe(per_layer, gpu, int(budget * 2**30))
    print(f"  budget {budget:g} GiB -> --n-cpu-moe {p['n_cpu_moe']} of {len(per_layer)} (GPU {p['gpu_bytes']/2**30:.2f} GiB, experts on CPU {p['cpu_expert_bytes']/2**30:.2f} GiB, fits {p['fits']})")
    print("   json", json.dumps({k: p[k] for k in ("n_cpu_moe", "gpu_bytes", "fixed_gpu_bytes", "gpu_expert_bytes", "cpu_expert_bytes")}))
