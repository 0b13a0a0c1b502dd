"""How real a trained checkpoint is: held-out loss, repetition, routing balance and locality, and
the int4 draft's top-k set match and acceptance, as one JSON-ready report.

Metrics (per MoE layer where routing; T tokens, k = top-k, E experts, S_t the experts token t chose):
- held-out loss: mean next-token cross-entropy (nats per token) of the target on held-out text (the trainer's
  held_out.json, or given windows);
- repeated 4-grams: the share of the 4-grams of the new tokens that already occurred earlier in them (0: none repeat,
  near 1: a loop), for 128 greedy tokens and 128 tokens sampled at temperature 0.7 (seeded);
- entropy: entropy of the expert-use distribution (all tokens' top-k choices pooled) / log(E); 1 is uniform use, and
  real MoEs trained with a load-balancing loss show at least 0.9;
- overlap: mean over t >= 1 of |S_t ∩ S_{t-1}| / k;
- reuse8: mean over t >= 1 of |S_t ∩ (S_{t-8} ∪ ... ∪ S_{t-1})| / k (the first tokens see a shorter window);
- draft match: mean over tokens of |D_t ∩ S_t| / k, D_t the draft's choice at the same token, both teacher-forced on
  the same tokens (the Specter paper reports 90.9 % for Qwen1.5-MoE); draft exact: the share of tokens with D_t = S_t;
- acceptance: accepted / drafted tokens of the speculative runs that made the greedy and the sampled tokens.

Routing is measured on the greedy sequences (prompt + new tokens: what the bench decodes) and on the held-out text.
CLI: `python -m specter.bench.realism --model PATH [--factor F] [--json OUT]`.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m specter.bench.realism`: a Ctrl-C held over the imports below (`specter.entry`)
    from specter.entry import realism

    raise SystemExit(realism())

import argparse
import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specter.builtin import resolve_model
from specter.paths import check_not_an_input, check_output_file
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.errors import ConfigError, OutputError
from specter.exits import run_tool
from specter.model.transformer import ExpertMLP, ExpertProvider, Transformer

Tensor = torch.Tensor
Routes = dict[int, list[np.ndarray]]
"""MoE layer -> one [T, k] array of chosen expert ids per sequence."""

BALANCED_ENTROPY = 0.9
"""Normalised entropy of expert use that real MoEs trained with a balancing loss reach; below it a layer is flagged."""
NEW_TOKENS = 128
TEMPERATURE = 0.7
REUSE_WINDOW = 8
HELD_OUT_FILE = "held_out.json"
PROMPTS_PER_KIND = 2


# ---- metrics on token and routing sequences -----------------------------------------------------
def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the n-grams of `tokens` that occurred earlier in `tokens` (0.0 when there are none)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams) if grams else 0.0


def usage_entropy(sequences: Sequence[np.ndarray], num_experts: int) -> float:
    """Entropy of the expert-use distribution over every token's choices, / log(E): 1 uniform, 0 one expert."""
    counts = np.bincount(np.concatenate([s.reshape(-1) for s in sequences]).astype(np.int64), minlength=num_experts)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum() / math.log(num_experts)) if num_experts > 1 else 1.0


def consecutive_overlap(sequences: Sequence[np.ndarray]) -> float:
    """Mean over tokens t >= 1 of |S_t ∩ S_{t-1}| / k, within each sequence."""
    shares = [_shared(s[t], s[t - 1 : t]) for s in sequences for t in range(1, len(s))]
    return float(np.mean(shares)) if shares else float("nan")


def window_reuse(sequences: Sequence[np.ndarray], window: int = REUSE_WINDOW) -> float:
    """Mean over tokens t >= 1 of the share of S_t some of the previous `window` tokens also chose."""
    shares = [_shared(s[t], s[max(0, t - window) : t]) for s in sequences for t in range(1, len(s))]
    return float(np.mean(shares)) if shares else float("nan")


