"""`python -m specter.bench`: the comparison matrix. With no arguments, a quick matrix on the built-in tiny model."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import BaseModel

from specter.bench import report, stopping
from specter.bench.protocol import (CELL_FIELDS, PROMPT_TOKENS, SAMPLING_MODES, ModelTarget, Options, Progress, bench_context,
                                    checkpoint_target, planned_cells,
                                    run_matrix, synthetic_prompts, warmup_prompt)
from specter.bench.plots import PLOT_FILES, remove_plots
from specter.bench.stopping import BenchStopped, Stopper, exit_status
from specter.bench.synthetic import SHAPES, family_available, shape_config, shape_label, synthetic_source
from specter.bench.systems import DEFAULT_SYSTEMS, SCHEDULE_SOURCE, SYSTEMS, Setting, custom_system
from specter.build import resolve_device, resolve_dtype
from specter.config import DEFAULT_K, DraftConfig, EngineConfig, TuningConfig, parse_bytes, parse_link, split_list
from specter.errors import ConfigError, OutputError, PromptError, SpecterError
from specter.exits import prog_name, run_tool
from specter.experts.costs import routing_profile
from specter.model.spec import spec_from_config
from specter.memory import DEFAULT_CONTEXT
from specter.paths import check_output_folder, json_value, write_advice

PAPER_SETTINGS = {"deepseek-v2-lite": (16, 4), "qwen1.5-moe-a2.7b": (15, 8), "phi-3.5-moe": (2, 1)}
"""Resident experts per layer in the Specter paper's two memory settings per model."""

QUICK_RESIDENTS = 6
QUICK_LINKS = ("0.02", "0.1")
"""The quick matrix's emulated links in GB/s. tiny's routing is random (random weights), so speculation can win only
by verifying many tokens per pass (each expert crosses once for all of them) while the link, not the CPU's compute,
sets the pace: one 384 KiB expert takes 19 ms at 0.02 GB/s and 3.9 ms at 0.1 GB/s, against 4-18 ms per token of
compute on a shared 2-core CPU. At 0.1 GB/s the link is fast enough that the draft's CPU time (on a GPU a small
fraction of a verify) can cost as much as the bytes it saves, so there the busier the machine the smaller specter's
win over ondemand, and it may lose; at 0.02 GB/s the bytes dominate."""
PLAIN_CPU_LINKS = ("0.25", "1")
"""The CPU's emulated links outside the quick matrix: slow enough that tiny's experts cost about as much as its compute."""
QUICK_SYSTEMS = ("resident", "ondemand", "specter")
"""The ceiling, plain offloading and specter: the comparison the quick matrix exists to show (--systems for more)."""
QUICK_QUANT = "int8"
"""The quick draft: int8 agrees with tiny's target on about 9 tokens in 10 (int4: about 1 in 2), as a trained model's
int4 draft does; with random weights int4 is a worst case, not the idea."""
QUICK_REPEATS = 2
"""Requests per prompt in the quick matrix: a median over 6 requests (3 prompts x 2) per cell, within 2 minutes."""


