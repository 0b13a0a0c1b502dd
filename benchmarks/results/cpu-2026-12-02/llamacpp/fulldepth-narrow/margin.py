"""At each agree divergence: the float32 HF logits of llama.cpp's and Specter's next token (the narrow checkpoint)."""
import json, sys, torch
from transformers import AutoModelForCausalLM
agree = json.load(open(sys.argv[1])); summary = json.load(open(agree["summary"]))
model = AutoModelForCausalLM.from_pretrained(summary["model"], torch_dtype=torch.float32); model.eval()
ids = {(p["kind"], p["index"]): p["ids"] for p in summary["prompts"]}
torch.set_num_threads(2)
for row in agree["prompts"]:
    k = row["prefix"]
    if k == row["of"]:
        print(row["kind"], "all equal"); continue
    seq = ids[(row["kind"], row["index"])] + row["specter"][:k]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, -1]
    top = torch.topk(logits, 3)
    a, b = row["llama_cpp"][k], row["specter"][k]
    spread = float(logits.max() - logits.min())
    print(f"{row['kind']}: at {k}: llama.cpp {a} ({float(logits[a]):.4f}), Specter {b} ({float(logits[b]):.4f}); "
          f"gap {abs(float(logits[a]-logits[b])):.4f} of logit spread {spread:.3f}; fp32 top3 {top.indices.tolist()} {[round(v,4) for v in top.values.tolist()]}")