def set_match(draft: Sequence[np.ndarray], target: Sequence[np.ndarray]) -> tuple[float, float]:
    """(mean |D_t ∩ S_t| / k, share of tokens with D_t = S_t) over aligned sequences of choices."""
    shares, exact = [], []
    for d, s in zip(draft, target, strict=True):
        assert d.shape == s.shape, f"draft routes {d.shape} and target routes {s.shape} must cover the same tokens"
        for d_t, s_t in zip(d, s):
            shares.append(_shared(s_t, d_t[None]))
            exact.append(set(d_t.tolist()) == set(s_t.tolist()))
    return (float(np.mean(shares)), float(np.mean(exact))) if shares else (float("nan"), float("nan"))


def _shared(chosen: np.ndarray, earlier: np.ndarray) -> float:
    """|chosen ∩ (union of the rows of earlier)| / k."""
    return len(set(chosen.tolist()) & set(earlier.reshape(-1).tolist())) / len(chosen)


def layer_metrics(target: Routes, num_experts: int, draft: Routes | None = None) -> list[dict[str, Any]]:
    """Per MoE layer: entropy, overlap, reuse8, and (with draft routes) the draft's match."""
    rows = []
    for layer in sorted(target):
        row = {"layer": layer, "entropy": usage_entropy(target[layer], num_experts),
               "overlap": consecutive_overlap(target[layer]), "reuse8": window_reuse(target[layer])}
        if draft is not None:
            row["draft_match"], row["draft_exact"] = set_match(draft[layer], target[layer])
        rows.append({key: _rounded(value) for key, value in row.items()})
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over layers, the lowest entropy and the layers below BALANCED_ENTROPY."""
    keys = [key for key in rows[0] if key != "layer"] if rows else []
    means = {key: _rounded(float(np.mean([row[key] for row in rows]))) for key in keys}
    low = [row["layer"] for row in rows if row["entropy"] < BALANCED_ENTROPY]
    return {"mean": means, "min_entropy": min((row["entropy"] for row in rows), default=None), "low_entropy_layers": low,
            "layers": rows}


def _rounded(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) and math.isfinite(value) else value


# ---- routes and loss from a runtime ---------------------------------------------------------------
class RouteRecorder:
    """An ExpertProvider that keeps each MoE layer's chosen expert ids [T, k] and passes the call on."""

    def __init__(self, inner: ExpertProvider) -> None:
        self.inner = inner
        self.ids: dict[int, list[Tensor]] = {}

    async def run(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor, mlp: ExpertMLP) -> Tensor:
        self.ids.setdefault(layer, []).append(ids.detach().clone())  # on the device: no sync inside the forward
        return await self.inner.run(layer, x, ids, weights, mlp)

    def routes(self, tokens: int) -> dict[int, np.ndarray]:
        # await point: the recorded ids cross to the host once per sequence
        return {layer: torch.cat(parts)[:tokens].cpu().numpy() for layer, parts in self.ids.items()}


async def teacher_forced(model: Transformer, experts: ExpertProvider, tokens: Sequence[int], kv: Any,
                         want_loss: bool = False) -> tuple[dict[int, np.ndarray], float | None]:
    """One forward of `tokens` from position 0: per MoE layer the [T, k] routes, and the mean next-token loss."""
    kv.reset()
    recorder = RouteRecorder(experts)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)
    hidden = await model.forward(ids, 0, kv, recorder)
    loss = None
    if want_loss:
        logits = model.logits(hidden[:-1])  # [T-1, V]
        loss = float(F.cross_entropy(logits, ids[1:]))  # await point: one float to the host
    kv.reset()
    return recorder.routes(len(tokens)), loss


async def routes_and_loss(runtime: Runtime, sequences: Sequence[Sequence[int]], with_draft: bool,
                          want_loss: bool = False) -> tuple[Routes, Routes | None, float | None]:
    """Target routes (and the draft's, teacher-forced on the same tokens) over `sequences`, and the target's
    token-weighted mean loss. Runs between requests: it uses the runtime's own KV, reset before and after."""
    target: Routes = {}
    draft: Routes | None = {} if with_draft and runtime.draft is not None else None
    loss_sum, loss_tokens = 0.0, 0
    for tokens in sequences:
        routes, loss = await teacher_forced(runtime.model, runtime.experts, tokens, runtime.kv, want_loss)
        for layer, ids in routes.items():
            target.setdefault(layer, []).append(ids)
        if loss is not None:
            loss_sum, loss_tokens = loss_sum + loss * (len(tokens) - 1), loss_tokens + len(tokens) - 1
        if draft is not None:
            drafted, _ = await teacher_forced(runtime.draft.model, runtime.draft.experts, tokens, runtime.kv)
            for layer, ids in drafted.items():
                draft.setdefault(layer, []).append(ids)
    return target, draft, (loss_sum / loss_tokens if loss_tokens else None)


