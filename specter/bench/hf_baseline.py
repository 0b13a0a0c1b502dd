"""The tool a user would otherwise pick: Hugging Face transformers with accelerate offloading (device_map + max_memory).

GPU only, checkpoints on disk only (synthetic weights live in memory). The GPU gets the same bytes the
engine's plan gives the setting (non-expert weights, KV, workspace and the expert slots); accelerate
decides what to offload, whole modules at a time, and streams them in per forward.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch

from specter.config import EngineConfig
from specter.log import get_logger
from specter.memory import plan_memory

log = get_logger(__name__)

SYSTEM = "hf-accelerate"
MAX_TOKENS = 32
"""accelerate streams offloaded modules in per forward (seconds per token); TPOT needs only a few tokens."""


def unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    missing = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
    return f"{', '.join(missing)} not installed" if missing else None


def run_hf(target, bench, options) -> tuple[list[dict[str, Any]], str | None]:
    """One record per prompt and setting; (records, note) where the note says why it was skipped, if it was."""
    reason = unavailable_reason()
    if reason is not None:
        return [], f"{target.label}: {SYSTEM} skipped ({reason})"
    if options.max_new_tokens < 2:
        return [], f"{target.label}: {SYSTEM} skipped (needs at least 2 new tokens for a TPOT)"
    records = []
    for setting in target.settings:
        if setting.residents is None and setting.budget is None:
            continue
        if bench.deadline is not None and time.monotonic() > bench.deadline:
            return records, f"{target.label} {setting.label}: {SYSTEM} skipped: time budget"
        try:
            ran = _run_setting(target, bench, options, setting)
        except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as error:  # accelerate's refusals are plain errors
            return records, f"{target.label} {setting.label}: {SYSTEM} failed: {error}"
        finally:
            torch.cuda.empty_cache()
        records += ran
        if len(ran) < len(target.prompts):  # the deadline passed between prompts
            return records, f"{target.label} {setting.label}: {SYSTEM} ran {len(ran)} of {len(target.prompts)} prompts: time budget"
    return records, None


def gpu_bytes(target, bench, setting) -> int:
    """The device bytes the engine would use for this setting, without a draft."""
    if setting.budget is not None:
        return setting.budget
    plan = plan_memory(target.spec, bench.dtype, EngineConfig(max_context=bench.max_context, row_bucket=bench.options.row_bucket), speculative=False)
    return plan.fixed_bytes + setting.residents * plan.moe_layers * plan.expert_bytes


def _load(path, budget: int):
    from transformers import AutoModelForCausalLM

    memory = {0: budget, "cpu": 2**40}
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto", max_memory=memory)
    except TypeError:  # transformers v4 spells it torch_dtype
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, device_map="auto", max_memory=memory)


def _run_setting(target, bench, options, setting) -> list[dict[str, Any]]:
    model = _load(target.path, gpu_bytes(target, bench, setting))
    try:
        _generate(model, target.warmup.ids, min(options.warmup_tokens, 4))
        torch.cuda.reset_peak_memory_stats()
        records = []
        for prompt in target.prompts:
            if bench.deadline is not None and time.monotonic() > bench.deadline:
                break
            records.append(_record(target, bench, options, setting, model, prompt))
        return records
    finally:
        del model


def _generate(model, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    inputs = torch.tensor([ids], device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=0)
    torch.cuda.synchronize()
    return out[0, len(ids):].tolist(), time.perf_counter() - started


def _record(target, bench, options, setting, model, prompt) -> dict[str, Any]:
    _, first_s = _generate(model, prompt.ids, 1)
    tokens, total_s = _generate(model, prompt.ids, min(options.max_new_tokens, MAX_TOKENS))
    expected = bench.baseline.get(("greedy", prompt.kind, prompt.index), [])[: len(tokens)]
    return {
        "model": target.label, "setting": setting.label, "link": "native", "system": SYSTEM, "slots": setting.residents,
        "prompt_kind": prompt.kind, "prompt_index": prompt.index, "sampling": "greedy", "repeat": 0, "new_tokens": len(tokens),
        "ttft_s": first_s, "tpot_s": (total_s - first_s) / (len(tokens) - 1), "hits": 0, "misses": 0, "h2d_bytes": 0, "h2d_prefill_bytes": 0,
        "stall_s": 0.0, "tokens_equal": tokens == expected, "first_mismatch": None, "peak_gpu_bytes": int(torch.cuda.max_memory_reserved()),
        "note": "bf16 HF numerics differ from the engine's exact mode; unequal tokens are expected here",
    }