EPILOG = (f"Exit status: 0 done; 1 an engine system's tokens differed from its baseline (or an unexpected error, "
          "with a traceback and results.json's partial reason 'failed: ...'); 2 bad input, or an --out it cannot write; "
          "3 nothing measured (every cell skipped, or all but resident's; the notes say why); 4 some cells failed (a "
          "plug-in raised or answered wrongly; results.json keeps each one's reason), the others ran; 141 the reader of stdout left; "
          f"{exit_status(signal.SIGTERM)} stopped by SIGTERM ({exit_status(signal.SIGINT)} by SIGINT, 128 + the signal's "
          "number): the cell in progress is abandoned and results.json and results.md keep the cells that ended, with "
          "complete false and partial.remaining the cells still to run.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog_name("specter.bench"), description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", action="append", default=None,
                        help=f"checkpoint dir, 'tiny', or a synthetic real shape ({', '.join(SHAPES)}); repeatable")
    parser.add_argument("--widen", default=None, metavar="F|auto",
                        help="each --model DIR is a narrow checkpoint, benchmarked as its model widened F times (exact "
                             "Net2Net, bf16, widened as it loads, on --device: specter.bench.widen), labelled 'NAME xF'; auto: the factor "
                             "DIR/train.json records (benchmarks/reference_model.py --shape)")
    parser.add_argument("--preset", choices=["quick", "paper"], default="quick",
                        help="paper: DeepSeek-V2-Lite 16/4, Qwen1.5-MoE 15/8, Phi-3.5-MoE 2/1 residents per layer")
    parser.add_argument("--layers", type=int, default=None, help="truncate synthetic shapes to N decoder layers (labelled)")
    parser.add_argument("--residents", type=_int_list, default=None, help="expert slots per MoE layer, e.g. 16,4 (left out: 6 for a checkpoint, half its experts where it has 6 or fewer; a synthetic shape: a quarter of its experts)")
    parser.add_argument("--budget", type=_size_list, default=None, help="GPU budgets instead of residents, e.g. 8GiB,4GiB")
    parser.add_argument("--systems", type=_name_list, default=None,
                        help=f"of: {', '.join(SYSTEMS)}; exact-prefetch-specter runs last, on specter's rounds "
                             f"(default: {','.join(DEFAULT_SYSTEMS)}; quick: {','.join(QUICK_SYSTEMS)})")
    parser.add_argument("--system", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="a system of installed plug-ins, run after --systems' (repeatable): NAME:like=SYSTEM (a "
                             "built-in offloaded one to start from, default ondemand), eviction=, prefetch=, lookahead=, "
                             "k= (fixed lookahead's depth), overlap= (draft-ahead steps), cpu-experts= (placement); e.g. "
                             "mine:like=specter,eviction=my-eviction. Its tokens are held to the same baseline as the "
                             "built-in systems'")
    parser.add_argument("--link", type=_link_list, default=None,
                        help=f"links to emulate: gen5, gen4, gen3, ddr4-desktop, native or GB/s (default: native on CUDA, "
                             f"{','.join(PLAIN_CPU_LINKS)} on the CPU; quick: {','.join(QUICK_LINKS)})")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="output tokens per request (default 128; quick: 32)")
    parser.add_argument("--sampling", type=_name_list, default=["greedy"],
                        help=f"how requests pick tokens, of: {', '.join(SAMPLING_MODES)} (sampled: temperature 0.7, top-p 0.9, "
                             "a fixed seed per prompt); every prompt runs in each mode and is held to the target-only "
                             "baseline in the same mode and seed. Default greedy alone: it keeps the quick matrix within "
                             "2 minutes on the CPU (greedy,sampled doubles its requests)")
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=1, help="prompts per kind (kinds: uniform/zipf/motif, or code/prose/docs)")
    parser.add_argument("--repeats", type=int, default=None, help=f"requests per prompt (default 1; quick: {QUICK_REPEATS})")
    parser.add_argument("--k", type=int, default=None, help=f"draft depth of specter-fixed and exact-prefetch (default "
                        f"{DEFAULT_K}, or --k-max when that is smaller)")
    parser.add_argument("--k-max", type=int, default=None, help="largest depth the roofline governor may pick, at least "
                        f"--k (default {DraftConfig().k_max}, or --k when deeper: {DraftConfig().k_max} gives 16 verify rows, "
                        "one pass of the 16-row static verify)")
    parser.add_argument("--row-bucket", type=int, default=16, help="every system's exact row block, also the static "
                        "verify's rows per pass (16; 32 lets a k-max of 31 verify in one pass)")
    parser.add_argument("--quant", default=None, choices=["int4", "int8", "int3", "int2"],
                        help=f"weight format of the draft's experts, for every speculative system (default int4; quick: {QUICK_QUANT})")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads of every runtime, EngineConfig.threads (default on the CPU: 1, tiny matrices lose to thread "
                             "hand-offs, worse on a busy machine; on CUDA: the engine's default)")
    parser.add_argument("--desktop-threads", type=int, default=8,
                        help="torch threads of the host expert path (cpu-experts, the hybrids: its calibration and its "
                             "compute) in cells at link ddr4-desktop, a desktop CPU's cores; other links: the engine's "
                             "default (the cores less one)")
    parser.add_argument("--placement-overlap", type=float, default=None, metavar="O",
                        help="the cost model's overlap (0..1) for the systems that place with auto (the hybrids): the share "
                             "of the shorter path's time per layer it counts as hidden under the longer (default: "
                             "specter.placement.OVERLAP, 0: their sum). 1 balances the two paths and splits a layer "
                             "between them where the sum puts all or none of its non-residents on the host: a split "
                             "placement, to measure how much the two paths overlap")
    parser.add_argument("--placement-profile", type=given_path, default=None, metavar="TRACE",
                        help="a routing trace of the bench's one model (`specter generate --trace`; for --widen, one "
                             "recorded on the narrow checkpoint: the widened model routes as it does) that every engine the "
                             "bench builds places from (EngineConfig.placement_profile): auto's cost model (the hybrids) "
                             "replays its rounds instead of assuming uniform routing. Checked before anything loads. None: "
                             "a speculating hybrid (specter-hybrid) places from the engine's own trace (--self-profile-tokens), "
                             "a plain one (ondemand-hybrid) from uniform routing")
    parser.add_argument("--self-profile-tokens", type=int, default=None, metavar="N",
                        help="without --placement-profile, the tokens of its own text each model's runtime decodes once, "
                             "at its first speculating hybrid cell, to record the routing trace auto places the "
                             "speculating hybrids from, as a deployed engine does at load (default: the engine's, 256; 0: "
                             "none, and auto places them off)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds above 0, shared out between the models; a cell is skipped (noted) when the time left "
                             "is below the longest cell so far or, for a model's first cells, below its baseline pass over "
                             "the same requests times the repeats (on an emulated link, at least the most bytes a cell or "
                             "that pass copied at the link's speed); a model part whose time is up is not loaded. None: no "
                             "budget")
    parser.add_argument("--out", type=given_path, default=Path("bench-out"),
                        help="directory for results.json, results.md (both rewritten after every cell, marked partial "
                             "until the end) and plots (at the end); an earlier run's move to previous/DATE/ first")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers + accelerate baseline")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--merge", type=given_path, action="append", default=None, metavar="DIR",
                        help="run nothing: merge the results.json of these bench outputs (a folder or its results.json; repeatable, disjoint cells) into --out; only --out, --no-plots and --no-progress may go with it")
    parser.add_argument("--realism", action="store_true",
                        help="before the matrix, the realism report of each checkpoint model (not of synthetic shapes): "
                             "held-out loss, repetition, routing balance and locality, the draft's match and acceptance "
                             "(specter.bench.realism); printed, stored under the model in results.json, one row in results.md")
    parser.add_argument("--realism-tokens", type=int, default=128, help="new tokens per prompt of the realism report")
    parser.add_argument("--copy-gaps", action="store_true",
                        help="split the copy stream's idle time in transfer-bound verifies by cause (head, layer hand-over, "
                             "issue, slot wait; one more GPU event per chunk): the copy_idle columns of results.json")
    parser.add_argument("--tune", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="set a field of EngineConfig.tuning for every system, e.g. cache.lead_relay=false (repeatable)")
    verify = parser.add_mutually_exclusive_group()
    verify.add_argument("--static-verify", dest="static_verify", action="store_const", const=True, default=None,
                        help="offloaded verify through the segmented static step (EngineConfig.static_verify; default on CUDA)")
    verify.add_argument("--eager-verify", dest="static_verify", action="store_const", const=False,
                        help="offloaded verify through the eager forward (the default on the CPU)")
    return parser