async def generate(runtime: Runtime, prompt: Sequence[int], new_tokens: int, temperature: float, seed: int) -> tuple[list[int], Any]:
    """The new tokens and their stats; stop ids are not honoured, so every run has `new_tokens` tokens."""
    generation = GenerationConfig(max_new_tokens=new_tokens, temperature=temperature, seed=seed)
    result = await runtime.complete_ids(list(prompt), generation)
    return list(result.tokens), result.stats


# ---- the report ------------------------------------------------------------------------------------
async def realism_async(runtime: Runtime, prompts: Sequence[Sequence[int]], held_out: Sequence[Sequence[int]] | None = None,
                        *, new_tokens: int = NEW_TOKENS, temperature: float = TEMPERATURE, seed: int = 0,
                        label: str = "") -> dict[str, Any]:
    """The realism report of the model `runtime` serves (it must be idle: this runs requests and forwards on it)."""
    if not prompts:
        raise ConfigError("the realism report needs at least one prompt (token ids)")
    spec = runtime.spec
    greedy, sampled, drafted, accepted = [], [], {"greedy": 0, "sampled": 0}, {"greedy": 0, "sampled": 0}
    for index, prompt in enumerate(prompts):
        for mode, temp, out in (("greedy", 0.0, greedy), ("sampled", temperature, sampled)):
            tokens, stats = await generate(runtime, prompt, new_tokens, temp, seed + index)
            out.append(tokens)
            drafted[mode] += stats.drafted
            accepted[mode] += stats.accepted
    decoded = [list(p) + g for p, g in zip(prompts, greedy)]
    target, draft, _ = await routes_and_loss(runtime, decoded, with_draft=True)
    report: dict[str, Any] = {
        "model": label, "family": spec.family, "num_layers": spec.num_layers, "moe_layers": len(spec.moe_layers),
        "num_experts": spec.num_experts, "top_k": spec.top_k, "hidden_size": spec.hidden_size,
        "prompts": len(prompts), "new_tokens": new_tokens,
        "repetition": {
            "greedy_4gram_repeat": _rounded(float(np.mean([repeated_ngram_share(g) for g in greedy]))),
            "sampled_4gram_repeat": _rounded(float(np.mean([repeated_ngram_share(s) for s in sampled]))),
            "temperature": temperature, "seed": seed,
            "greedy_per_prompt": [_rounded(repeated_ngram_share(g)) for g in greedy],
            "sampled_per_prompt": [_rounded(repeated_ngram_share(s)) for s in sampled],
        },
        "routing": summarise(layer_metrics(target, spec.num_experts, draft)),
        "draft": _draft_summary(runtime, drafted, accepted),
    }
    report["held_out"] = await _held_out(runtime, held_out)
    report["flags"] = flags(report)
    return report


def _draft_summary(runtime: Runtime, drafted: dict[str, int], accepted: dict[str, int]) -> dict[str, Any]:
    quant = runtime.config.draft.quant if runtime.draft is not None else None
    rates = {f"acceptance_{mode}": _rounded(accepted[mode] / drafted[mode]) if drafted[mode] else None for mode in drafted}
    return {"quant": quant, "drafted_greedy": drafted["greedy"], "drafted_sampled": drafted["sampled"], **rates}


async def _held_out(runtime: Runtime, windows: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    if not windows:
        return {"loss": None, "tokens": 0, "routing": None}
    target, draft, loss = await routes_and_loss(runtime, windows, with_draft=True, want_loss=True)
    return {"loss": _rounded(loss), "tokens": sum(len(w) - 1 for w in windows),
            "routing": summarise(layer_metrics(target, runtime.spec.num_experts, draft))}


def flags(report: dict[str, Any]) -> list[str]:
    """Where the checkpoint falls short of a real MoE: unbalanced layers, greedy loops, no held-out text."""
    out = []
    for where, routing in (("greedy sequences", report["routing"]), ("held-out text", report["held_out"]["routing"])):
        low = routing["low_entropy_layers"] if routing else []
        if low:
            out.append(f"{where}: {len(low)} of {report['moe_layers']} MoE layers use their experts unevenly (normalised "
                       f"entropy < {BALANCED_ENTROPY}; min {routing['min_entropy']}): layers {low}")
    if report["repetition"]["greedy_4gram_repeat"] > 0.5:
        out.append(f"greedy decoding loops: {report['repetition']['greedy_4gram_repeat']:.0%} of its 4-grams repeat "
                   "(acceptance and locality are flattered)")
    if report["held_out"]["loss"] is None:
        out.append("no held-out text: held-out loss not measured")
    return out


# ---- entry points ----------------------------------------------------------------------------------
def checkpoint_inputs(path: Path, per_kind: int = PROMPTS_PER_KIND) -> tuple[list[list[int]], list[list[int]] | None]:
    """The prompts (prompts.json's, `per_kind` of each kind) and held-out windows (held_out.json) a trainer left."""
    from specter.bench.protocol import token_lists, listed_prompts

    kinds = listed_prompts(path) or {}
    prompts = [ids for snippets in kinds.values() for ids in snippets[:per_kind]]
    held = token_lists(path / HELD_OUT_FILE, "windows", '{"windows": [[token ids], ...]}')
    return prompts, held


def realism_config(device: str = "auto", quant: str = "int4", max_context: int | None = None) -> EngineConfig:
    """Every expert resident, a speculative draft of `quant` experts (the fixed lookahead drafts every round);
    max_context None: the model's own positions, up to the engine's default."""
    return EngineConfig(device=device, max_context=max_context, draft=DraftConfig(quant=quant))  # type: ignore[arg-type]


async def realism_for_bench(source: Any, path: str | Path | None, *, prompts: Sequence[Sequence[int]] | None = None,
                            config: EngineConfig | None = None, new_tokens: int = NEW_TOKENS, label: str = "") -> dict[str, Any]:
    """What the bench calls per checkpoint: build a resident runtime with an int4 draft from the WeightSource
    `source` (e.g. CheckpointWeights(WidenedCheckpoint(path, F))), take prompts and held-out text from the trainer's
    files in `path` (prompts given here win), report, and release the device."""
    files_prompts, held = checkpoint_inputs(Path(path)) if path is not None else ([], None)
    async with await Runtime.build(source, config or realism_config()) as runtime:
        return await realism_async(runtime, list(prompts or files_prompts) or _fallback(runtime), held,
                                   new_tokens=new_tokens, label=label or str(path or ""))


def _fallback(runtime: Runtime) -> list[list[int]]:
    """Without prompts.json: the bench's synthetic prompts (uniform, Zipf and motif ids)."""
    from specter.bench.protocol import synthetic_prompts

    return [p.ids for p in synthetic_prompts(runtime.spec.vocab_size, PROMPTS_PER_KIND)]


def realism_report(model: str | Path | Runtime | Any, prompts: Sequence[Sequence[int]] | None = None, *,
                   held_out: Sequence[Sequence[int]] | None = None, factor: int | None = None, config: EngineConfig | None = None,
                   new_tokens: int = NEW_TOKENS, temperature: float = TEMPERATURE, seed: int = 0) -> dict[str, Any]:
    """The realism report of a checkpoint directory (narrow; widened on the fly by `factor` when given) or of a
    loaded, idle `Runtime` or `Engine` (its `.runtime`). Prompts and held-out text default to the trainer's files."""
    return asyncio.run(_report(model, prompts, held_out, factor, config, new_tokens, temperature, seed))


async def _report(model: Any, prompts: Any, held_out: Any, factor: int | None, config: EngineConfig | None, new_tokens: int,
                  temperature: float, seed: int) -> dict[str, Any]:
    runtime = getattr(model, "runtime", model)
    if isinstance(runtime, Runtime):
        return await realism_async(runtime, prompts or [], held_out, new_tokens=new_tokens, temperature=temperature, seed=seed)
    path = Path(model)
    files_prompts, files_held = checkpoint_inputs(path)
    config = config or realism_config()
    async with await Runtime.build(weight_source(path, factor, config.device), config) as built:
        prompts = list(prompts or files_prompts) or _fallback(built)
        return await realism_async(built, prompts, held_out if held_out is not None else files_held, new_tokens=new_tokens,
                                   temperature=temperature, seed=seed, label=f"{path}" + (f" widened x{factor}" if factor else ""))


def weight_source(path: Path, factor: int | None, device: str = "cpu") -> Any:
    """The checkpoint at `path`, or its model widened `factor` times in bfloat16 on `device` (the engine's: CUDA widens
    there, off the host's one torch thread; 'auto' is CUDA when present)."""
    from specter.build import CheckpointWeights
    from specter.model.checkpoint import Checkpoint

    if factor is None or factor == 1:
        return CheckpointWeights(Checkpoint(path))
    from specter.bench.widen import WidenedCheckpoint

    return CheckpointWeights(WidenedCheckpoint(path, factor, torch.bfloat16, device))


# ---- CLI -------------------------------------------------------------------------------------------
def format_report(report: dict[str, Any]) -> str:
    """A short table: the checkpoint's figures, then one line per MoE layer."""
    routing, draft, rep = report["routing"], report["draft"], report["repetition"]
    lines = [f"realism: {report['model']} ({report['family']}, {report['num_layers']} layers, {report['num_experts']} experts "
             f"top-{report['top_k']}, hidden {report['hidden_size']})",
             (f"held-out loss {report['held_out']['loss']} nats/token over {report['held_out']['tokens']} tokens"
              if report["held_out"]["loss"] is not None else "held-out loss: not measured (no held-out text)"),
             f"repeated 4-grams in {report['new_tokens']} tokens: greedy {rep['greedy_4gram_repeat']}, sampled at "
             f"T={rep['temperature']} {rep['sampled_4gram_repeat']}",
             f"routing (greedy sequences) mean: {routing['mean']}",
             f"draft {draft['quant']}: acceptance greedy {draft['acceptance_greedy']}, sampled {draft['acceptance_sampled']}",
             "| layer | entropy | overlap | reuse8 | draft match | draft exact |", "|---|---|---|---|---|---|"]
    for row in routing["layers"]:
        mark = " (!)" if row["entropy"] < BALANCED_ENTROPY else ""
        lines.append(f"| {row['layer']} | {row['entropy']}{mark} | {row['overlap']} | {row['reuse8']} | "
                     f"{row.get('draft_match')} | {row.get('draft_exact')} |")
    lines += [f"FLAG: {flag}" for flag in report["flags"]] or ["no flags: balanced routing, no greedy loop"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specter.bench.realism", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint directory (the trainer's narrow one, or any)")
    parser.add_argument("--factor", type=int, default=None, help="widen the narrow checkpoint by F on the fly (WidenedCheckpoint)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--per-kind", type=int, default=PROMPTS_PER_KIND, help="prompts of each kind from prompts.json")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quant", default="int4", help="the draft's expert format")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool(lambda: _print_report(args))


def _print_report(args: argparse.Namespace) -> int:
    if args.json is not None:  # before minutes of decoding, not after
        check_output_file(args.json, "--json")
        check_not_an_input(args.json, resolve_model(str(args.model)), "--json")
    prompts, held = checkpoint_inputs(args.model, args.per_kind)
    report = realism_report(args.model, prompts or None, held_out=held, factor=args.factor,
                            config=realism_config(args.device, args.quant), new_tokens=args.new_tokens)
    print(format_report(report))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as error:
            raise OutputError(f"cannot write the report to {args.json}: {error.strerror or error}") from None
    return 0