# The lists name cells, once each: a value given twice would run its cells twice and pool both measurements into one
# row of the summary (twice the runs, under one label), so a repeat is dropped, as --merge refuses cells seen twice.
def _parts(text: str) -> list[str]:
    """A list option's values (`split_list`; none at all, `--link ,`, is check_args' to refuse)."""
    try:
        return split_list(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _int_list(text: str) -> list[int]:
    parts = _parts(text)
    try:
        return list(dict.fromkeys(int(part) for part in parts))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _size_list(text: str) -> list[int]:
    parts = _parts(text)
    try:
        return list(dict.fromkeys(parse_bytes(part) for part in parts))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _name_list(text: str) -> list[str]:
    return list(dict.fromkeys(_parts(text)))


def _link_list(text: str) -> list[str]:
    """--link's names, once per link they emulate (the first spelling kept): `1,1.0`, or `gen4,25` where gen4 is
    25 GB/s, measured one link twice under two labels. A name that does not parse is kept for check_args to refuse."""
    kept: dict[object, str] = {}
    for name in _name_list(text):
        try:
            value: object = name if name == "native" else parse_link(name)
        except ConfigError:
            value = name
        kept.setdefault(value, name)
    return list(kept.values())


MERGE_OPTIONS = frozenset({"merge", "out", "no_plots", "no_progress"})
"""The options a --merge reads (and the progress bar's, which has nothing to show): every other one would be ignored."""


def check_merge_alone(args: argparse.Namespace) -> None:
    """--merge runs nothing: `--merge A --systems foo` (or --model, --device) exited 0, the options unread and unchecked,
    so the user believed they had shaped the merged table."""
    if not args.merge:
        return
    ignored = [action.option_strings[0] for action in build_parser()._actions
               if action.option_strings and action.dest not in MERGE_OPTIONS | {"help"}
               and getattr(args, action.dest, action.default) != action.default]
    if ignored:
        raise ConfigError(f"--merge runs nothing, so {', '.join(ignored)} would be ignored; leave "
                          f"{'it' if len(ignored) == 1 else 'them'} out (the merged parts keep the options they ran with)")


def check_args(args: argparse.Namespace) -> None:
    """The counts, depths, links and lists of the command line, before any model opens: a bad one would otherwise
    fail (or be replaced by a default) only after the resident cells had run."""
    check_merge_alone(args)
    for option, count in (("--max-new-tokens", args.max_new_tokens), ("--warmup-tokens", args.warmup_tokens),
                          ("--prompts", args.prompts), ("--repeats", args.repeats)):
        if count is not None and count < 1:
            raise ConfigError(f"{option} {count}: expected 1 or more")
    for option, values in (("--systems", args.systems), ("--link", args.link), ("--residents", args.residents),
                           ("--budget", args.budget)):
        if values is not None and not values:  # `--link ,`: the defaults would run in its place
            raise ConfigError(f"{option}: expected a comma-separated list of one or more values, got none")
    if args.realism_tokens < 1:
        raise ConfigError(f"--realism-tokens {args.realism_tokens}: expected 1 or more new tokens per prompt")
    check_threads(args)
    # DraftConfig's own bounds, checked here: the engine would refuse them only when the offloaded part builds.
    for option, depth in (("--k", args.k), ("--k-max", args.k_max)):
        low, high = _field_bounds(DraftConfig, "k" if option == "--k" else "k_max")
        if depth is not None and not low <= depth <= high:
            raise ConfigError(f"{option} {depth}: expected a draft depth of {low}..{high}")
    if args.k is not None and args.k_max is not None and args.k > args.k_max:
        raise ConfigError(f"--k {args.k} is above --k-max {args.k_max}; lower --k to {args.k_max} or less, or raise "
                          f"--k-max to {args.k} (left out, --k-max follows a deeper --k)")
    if args.residents is not None and args.budget is not None:  # the budgets would win, the residents go unused
        raise ConfigError("--residents and --budget both set the memory settings; give one of them")
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"--layers {args.layers}: expected 1 or more decoder layers")
    for count in args.residents or ():
        if count < 1:
            raise ConfigError(f"--residents {count}: expected 1 or more expert slots per MoE layer")
    # The engine's own fields, in its words: they would otherwise fail as a validation traceback at the first cell.
    config = EngineConfig.build(device=args.device, dtype=args.dtype)
    if not args.merge:  # CUDA asked for where there is none: every part would be skipped, nothing measured
        resolve_device(config)
    for link in args.link or ():
        if link != "native":  # the bench's name for the real link (BenchRuntime.set_link); the rest as it parses them
            try:
                parse_link(link)
            except ConfigError as error:
                raise ConfigError(f"--link: {error}; or native (the real link, no emulation)") from None


def check_threads(args: argparse.Namespace) -> None:
    """--threads and --desktop-threads within EngineConfig's own bounds: beyond them the first runtime's build failed
    as a validation traceback, or (the host path's threads) ran for minutes on a thread count no machine has."""
    for option, count, field in (("--threads", args.threads, "threads"), ("--desktop-threads", args.desktop_threads, "cpu_threads")):
        low, high = _field_bounds(EngineConfig, field)
        what = "torch threads" if field == "threads" else "host threads"
        if count is not None and count < low:
            raise ConfigError(f"{option} {count}: expected {low} or more {what} (at most {high})")
        if count is not None and count > high:
            raise ConfigError(f"{option} {count}: expected {low}..{high} {what} (EngineConfig's limit)")


def _field_bounds(model: type[BaseModel], field: str) -> tuple[int, int]:
    """The ge/le bounds of a config model's `field` (DraftConfig.k, EngineConfig.threads): one copy of each limit."""
    metadata = model.model_fields[field].metadata
    return (next(item.ge for item in metadata if hasattr(item, "ge")),
            next(item.le for item in metadata if hasattr(item, "le")))


def check_residents(residents: Sequence[int] | None, targets: Sequence[ModelTarget]) -> None:
    """--residents at most each model's experts per layer, before any cell: above it the cells would run with every
    expert resident under the label of the count given. Below the top-k is allowed: the bench's cache then works as a
    rolling window (BenchRuntime.use_slots), as the paper's Phi-3.5-MoE setting of 1 slot needs."""
    for target in targets:
        experts = target.spec.num_experts
        for count in residents or ():
            if count > experts:
                raise ConfigError(f"--residents {count}: {target.label} has {experts} experts per MoE layer; give 1.."
                                  f"{experts} slots per layer ({experts}: every expert resident)")


def targets_from_args(args: argparse.Namespace) -> tuple[list[ModelTarget], list[str]]:
    """The models of the matrix with their settings; shapes whose family is missing are noted, not fatal."""
    check_widen(args)
    names = args.model or (list(PAPER_SETTINGS) if args.preset == "paper" else ["tiny"])
    if args.layers is not None and not any(name in SHAPES for name in names):  # else it would be dropped unsaid
        raise ConfigError(f"--layers {args.layers} truncates synthetic shapes ({', '.join(SHAPES)}), and this run benches "
                          f"none ({', '.join(names)}): leave --layers out, or bench a shape")
    targets, notes = [], []
    for name in names:
        settings = _settings(args, name)
        if name in SHAPES:
            if args.widen is not None:
                raise ConfigError(f"--widen: {name} is a synthetic shape, already at the real width; --widen takes a narrow "
                                  "checkpoint directory")
            if not family_available(name):
                notes.append(f"{name}: model family {SHAPES[name]['model_type']!r} is not registered in this engine yet; skipped")
                continue
            targets.append(_synthetic_target(name, args.layers, settings, args.prompts))
        else:
            from specter.builtin import resolve_model

            path = resolve_model(name)
            if "," in name and not path.is_dir():  # the lists of --link and --residents are commas; --model repeats
                raise ConfigError(f"--model {name}: not a directory; --model takes one model: repeat it for more "
                                  f"(--model {' --model '.join(part.strip() for part in name.split(','))})")
            target = checkpoint_target(path, settings, args.prompts, widen_factor(args.widen, path), args.device)
            if name == "tiny":
                target.label = target.label.replace(path.name, "tiny", 1)
            if not (args.budget or args.residents) and (note := fit_default_residents(target)):
                notes.append(note)
            targets.append(target)
    labels = [target.label for target in targets]
    if twice := sorted({label for label in labels if labels.count(label) > 1}):
        # records are filed under the label: two models of one label would pool into one row of the summary
        raise ConfigError(f"--model: two models are labelled {', '.join(twice)} (one given twice, or checkpoint folders of "
                          "one name); give each model once, and a folder named like another through a symlink of another name")
    return targets, notes


def check_widen(args: argparse.Namespace) -> None:
    """--widen needs checkpoint models and a factor F >= 1 or 'auto' (before anything loads)."""
    if args.widen is None:
        return
    if not args.model:
        raise ConfigError(f"--widen {args.widen} needs --model DIR: it widens a narrow checkpoint directory")
    if args.widen != "auto" and not (re.fullmatch(r"[0-9]+", args.widen) and int(args.widen) >= 1):
        raise ConfigError(f"--widen {args.widen!r}: expected a whole number F >= 1 (real width / narrow width) or 'auto'")


def check_placement_profile(path: Path | None, targets: Sequence[ModelTarget]) -> None:
    """--placement-profile, before anything loads: the check the engine's load makes (`routing_profile`: a readable
    trace, of this model's MoE layers and experts), with rounds to place from. A trace is of one model, so a run of
    several is refused (each part of a matrix gets its own; --merge joins them). A widened model routes as its narrow
    checkpoint (same MoE layers and experts), so a trace recorded on that passes."""
    if path is None or not targets:
        return
    if len(targets) > 1:
        raise ConfigError(f"--placement-profile {path}: a routing trace is of one model, and this run benches "
                          f"{len(targets)} ({', '.join(target.label for target in targets)}); bench each --model in a "
                          "run of its own with its own trace, then --merge the outputs")
    (target,) = targets
    try:
        counts, _sequence = routing_profile(path, len(target.spec.moe_layers), target.spec.num_experts)
    except SpecterError as error:  # TraceError (unreadable, not a trace) or ConfigError (another model's shape)
        raise ConfigError(f"--placement-profile: {error}") from None
    if counts is None:  # the engine would place from uniform routing: the run the option exists to avoid
        raise ConfigError(f"--placement-profile {path}: the trace has no rounds (`generate --trace` records speculative "
                          "rounds of an offloaded engine: --residents below the expert count, speculation on)")


def widen_factor(text: str | None, path: Path) -> int | None:
    """The factor of --widen for the checkpoint at `path` (None: no widening); 'auto' reads the trainer's train.json."""
    if text is None:
        return None
    if text != "auto":
        return int(text)
    record = path / "train.json"
    try:
        data = json_value(record.read_text()) if record.is_file() else None
    except (OSError, ValueError) as error:
        raise ConfigError(f"--widen auto: {record} cannot be read as JSON ({error}); give --widen F") from None
    factor = data.get("factor") if isinstance(data, dict) else None
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
        raise ConfigError(f"--widen auto: {record} records no widening factor (benchmarks/reference_model.py --shape writes "
                          "one); give --widen F")
    return factor


def _settings(args: argparse.Namespace, name: str) -> list[Setting]:
    if args.budget:
        return [Setting(budget=size) for size in args.budget]
    if args.residents:
        return [Setting(residents=count) for count in args.residents]
    if args.preset == "paper" and name in PAPER_SETTINGS:
        return [Setting(residents=count) for count in PAPER_SETTINGS[name]]
    if name in SHAPES:
        experts = SHAPES[name].get("num_experts") or SHAPES[name].get("num_local_experts") or SHAPES[name].get("n_routed_experts")
        return [Setting(residents=max(SHAPES[name]["num_experts_per_tok"], experts // 4))]
    return [Setting(residents=QUICK_RESIDENTS)]


def fit_default_residents(target: ModelTarget) -> str | None:
    """The default of QUICK_RESIDENTS slots (no --residents or --budget given) lowered for a checkpoint of that many
    experts per layer or fewer, where it would keep every expert resident (cells labelled residents=6 on a 4-expert
    model, nothing offloaded to compare); returns the note saying so, else None. A default the user did not type
    adapts, as a synthetic shape's does (a quarter of its experts): half of them, at least the top-k, one fewer than
    all."""
    experts, top_k = target.spec.num_experts, target.spec.top_k
    if any(setting.residents is None or setting.residents < experts for setting in target.settings):
        return None
    residents = max(1, min(experts - 1, max(top_k, experts // 2)))
    target.settings = [Setting(residents=residents)]
    return (f"{target.label}: {experts} experts per MoE layer, so the default of {QUICK_RESIDENTS} resident would keep "
            f"every expert on the device; benched at {residents} (give --residents below {experts} to choose)")


def _synthetic_target(name: str, layers: int | None, settings: list[Setting], per_kind: int) -> ModelTarget:
    spec = spec_from_config(shape_config(name, layers))
    return ModelTarget(label=shape_label(name, layers), make_source=lambda: synthetic_source(name, layers), spec=spec,
                       full_spec=spec_from_config(shape_config(name)), prompts=synthetic_prompts(spec.vocab_size, per_kind),
                       warmup=warmup_prompt(spec.vocab_size), settings=settings,
                       notes=[f"{shape_label(name, layers)}: synthetic random weights (random routing, no locality)"])


def options_from_args(args: argparse.Namespace) -> Options:
    import torch

    quick = args.preset == "quick" and not args.model
    # The quick matrix's own choices (systems, draft format, repeats, links) hold only while the user shapes
    # no matrix of their own: `--systems X` gets the plain defaults, as every run but the bare command does.
    quick_matrix = quick and args.systems is None
    systems = args.systems if args.systems is not None else list(QUICK_SYSTEMS if quick_matrix else DEFAULT_SYSTEMS)
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown:
        raise ConfigError(f"unknown system(s) {unknown}; systems: {', '.join(SYSTEMS)} (a system of your own plug-ins: "
                          "--system NAME:KEY=VALUE,...)")
    custom = {}
    for text in args.system:
        system = custom_system(text)
        if system.name in custom:
            raise ConfigError(f"--system {system.name}: given twice")
        custom[system.name] = system
    systems = [*systems, *custom]
    table = SYSTEMS | custom
    # A system that replays specter's rounds (exact-prefetch-specter) needs them recorded first: it runs after the
    # others, whatever the order given. Without specter in the run it could only be skipped, after the load and every
    # other cell had spent their time: refused here instead.
    replaying = [name for name in systems if table[name].replay_schedule]
    if replaying and SCHEDULE_SOURCE not in systems:
        raise ConfigError(f"{', '.join(replaying)} replays the rounds {SCHEDULE_SOURCE} runs in the same bench run; add "
                          f"{SCHEDULE_SOURCE} to --systems (the order does not matter)")
    systems = sorted(systems, key=lambda name: table[name].replay_schedule)
    modes = list(dict.fromkeys(args.sampling))
    if not modes or any(mode not in SAMPLING_MODES for mode in modes):
        raise ConfigError(f"--sampling {','.join(args.sampling)}: expected a comma-separated list of {', '.join(SAMPLING_MODES)}")
    on_cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    # Through EngineConfig.threads, so that each runtime's build sets it (a torch.set_num_threads here would be reset
    # there to the engine's default); on the CPU the bench's own default is 1 (the help says why).
    threads = args.threads or (None if on_cuda else 1)
    links = (args.link if args.link is not None
             else ["native"] if on_cuda else list(QUICK_LINKS if quick_matrix else PLAIN_CPU_LINKS))
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (32 if quick else 128)
    tuning = TuningConfig().with_overrides([*args.tune, *(["transfer.issue_marks=true"] if args.copy_gaps else [])])
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if quick_matrix else 1)
    quant = args.quant or (QUICK_QUANT if quick_matrix else "int4")
    if args.self_profile_tokens is not None and args.self_profile_tokens < 0:
        raise ConfigError(f"--self-profile-tokens {args.self_profile_tokens}: expected 0 (none) or more tokens")
    if args.placement_overlap is not None and not 0.0 <= args.placement_overlap <= 1.0:
        raise ConfigError(f"--placement-overlap {args.placement_overlap}: expected 0 <= overlap <= 1")
    # As DraftConfig resolves them: a depth given is kept (the other follows it), none given is the default within.
    k_max = args.k_max if args.k_max is not None else max(DraftConfig().k_max, args.k or 0)
    k = args.k if args.k is not None else min(DEFAULT_K, k_max)
    drafting = [name for name in systems if table[name].speculative]
    if k_max == 0 and drafting:  # the runtime they share would be built without a draft: none of its cells would run
        raise ConfigError(f"--k-max 0 leaves no draft depth, and {', '.join(drafting)} need a draft; raise --k-max to 1 or "
                          "more, or leave them out of --systems")
    return Options(systems=systems, links=links, max_new_tokens=max_new, warmup_tokens=min(args.warmup_tokens, max_new),
                   repeats=repeats, k=k, k_max=k_max, row_bucket=args.row_bucket,
                   device=args.device, dtype=args.dtype,
                   progress=not args.no_progress, hf=not args.no_hf, static_verify=args.static_verify, quant=quant,
                   tuning=tuning, sampling=modes, desktop_threads=args.desktop_threads, threads=threads,
                   placement_overlap=args.placement_overlap, placement_profile=args.placement_profile, custom=custom,
                   **({} if args.self_profile_tokens is None else {"self_profile_tokens": args.self_profile_tokens}))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.row_bucket <= 256:
        parser.error(f"--row-bucket must be 1..256 (rows per exact block and per verify pass), got {args.row_bucket}")
    from specter import log

    log.configure(level="ERROR")
    return run_tool(lambda: run(args, argv))


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    check_output_folder(args.out, "--out")  # before minutes of measurement, not after
    check_output_names(args.out)
    check_time_budget(args.time_budget)
    check_args(args)
    if args.merge:
        payload = report.merge(args.merge)
        keep_previous(args.out)  # an earlier run's plots go with it: they would not show the merged results
        write_outputs(args.out, payload, plots=not args.no_plots)
        show(payload, f"merged {len(args.merge)} result sets ({len(payload['runs'])} requests) into {args.out}/")
        return verdict(payload["summary"], "the merged parts hold no run", cells=payload["cells"])  # as the parts' own runs ended
    started = time.monotonic()
    targets, notes = targets_from_args(args)
    check_residents(args.residents, targets)
    check_placement_profile(args.placement_profile, targets)
    options = options_from_args(args)
    check_context(targets, options, args.realism_tokens if args.realism else None)
    keep_previous(args.out)
    results = Results(args.out, argv, args, targets, options, notes, started)
    results.write(RUNNING)  # from the start: a run that dies before its first cell leaves its own files, marked partial
    stopper = Stopper(grace_s=stopping.STOP_GRACE_S, on_force=results.force)
    try:
        with stopper.installed():
            if args.realism:
                realism_reports(targets, options, args.realism_tokens, stopper, into=results.realism)
            run_matrix(targets, options, args.time_budget, on_cell=results.update, stopper=stopper)
    except BenchStopped as stop:
        payload = results.write(f"stopped by {signal.Signals(stop.signum).name} after "
                                f"{round(time.monotonic() - results.started, 1)} s: the cell in progress was abandoned",
                                final=True)
        print("\n".join(report.table_lines(payload["summary"], report.SHORT_COLUMNS)), file=sys.stderr)
        print(f"\n{stop}: {len(payload['cells'])} cells ended, {len(payload['partial']['remaining'])} still to run; the "
              f"finished ones are in {args.out}/ (results.json, results.md: partial; no plots); exit status {stop.status}",
              file=sys.stderr)
        return stop.status
    except OutputError:  # --out cannot be written: writing the partial results there would fail again
        raise
    except BaseException as error:  # a crash or an error no part caught: keep what finished, then let it through
        try:
            results.write(f"failed: {type(error).__name__}: {error} (the cell in progress was abandoned)")
        except OSError as failure:
            print(f"could not write the partial results: {failure}", file=sys.stderr)
        raise
    payload = results.write(None, plots=not args.no_plots)
    show(payload, f"{len(payload['runs'])} requests in {payload['elapsed_s']} s; results in {args.out}/ (results.json, "
                  f"results.md{', plots' if not args.no_plots else ''})")
    return verdict(payload["summary"], "every cell was skipped or failed (the notes above say why)", options.systems,
                   payload["cells"])


def show(payload: dict, headline: str) -> None:
    """What a run (or a merge, the same for its rows) prints: the tables, `headline`, the reading, the flags on
    stdout, the notes (skipped cells and why, model notes, a merge's) on stderr."""
    summary, flags = payload["summary"], report.exact_prefetch_flags(payload["summary"])
    print("\n".join(report.table_lines(summary, report.SHORT_COLUMNS) + report.copy_idle_lines(summary)
                    + report.host_path_lines(summary)))
    print(f"\n{headline}")
    if line := report.reading(summary):
        print(line)
    for flag in flags:
        print(f"flag: {flag}")
    for note in payload["notes"]:
        if note not in flags:
            print(f"note: {note}", file=sys.stderr)


def verdict(summary: Sequence[dict], why_empty: str, asked: Sequence[str] = (), cells: Sequence[dict] = ()) -> int:
    """The exit status of a run's (or a merge's) summary: 1 where an engine system's tokens differ from its baseline,
    NOTHING_MEASURED where no engine row is there (`all()` of none is True: nothing measured read as a success), or
    where only `resident` ran of the `asked` systems (the others' every cell skipped: a budget below the model's
    minimum, say) and there is nothing to compare; CELLS_FAILED where a cell of `cells` failed and the rest ran."""
    engine_rows = [row for row in summary if row["system"] != "hf-accelerate"]
    if not engine_rows:
        print(f"nothing was measured: {why_empty}; exit status {NOTHING_MEASURED}", file=sys.stderr)
        return NOTHING_MEASURED
    others = [name for name in asked if name != "resident"]
    if others and all(row["system"] == "resident" for row in engine_rows):
        print(f"nothing was compared: only resident (the ceiling) ran; every cell of {', '.join(others)} was skipped "
              f"(the notes above say why); exit status {NOTHING_MEASURED}", file=sys.stderr)
        return NOTHING_MEASURED
    if not all(row["tokens_equal"] for row in engine_rows):
        return 1
    failed = [f"{c['model']} {c['setting']} {c['link']} {c['system']}" for c in cells if str(c.get("status")).startswith("failed")]
    if failed:
        print(f"{len(failed)} cell(s) failed, the others ran: {'; '.join(failed)} (the notes above say why); exit "
              f"status {CELLS_FAILED}", file=sys.stderr)
        return CELLS_FAILED
    return 0


NOTHING_MEASURED = 3
"""The exit status of a run that ended without measuring a cell (each skipped: memory, time budget, a model part
that failed), told apart from 0 (done), 1 (tokens differ) and 2 (bad input, or an --out it cannot write)."""
CELLS_FAILED = 4
"""The exit status of a run whose other cells ran but some failed: a plug-in under test raised or answered wrongly
(results.json's cells keep each one's `failed: ...` status), so a script does not read the matrix as whole."""


def check_context(targets: Sequence[ModelTarget], options: Options, realism_tokens: int | None) -> None:
    """Every request, warm-up and draft within each model's positions, before any model loads: beyond them every
    part was skipped, and the run measured nothing. With --realism, its report's requests too."""
    need = bench_context(options)
    for target in targets:
        positions = target.spec.max_position
        if need > positions:
            extra = need - max(options.max_new_tokens, options.warmup_tokens)  # the prompt, the draft's depth, the slack
            fits = positions - extra
            remedy = (f"give --max-new-tokens {fits} or less" if fits >= 1
                      else f"lower --k-max (it alone leaves no room for a new token)")
            raise ConfigError(f"--max-new-tokens {options.max_new_tokens}: {target.label} has {positions} positions, and a "
                              f"request takes {need} ({PROMPT_TOKENS} prompt, {options.max_new_tokens} new, --k-max "
                              f"{options.k_max} drafted and 8 of slack); {remedy}")
        if realism_tokens is not None and target.path is not None and PROMPT_TOKENS + realism_tokens > positions:
            raise ConfigError(f"--realism-tokens {realism_tokens}: {target.label} has {positions} positions, and a report's "
                              f"request takes a {PROMPT_TOKENS}-token prompt plus them; give --realism-tokens "
                              f"{positions - PROMPT_TOKENS} or less")


def realism_context(target: ModelTarget, new_tokens: int) -> int:
    """The realism report's context: the engine's default, or more when --realism-tokens asks for it (the engine's
    default would refuse its requests), within the model's positions."""
    return min(target.spec.max_position, max(DEFAULT_CONTEXT, PROMPT_TOKENS + new_tokens))


def check_output_names(out: Path) -> None:
    """The files the bench writes into --out (results, plots) are free to write: a folder of one of their names would
    fail the first write, or the plots at the end, after the work."""
    for name in ("results.json", "results.md", *PLOT_FILES):
        if (out / name).is_dir():
            raise ConfigError(f"--out {out}: {out / name} is a folder, where the bench writes its {name}; move it or "
                              "choose another --out")


PREVIOUS = "previous"
"""The subfolder of --out that an earlier run's files move into (`keep_previous`)."""


def keep_previous(out: Path) -> Path | None:
    """Move an earlier run's results.json, results.md and plots out of `out` into `out/previous/<its date>/` before
    this run writes a byte, and say where on stderr: a second run into one --out (the default bench-out) replaced them
    at its start, and a crash or stop of it left a file of 0 runs. Returns the folder, or None when there was nothing."""
    names = [name for name in ("results.json", "results.md", *PLOT_FILES) if (out / name).is_file()]
    if not names:
        return None
    stamp = _run_stamp(out, names)
    folder, suffix = out / PREVIOUS / stamp, 1
    while folder.exists():  # two runs stamped alike (one second apart): neither overwrites the other
        suffix += 1
        folder = out / PREVIOUS / f"{stamp}-{suffix}"
    try:
        folder.mkdir(parents=True)
        for name in names:
            (out / name).replace(folder / name)
    except OSError as error:
        raise OutputError(f"--out {out}: cannot move the earlier run's {', '.join(names)} into {folder} ({error.strerror or error}); "
                          "move them yourself or choose another --out") from None
    print(f"note: the earlier run's {', '.join(names)} in {out} moved to {folder}", file=sys.stderr)
    return folder


def _run_stamp(out: Path, names: Sequence[str]) -> str:
    """A folder name for the run whose files are in `out`: the date its results.json records, else the newest mtime of
    its files; in UTC, without ':' (not allowed in Windows names)."""
    try:
        date = json_value((out / "results.json").read_text())["machine"]["date"]
        stamp = datetime.datetime.fromisoformat(date).astimezone(datetime.timezone.utc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a bench file, or torn by hand
        mtime = max((out / name).stat().st_mtime for name in names)
        stamp = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H-%M-%SZ")


def given_path(text: str) -> Path:
    """A path option's value: an empty one is refused, not read as the current directory (an unset variable in a
    script, `--out "$DIR"`, would write into, or merge from, wherever the run started)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; give a file or folder (the current one is '.')")
    return Path(text)


def check_time_budget(budget_s: float | None) -> None:
    """--time-budget is a positive, finite number of seconds; no budget is leaving it out (0 once meant that)."""
    if budget_s is not None and not (math.isfinite(budget_s) and budget_s > 0):
        raise ConfigError(f"--time-budget {budget_s:g}: expected seconds above 0 (leave the option out for no budget)")


RUNNING = ("running: written after the last cell that ended; if no bench is running any more, it was killed before its "
           "next cell ended (SIGKILL, out of memory)")
"""The `partial.reason` of the files written while the matrix runs."""


class Results:
    """One bench run's results.json and results.md: written at the start, after every cell that ended (ran or was
    skipped) and at the end. Each write replaces the files whole (report.write_json: a temporary file renamed over
    it), so a kill at any moment leaves the previous version. Until the last write, `complete` is false and `partial`
    says why and which planned cells had not ended."""

    def __init__(self, out: Path, argv: Sequence[str], args: argparse.Namespace, targets: Sequence[ModelTarget],
                 options: Options, notes: list[str], started: float) -> None:
        self.out, self.targets, self.notes, self.started = out, list(targets), list(notes), started
        self.head = {"machine": report.machine(argv), "options": vars(options) | {"tuning": options.tuning.model_dump()},
                     "args": {k: str(v) for k, v in vars(args).items()}}
        self.models = [_model_info(target, options) for target in targets]
        self.realism: dict[str, dict] = {}
        planned = [dict(zip(CELL_FIELDS, key)) for target in targets
                   for part in planned_cells(target, options).values() for key in part]
        self.progress = Progress(records=[], cells=[], remaining=planned)
        self.lock = threading.Lock()  # the main thread's writes and the stop watchdog's (`force`)
        self.final = False
        """The files hold a stop's last word; the watchdog leaves them."""
        with output_errors(out):
            out.mkdir(parents=True, exist_ok=True)
            remove_plots(out)  # keep_previous moved an earlier run's; a caller that skipped it must not keep stale ones

    def update(self, progress: Progress) -> None:
        """bench_models' on_cell: the matrix so far, written at once."""
        self.progress = progress
        self.write(RUNNING)

    def payload(self, partial: str | None) -> dict:
        """results.json's content now; `partial` None: the run ended (complete), else why it is partial."""
        records, cells = list(self.progress.records), list(self.progress.cells)
        summary = report.summarize(records)
        notes = [*self.notes, *(note for target in self.targets for note in target.notes)]
        notes += [f"{c['model']} {c['setting']} {c['link']} {c['system']}: {c['status']}" for c in cells if c["status"] != "ok"]
        notes += report.exact_prefetch_flags(summary)
        models = [info | ({"realism": self.realism[info["label"]]} if info["label"] in self.realism else {})
                  for info in self.models]
        payload = {**self.head, "models": models, "cells": cells, "summary": summary, "runs": records, "notes": notes,
                   "elapsed_s": round(time.monotonic() - self.started, 1), "complete": partial is None}
        if partial is not None:
            payload["partial"] = {"reason": partial, "remaining": list(self.progress.remaining)}
        return payload

    def write(self, partial: str | None, plots: bool = False, final: bool = False) -> dict:
        """Write the files (plots only when asked: at the end); returns the payload. `final`: a stop's last word, which
        the watchdog (armed until the process exits) leaves as it is."""
        payload = self.payload(partial)
        with self.lock:
            write_outputs(self.out, payload, plots=plots)
            self.final = final
        return payload

    def force(self, signum: int, why: str) -> None:
        """The last write before the stopper ends the process (`why`: a second signal, or the cell in progress would
        not let go within the grace)."""
        if not self.lock.acquire(timeout=2.0):  # a write in progress: its files stay valid either way
            return
        try:
            if not self.final:
                reason = f"stopped by {signal.Signals(signum).name}: {why}, and the process was ended"
                write_outputs(self.out, self.payload(reason), plots=False)
        finally:
            self.lock.release()


def realism_reports(targets: Sequence[ModelTarget], options: Options, new_tokens: int,
                    stopper: Stopper | None = None, into: dict[str, dict] | None = None) -> dict[str, dict]:
    """The realism report of every checkpoint target (synthetic shapes have random weights: nothing to report), each
    printed as it is made; its draft has the bench's expert format. A model that cannot be reported is noted. Each
    report goes into `into` as it is made (the results written after every cell carry those made so far). With a
    `stopper`, a stop signal ends it (BenchStopped)."""
    import asyncio

    from specter.bench.realism import format_report, realism_config, realism_for_bench

    reports = {} if into is None else into
    for target in targets:
        if target.path is None:
            target.notes.append(f"{target.label}: no realism report (synthetic random weights route at random)")
            continue
        context = realism_context(target, new_tokens)
        config = realism_config(options.device, options.quant, context)
        config = config.model_copy(update={"threads": options.threads})
        try:
            run = stopper.run if stopper is not None else asyncio.run
            reports[target.label] = run(realism_for_bench(target.make_source(), target.path, config=config,
                                                          new_tokens=new_tokens, label=target.label))
        except PromptError as error:  # a prompts.json prompt longer than the bench's: the engine's advice names --max-context
            target.notes.append(f"{target.label}: realism report skipped: a prompt plus --realism-tokens {new_tokens} does "
                                f"not fit the report's context of {context} tokens; lower --realism-tokens")
            continue
        except SpecterError as error:
            target.notes.append(f"{target.label}: realism report skipped: {error}")
            continue
        print(format_report(reports[target.label]) + "\n")
    return reports


def _model_info(target: ModelTarget, options: Options) -> dict:
    import torch

    spec = target.spec
    element = torch.empty((), dtype=resolve_dtype(EngineConfig(dtype=options.dtype), spec)).element_size()
    return {"label": target.label, "family": spec.family, "layers": spec.num_layers, "full_layers": target.full_spec.num_layers,
            "moe_layers": len(spec.moe_layers), "experts": spec.num_experts, "top_k": spec.top_k, "hidden": spec.hidden_size,
            "expert_intermediate": spec.expert_intermediate, "widen": target.widen, "dtype": spec.dtype,
            "expert_bytes": spec.expert_bytes(element), "expert_mb": round(spec.expert_bytes(element) / 1e6, 2),
            "experts_gib": round(len(spec.moe_layers) * spec.num_experts * spec.expert_bytes(element) / 2**30, 2),
            "settings": [s.label for s in target.settings],
            "prompts": [{"kind": p.kind, "index": p.index, "ids": p.ids} for p in target.prompts],
            "path": str(target.path) if target.path else None}


def write_outputs(out: Path, payload: dict, plots: bool = True) -> None:
    """results.json, results.md and (`plots`) the plots into `out`; a write the system refuses (a full disk, a folder
    that cannot be made) is an OutputError naming the path (exit 2), not a traceback."""
    with output_errors(out):
        out.mkdir(parents=True, exist_ok=True)
    with output_errors(out / "results.json"):
        report.write_json(out / "results.json", payload)
    with output_errors(out / "results.md"):
        report.write_text(out / "results.md", report.markdown_report(payload))
    if plots:
        from specter.bench.plots import write_plots

        with output_errors(out):
            payload["plots"] = write_plots(payload, out)


@contextlib.contextmanager
def output_errors(path: Path) -> Iterator[None]:
    """An OSError of a write of `path` (--out or a file in it) as the bench's output error, naming it and why."""
    try:
        yield
    except OutputError:
        raise
    except OSError as error:
        raise OutputError(f"--out: cannot write {error.filename or path} ({error.strerror or error}); "
                          f"{write_advice(error, 'choose another --out')}") from None
