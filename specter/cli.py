"""The command line: `specter generate`, `specter info` and `specter serve`. Errors exit non-zero with the message on stderr."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from specter.exits import run_tool
from specter.server.cli import add_serve_parser, cmd_serve

DEFAULT_PROMPT_IDS = [1, 2, 3, 4]  # when neither --prompt nor --prompt-ids is given


def _ids(text: str) -> list[int]:
    parts = text.split(",")
    try:
        return [int(part) for part in parts]  # an empty part (1,,2 or a trailing comma) is a typo, not a skip
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specter", description="Speculative expert-offloaded MoE inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate text or tokens from a prompt"))
    info = commands.add_parser("info", help="summarise a checkpoint: family, parameters, expert bytes, budgets")
    info.add_argument("model", help="checkpoint directory, or the name of a built-in model (e.g. tiny)")
    info.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    info.add_argument("--max-context", type=int, default=None,
                      help="context the budgets are planned for (default: min(2048, the model's max_position_embeddings))")
    info.add_argument("--quant", default="int4", choices=["int4", "int8", "int3", "int2", "gptq4"], help="draft quantization")
    info.add_argument("--k-max", type=int, default=None, metavar="N",
                      help="the draft depth the engine's verify is sized for, as generate's --k-max (default 15): "
                           "deeper verifies take workspace from the expert slots")
    info.add_argument("--budget", default=None, metavar="SIZE",
                      help="GPU memory budget (e.g. 24GiB): print the expert slots per layer it leaves with the draft and "
                           "without one (--k-max 0), and make the placement for the first (the second where the draft "
                           "does not fit)")
    info.add_argument("--residents", type=int, default=None, metavar="N",
                      help="expert slots per MoE layer the placement is made for (default: --budget's, else the model's top-k)")
    info.add_argument("--cpu-experts", default="off", metavar="off|all|auto|NAME",
                      help="placement (specter.placement plug-in) whose host experts to count")
    info.add_argument("--link", default=None, metavar="PRESET|GBPS",
                      help="the link the copy time is for (default: a pinned copy measured on CUDA, none on the CPU)")
    info.add_argument("--cpu-threads", type=int, default=None, metavar="N", help="host expert threads (default: the cores less one)")
    info.add_argument("--placement-profile", default=None, metavar="TRACE",
                      help="routing trace whose expert use the placement weighs (default: uniform routing)")
    info.add_argument("--placement-overlap", type=float, default=None, metavar="O",
                      help="auto's overlap (0..1): the share of the shorter of a layer's host and copy paths hidden "
                           "under the longer (default: auto's own, 0, their sum)")
    info.add_argument("--no-measure", dest="measure", action="store_false",
                      help="do not time one expert on the host and on the link (what auto decides then needs --link)")
    info.add_argument("--recalibrate", action="store_true",
                      help="time them anew instead of taking this machine's stored figures (stores the new ones)")
    _add_tune(info)
    info.add_argument("--json", action="store_true", help="print one JSON object")
    _add_logging(info)
    add_serve_parser(commands)
    listing = commands.add_parser("plugins", help="list the installed plug-ins of every group: name, distribution, "
                                                  "the default, and what SPECTER_PLUGINS leaves out")
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    _add_logging(listing)
    return parser


def _add_generate(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--model", default="tiny", help="checkpoint directory, or the name of a built-in model (default: tiny)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text (needs the checkpoint's tokenizer.json)")
    prompt.add_argument("--prompt-ids", type=_ids, default=None, help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="send --prompt as a user message through the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    memory = gen.add_argument_group("memory and device")
    size = memory.add_mutually_exclusive_group()  # argparse names both options when they come together
    size.add_argument("--budget", default=None, metavar="SIZE", help="GPU memory budget, e.g. 24GiB (default: all experts resident)")
    size.add_argument("--residents", type=int, default=None, metavar="N", help="expert cache slots per MoE layer (instead of --budget)")
    memory.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    memory.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    memory.add_argument("--max-context", type=int, default=None,
                        help="longest prompt plus generation, in tokens (default: min(2048, the model's max_position_embeddings))")
    memory.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads for the whole process (default: 1 on CUDA, else half the cores, 1 to 4)")
    memory.add_argument("--link", default=None, metavar="PRESET|GBPS", help="emulate a slower link: gen5, gen4, gen3, ddr4-desktop or GB/s")
    memory.add_argument("--cpu-experts", default="off", metavar="off|all|auto|NAME",
                        help="which routed experts the host CPU computes for the engine's life (specter.placement plug-in): "
                             "off (none, default), all (every expert not resident: nothing is copied), auto (a cost model "
                             "calibrated at load: the least used, where the host is predicted faster than the link)")
    memory.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                        help="torch threads of the host expert path (default: the host's cores less one); fewer emulate a smaller host")
    memory.add_argument("--placement-profile", default=None, metavar="TRACE",
                        help="a routing trace (--trace) of this model whose expert use the placement weighs (default: uniform)")
    memory.add_argument("--self-profile-tokens", type=int, default=None, metavar="N",
                        help="tokens of the model's own text a speculating engine decodes at load to record the routing "
                             "trace auto places from, where no --placement-profile is given (default 256; 0: none, and "
                             "auto then places such an engine off)")
    memory.add_argument("--placement-overlap", type=float, default=None, metavar="O",
                        help="auto's overlap (0..1): the share of the shorter of a layer's host and copy paths that "
                             "hides under the longer. 0 (auto's default) prices a layer at their sum, and under "
                             "uniform use puts all of its non-residents on the host or none; 1 prices it at the longer "
                             "and balances the two paths, splitting a layer: against 0, more experts on the host "
                             "where a host expert costs more than its copy, fewer where it costs less")
    memory.add_argument("--recalibrate", action="store_true",
                        help="time the host expert and the link anew at load (default: reuse this machine's earlier "
                             "figures for the same shape and threads, so that auto places the same from run to run)")
    policies = gen.add_argument_group("speculation and policies")
    policies.add_argument("--eviction", default="plan-protect", metavar="NAME", help="specter.eviction plug-in")
    policies.add_argument("--prefetch", default="topm-keep", metavar="NAME", help="specter.prefetch plug-in")
    policies.add_argument("--lookahead", default="fixed", metavar="NAME", help="specter.lookahead plug-in")
    policies.add_argument("--k", type=int, default=None, metavar="N",
                          help="draft depth for the fixed lookahead (default 4, at most --k-max); 0 turns speculation off")
    policies.add_argument("--k-max", type=int, default=15, metavar="N", help="largest draft depth any lookahead may choose "
                          "(15: 16 verify rows, one pass of the static verify at the default row bucket of 16)")
    policies.add_argument("--quant", default="int4", choices=["int4", "int8", "int3", "int2", "gptq4"], help="draft expert format")
    policies.add_argument("--scout", action="store_true",
                          help="offloaded plain rounds (k = 0) prefetch the experts of one draft step's routes first")
    policies.add_argument("--overlap", type=int, default=None, metavar="N",
                          help="draft up to N steps ahead beside each verify (kept when the verify takes every draft); "
                               "0: off; default: 16 on CUDA, off on the CPU")
    _add_tune(policies)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=0)
    sampling.add_argument("--sampling", default="coupled", choices=["coupled", "rejection"], help="acceptance rule when sampling")
    output = gen.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object with `tokens`, `text`, `finish_reason` and `stats` at the end")
    output.add_argument("--trace", default=None, metavar="PATH",
                        help="record a routing trace of every speculative round of an offloaded engine (refused where it "
                             "would record none: every expert resident, --k 0 or --k-max 0)")
    output.add_argument("--progress", action="store_true", help="progress bars while loading")
    _add_logging(gen)


def _add_tune(parser: Any) -> None:
    parser.add_argument("--tune", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="set a field of EngineConfig.tuning, e.g. host.parallel_experts=true (repeatable; the "
                             "fields: TuningConfig in specter/config.py)")


def _add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-json", action="store_true", help="structured logs as JSON lines on stderr")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specter import log

    log.configure(json=args.log_json, level=args.log_level)
    command = {"generate": cmd_generate, "info": cmd_info, "serve": cmd_serve, "plugins": cmd_plugins}[args.command]
    return run_tool(lambda: _flag_errors(lambda: command(args)), preload=("torch",))


def _out(text: str) -> None:
    """Write to stdout now (a stream's tokens as they commit); `run_tool` names a write that fails."""
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- generate -----------------------------------------------------------------------------------------
FLAGS = {
    "EngineConfig.device": "--device", "EngineConfig.dtype": "--dtype", "EngineConfig.max_context": "--max-context",
    "EngineConfig.budget": "--budget", "EngineConfig.residents": "--residents", "EngineConfig.eviction": "--eviction",
    "EngineConfig.prefetch": "--prefetch", "EngineConfig.lookahead": "--lookahead", "EngineConfig.link": "--link",
    "EngineConfig.threads": "--threads", "EngineConfig.cpu_experts": "--cpu-experts",
    "EngineConfig.cpu_threads": "--cpu-threads", "EngineConfig.placement_profile": "--placement-profile",
    "EngineConfig.placement_overlap": "--placement-overlap", "EngineConfig.self_profile_tokens": "--self-profile-tokens",
    "EngineConfig.draft.k": "--k", "EngineConfig.draft.k_max": "--k-max", "EngineConfig.draft.quant": "--quant",
    "EngineConfig.draft.sampling": "--sampling", "EngineConfig.draft.overlap": "--overlap",
    "GenerationConfig.max_new_tokens": "--max-new-tokens", "GenerationConfig.temperature": "--temperature",
    "GenerationConfig.top_k": "--top-k", "GenerationConfig.top_p": "--top-p", "GenerationConfig.seed": "--seed",
    "GenerationConfig.stop_strings": "--stop",
}
"""The command-line option of each configuration field the CLI sets, for its errors: a user typed `--max-context 0`,
not `EngineConfig.max_context = 0`."""
_FIELD = re.compile(r"\b((?:EngineConfig|GenerationConfig)(?:\.[a-z_]+)+) = ")
_DRAFT_DUMP = re.compile(r"\bEngineConfig\.draft = \{[^{}]*\}: ")


def in_flags(message: str) -> str:
    """A configuration error in the command line's words: each field the CLI sets named by its option."""
    message = _DRAFT_DUMP.sub("the draft's options (--k, --k-max, --quant, --sampling, --scout, --overlap): ", message)
    return _FIELD.sub(lambda match: f"{FLAGS[match.group(1)]} " if match.group(1) in FLAGS else match.group(0), message)


def _flag_errors(build: Any) -> Any:
    """`build()`, a command, whose ConfigError (generate's, info's, serve's alike) is said in the command line's words."""
    from specter.errors import ConfigError

    try:
        return build()
    except ConfigError as error:  # the same error, of its own kind (a subclass stays one), in the command line's words
        error.args = (in_flags(str(error)),)
        raise


def engine_config(args: argparse.Namespace):
    from specter.config import EngineConfig, TuningConfig

    return EngineConfig.build(
        device=args.device, dtype=args.dtype, max_context=args.max_context, budget=args.budget, residents=args.residents,
        eviction=args.eviction, prefetch=args.prefetch, lookahead=args.lookahead, link=args.link, progress=args.progress,
        threads=args.threads, cpu_experts=args.cpu_experts, cpu_threads=args.cpu_threads, recalibrate=args.recalibrate,
        placement_profile=args.placement_profile, placement_overlap=args.placement_overlap,
        **({} if args.self_profile_tokens is None else {"self_profile_tokens": args.self_profile_tokens}),
        tuning=TuningConfig().with_overrides(args.tune),
        draft=dict(k_max=args.k_max, quant=args.quant, sampling=args.sampling, scout=args.scout, overlap=args.overlap)
        | ({} if args.k is None else {"k": args.k}),  # no --k: the default depth, within --k-max
    )


def generation_config(args: argparse.Namespace):
    from specter.config import GenerationConfig

    return GenerationConfig.build(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, stop_strings=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from specter.kernel import run

    from specter.builtin import builtin_note

    # Validate everything the user typed before loading anything.
    check_generate_inputs(args)
    config, generation = engine_config(args), generation_config(args)
    spec, tokenizer, prompt = check_context(args, config)
    if args.trace is not None:
        check_trace_records(args.trace, config, spec)
    if note := builtin_note(args.model):
        print(note, file=sys.stderr)
    for note in unused_options(args, config, generation):
        print(f"note: {note}", file=sys.stderr)
    return run(_generate(args, config, generation, tokenizer, prompt))


def unused_options(args: argparse.Namespace, config: Any, generation: Any) -> list[str]:
    """The options given that this run's other options leave unused, each said once: a run is not refused for them
    (a script may set them all), but a user who tuned one should not read the result as its effect."""
    notes = []
    if args.placement_profile is not None and config.cpu_experts == "off":  # checked at load all the same (build_runtime)
        notes.append("--placement-profile weighs where a placement (--cpu-experts auto) puts experts; with --cpu-experts "
                     "off every expert stays on the device path, so the trace is checked but not used")
    placing = [option for option, given in (("--cpu-threads", args.cpu_threads is not None),
                                            ("--placement-overlap", args.placement_overlap is not None),
                                            ("--self-profile-tokens", args.self_profile_tokens is not None),
                                            ("--recalibrate", args.recalibrate)) if given]
    if placing and config.cpu_experts == "off":
        notes.append(f"{', '.join(placing)} set{'s' if len(placing) == 1 else ''} how the host expert path runs or is "
                     "placed; with --cpu-experts off no expert is computed on the host, so "
                     f"{'it is' if len(placing) == 1 else 'they are'} not used")
    if args.k is not None and config.lookahead != "fixed":
        notes.append(f"--k sets the fixed lookahead's depth; --lookahead {config.lookahead} chooses k each round (up to "
                     "--k-max), so --k is not used")
    sampling = [option for option, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if sampling and generation.temperature == 0:
        notes.append(f"{' and '.join(sampling)} shape sampling; at --temperature 0 (the default) decoding is greedy, the "
                     "most likely token, so they are not used; give --temperature above 0 to sample")
    return notes


def check_trace_records(path: str, config: Any, spec: Any) -> None:
    """Refuse, before loading, a --trace that would be written with no round: the engine records only its speculative
    rounds of offloaded experts (`build.unrecorded_rounds` says why none would come), and a header-only trace replays
    as a vacuous hit rate of 1 and is refused as a placement profile. A refusal costs the user nothing; a warning
    would scroll past a long load and leave a file that looks like a trace."""
    from specter.build import unrecorded_rounds
    from specter.errors import ConfigError

    if why := unrecorded_rounds(config, spec):
        raise ConfigError(f"--trace {path}: this engine would record no round: {why}")


def check_context(args: argparse.Namespace, config: Any) -> tuple[Any, Any, Any]:
    """The prompt against the checkpoint's tokenizer and the context against the model's positions, from its
    config.json and tokenizer files alone (before any weight is read: a text prompt without tokenizer.json, --chat
    without a chat template or a prompt too long for the context costs no load). Returns the model's spec, the
    tokenizer (None when the run needs none) and the prompt for the engine (a text prompt as its token ids)."""
    from specter.builtin import resolve_model
    from specter.decode import check_context_length
    from specter.errors import ConfigError
    from specter.memory import with_model_context
    from specter.model.checkpoint import Checkpoint
    from specter.tokenizer import Tokenizer

    directory = resolve_model(args.model)
    checkpoint = Checkpoint(directory)
    checkpoint.close()
    context = with_model_context(config, checkpoint.spec).max_context
    tokenizer, prompt = None, _prompt(args)
    if args.prompt is not None or args.stop:
        tokenizer = Tokenizer.from_dir(directory)
        if tokenizer is None:
            uses = "--prompt" if args.prompt is not None else "--stop"
            raise ConfigError(f"{uses} is text, and the checkpoint at {directory} has no tokenizer.json to read it; "
                              "give the prompt as --prompt-ids and no --stop (its text could not be matched)")
        if args.prompt is not None:
            ids = tokenizer.encode_chat(prompt) if args.chat else tokenizer.encode(prompt)
            prompt = tokenizer.within(ids, checkpoint.spec.vocab_size)
    check_context_length(len(prompt), args.max_new_tokens, context, checkpoint.spec.max_position)
    return checkpoint.spec, tokenizer, prompt


def check_generate_inputs(args: argparse.Namespace) -> None:
    """The text and the output paths the user typed (the model's limits are checked when its config is read)."""
    from specter.errors import ConfigError
    from specter.builtin import resolve_model
    from specter.paths import check_not_an_input, check_not_the_file, check_output_file
    from specter.tokenizer import check_text

    if args.chat and args.prompt is None:
        raise ConfigError("--chat sends --prompt through the chat template; give --prompt TEXT (token ids are "
                          "sent as they are, so --prompt-ids takes no --chat)")
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")
    for index, stop in enumerate(args.stop):
        check_text(stop, f"--stop {index + 1}", instead="")
    if args.trace is not None:
        if not args.trace:  # not `if args.trace`, which would take '' (an unset variable in a script, say) as no --trace
            raise ConfigError("--trace: empty path; give the file to write the routing trace to, or leave --trace out")
        check_output_file(args.trace, "--trace")
        check_not_an_input(args.trace, resolve_model(args.model), "--trace")  # a built-in model's folder too
        check_not_the_file(args.trace, args.placement_profile, "--trace", "--placement-profile")


async def _generate(args: argparse.Namespace, config: Any, generation: Any, tokenizer: Any, prompt: Any) -> int:
    from specter.api import Engine
    from specter.errors import SpecterError

    async with Engine.from_pretrained(args.model, config, tokenizer=tokenizer) as engine:
        if args.trace:
            engine.runtime.record_trace(args.trace)
        stream = engine.generate(prompt, generation, continuation=not args.chat)  # (the chat's ids: encoded above)
        shown = 0  # characters of text printed
        try:
            async with stream:
                async for piece in stream:
                    if not args.json:
                        _show(piece, text_mode=engine.tokenizer is not None)
                        shown += len(piece.text)
        except (SpecterError, asyncio.CancelledError) as error:  # a failure, or Ctrl-C (the runner cancels this task)
            # what was committed before it: the text the stream held back for a stop string too (it ended, so none
            # can complete), in text mode after what was printed
            if not args.json and engine.tokenizer is not None:
                _out(stream.text[shown:])
            elif args.json:  # one object whatever was committed (none, when the prompt's pass failed)
                failed = {"finish_reason": "error", "error": str(error)} if isinstance(error, SpecterError) else {
                    "finish_reason": "cancelled"}
                _out(json.dumps({"tokens": stream.token_ids, "text": stream.text, **failed,
                                 "stats": stream.stats.as_dict()}) + "\n")
            raise
        result = stream.result
        assert result is not None, "the stream ended without a result"
        # Before the engine closes: closing writes the trace's last lines, and a failure there (a full disk) must not
        # take the finished request's output with it
        if args.json:
            _out(json.dumps({"tokens": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
                             "stats": result.stats.as_dict()}) + "\n")
        else:
            _out("\n")
        print(summary_line(result.stats.as_dict()), file=sys.stderr)
    return 0


def _prompt(args: argparse.Namespace) -> Any:
    if args.prompt is None:
        return args.prompt_ids if args.prompt_ids is not None else DEFAULT_PROMPT_IDS
    return [{"role": "user", "content": args.prompt}] if args.chat else args.prompt


def _show(piece: Any, text_mode: bool) -> None:
    """Stream to the terminal as tokens commit: text when there is a tokenizer, else token ids."""
    if text_mode:
        _out(piece.text)
    elif piece.token_ids:
        _out(" ".join(map(str, piece.token_ids)) + " ")


def summary_line(stats: dict) -> str:
    """One line of the request's statistics, for stderr."""
    return (f"[{stats['new_tokens']} tokens, TTFT {stats['ttft_s'] * 1e3:.1f} ms, TPOT {stats['tpot_s'] * 1e3:.1f} ms, "
            f"acceptance {stats['acceptance_rate']:.0%}, mean accepted {stats['mean_accepted_length']:.2f}, "
            f"hit rate {stats['hit_rate']:.0%}, H2D {stats['h2d_bytes'] / 2**20:.1f} MiB, stall {stats['stall_s'] * 1e3:.1f} ms]")


# ---- info ---------------------------------------------------------------------------------------------
PLUGIN_DEFAULTS = {"eviction": "eviction", "prefetch": "prefetch", "lookahead": "lookahead", "placement": "cpu_experts",
                   "backends": "backend"}
"""The EngineConfig field that names each group's plug-in (its default is the group's default)."""


def cmd_plugins(args: argparse.Namespace) -> int:
    """Every group's installed plug-ins: what `--eviction`, `--prefetch`, `--lookahead`, `--cpu-experts` and the
    bench's `--system` can name, where each comes from, and which SPECTER_PLUGINS hides."""
    from specter import plugins
    from specter.config import EngineConfig

    listing = {}
    for group, field in PLUGIN_DEFAULTS.items():
        default = EngineConfig.model_fields[field].default
        rows = []
        for name, entry_point in sorted(plugins.installed(group).items()):
            origin = plugins.PluginOrigin.of(group, entry_point)
            rows.append({"name": name, "dist": origin.dist, "version": origin.version, "object": entry_point.value,
                         "default": name == default, "allowed": plugins.is_allowed(group, name)})
        listing[plugins.GROUP_PREFIX + group] = {"default": default, "plugins": rows}
    if args.json:
        _out(json.dumps({"allow_list": os.environ.get(plugins.ALLOW_LIST_ENV), "groups": listing}, indent=1) + "\n")
        return 0
    lines = []
    for group, entry in listing.items():
        lines.append(f"{group} (default: {entry['default']})")
        width = max((len(row["name"]) for row in entry["plugins"]), default=0)
        for row in entry["plugins"]:
            marks = [mark for mark, on in (("default", row["default"]),
                                           (f"not allowed by {plugins.ALLOW_LIST_ENV}", not row["allowed"])) if on]
            lines.append(f"  {row['name']:<{width}}  {row['dist'] or '?'} {row['version'] or ''}  {row['object']}"
                         + (f"  ({', '.join(marks)})" if marks else ""))
        if not entry["plugins"]:
            lines.append("  (none installed)")
    if allow_list := os.environ.get(plugins.ALLOW_LIST_ENV):
        lines.append(f"{plugins.ALLOW_LIST_ENV}={allow_list}: only the plug-ins it names may load")
    _out("\n".join(lines) + "\n")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from specter.builtin import builtin_note

    summary = checkpoint_summary(args.model, dtype=args.dtype, max_context=args.max_context, quant=args.quant,
                                 residents=args.residents, budget=args.budget, cpu_experts=args.cpu_experts, link=args.link,
                                 cpu_threads=args.cpu_threads, placement_profile=args.placement_profile, measure=args.measure,
                                 tune=args.tune, recalibrate=args.recalibrate, placement_overlap=args.placement_overlap,
                                 k_max=args.k_max)
    if note := builtin_note(args.model):  # after the summary: a bad option is the only line its error prints
        print(note, file=sys.stderr)
    if not summary["tensors_checked"]:
        print(f"note: {summary['path']} holds no tensors: these figures are config.json's alone, unchecked (a load "
              "refuses the directory)", file=sys.stderr)
    if args.json:
        _out(json.dumps(summary) + "\n")
    else:
        _out(_format_info(summary) + "\n")
    return 0


def checkpoint_summary(model: str, dtype: str = "auto", max_context: int | None = None, quant: str = "int4",
                       residents: int | None = None, cpu_experts: str = "off", link: str | None = None,
                       cpu_threads: int | None = None, placement_profile: str | None = None, measure: bool = True,
                       tune: Sequence[str] = (), recalibrate: bool = False, budget: str | None = None,
                       placement_overlap: float | None = None, k_max: int | None = None) -> dict:
    """What `specter info` prints: family, shape, parameter counts, expert bytes, the two budgets, with `budget` the
    expert slots per layer it leaves with the draft and without one (`budget_slots`), and how many experts the
    placement `cpu_experts` computes on the host at `residents` slots per layer (by default the budget's with the
    draft, or without one where the draft does not fit, else top-k; as it places at load); with
    `measure`, one expert's copy and host times (this machine's stored figures unless `recalibrate`, as the builder
    takes them) and what `auto` would do with them; `tune`: tuning overrides (SECTION.FIELD=VALUE, e.g.
    host.parallel_experts=true, which changes how the host is timed); `placement_overlap`: auto's overlap (and
    `cpu_experts`'s, as EngineConfig.placement_overlap)."""
    from specter.builtin import resolve_model
    from specter.config import EngineConfig, TuningConfig
    from specter.build import keeps_expert_graphs, resolve_device, resolve_dtype
    from specter.memory import plan_memory, spread_slots, with_model_context
    from specter.model.checkpoint import Checkpoint
    from specter.model.weights import check_checkpoint, dense_numel

    tuning = TuningConfig().with_overrides(tune)  # a bad override is refused before the checkpoint is read
    path = resolve_model(model)
    checkpoint = Checkpoint(path)
    # What a load would refuse, from the headers: every size below is config.json's, so it must match the files. A
    # config.json beside an empty file (a model not downloaded, planned from its config alone) is not checked, and
    # `tensors_checked` says so (cmd_info: a note).
    checked = bool(checkpoint.index)
    try:
        if checked:
            check_checkpoint(checkpoint)
    finally:
        checkpoint.close()
    spec = checkpoint.spec
    draft = dict(quant=quant) | ({} if k_max is None else {"k_max": k_max})
    config = with_model_context(EngineConfig.build(max_context=max_context, dtype=dtype, draft=draft, link=link,
                                                   cpu_threads=cpu_threads, placement_profile=placement_profile,
                                                   placement_overlap=placement_overlap, tuning=tuning,
                                                   recalibrate=recalibrate), spec)
    torch_dtype = resolve_dtype(config, spec)
    graphs = keeps_expert_graphs(config, spec, resolve_device(config))  # as the engine plans (build_runtime)
    plan = plan_memory(spec, torch_dtype, config, speculative=True, expert_graphs=graphs)
    slots = budget_slots(spec, torch_dtype, config, budget, plan.draft_bytes, graphs) if budget is not None else None
    layer_slots: tuple[int, ...] = ()
    if residents is None and slots is not None:  # the budget's plan, with the extra slots some layers get (as loaded)
        kind = "speculating" if slots["speculating"] else "without_draft"
        residents = slots[kind]
        layer_slots = spread_slots(residents, slots[f"{kind}_extra"], len(spec.moe_layers))
    if slots is not None and slots["speculating"] is None:  # the draft does not fit: placed as the engine without one
        config = config.model_copy(update={"draft": config.draft.model_copy(update={"k": 0, "k_max": 0})})
    dense = dense_numel(spec)
    moe_layers = len(spec.moe_layers)
    return {
        "path": str(path), "family": spec.family, "dtype": str(torch_dtype).removeprefix("torch."),
        "layers": spec.num_layers, "moe_layers": moe_layers, "experts": spec.num_experts, "active_experts": spec.top_k,
        "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
        "parameters": dense + moe_layers * spec.num_experts * spec.expert_numel,
        "active_parameters": dense + moe_layers * spec.top_k * spec.expert_numel,
        "expert_bytes": plan.expert_bytes, "all_expert_bytes": plan.expert_bytes * moe_layers * spec.num_experts,
        "dense_bytes": plan.dense_bytes, "draft_bytes": plan.draft_bytes, "kv_bytes": plan.kv_bytes,
        "max_context": config.max_context, "max_position_embeddings": spec.max_position, "draft_quant": quant,
        "minimum_budget": plan.minimum_budget, "resident_budget": plan.resident_budget, "budget_slots": slots,
        "tensors_checked": checked,
    } | placement_summary(spec, plan.expert_bytes, config, residents, cpu_experts, torch_dtype if measure else None,
                          layer_slots)


def budget_slots(spec: Any, dtype: Any, config: Any, budget: str, draft_bytes: int, expert_graphs: bool | None = None) -> dict:
    """The expert slots per MoE layer `budget` leaves an engine with its draft (`speculating`; None below that plan's
    minimum) and without one (`without_draft`: `--k-max 0`, on-demand offloading, whose slots take the draft's bytes),
    and the draft's bytes: where the draft takes most of a budget, its verify's wider expert sets can cost more link
    time than the draft saves (docs/BENCHMARKS.md, Qwen3-30B-A3B at 24 GiB). A budget below both minimums is refused
    with `plan_memory`'s message."""
    from specter.config import parse_bytes
    from specter.errors import BudgetError, ConfigError
    from specter.memory import plan_memory

    try:
        sized = config.model_copy(update={"budget": parse_bytes(budget)})
    except ValueError as error:
        raise ConfigError(f"--budget: {error}") from None
    try:
        speculating, why = plan_memory(spec, dtype, sized, speculative=True, expert_graphs=expert_graphs), None
    except BudgetError as error:
        speculating, why = None, error
    try:
        plain = plan_memory(spec, dtype, sized, speculative=False, expert_graphs=expert_graphs)
    except BudgetError as error:  # below both minimums: the message with the draft's bytes names every way out
        raise (why or error) from None
    return {"budget": sized.budget, "experts": spec.num_experts, "moe_layers": plain.moe_layers,
            "speculating": None if speculating is None else speculating.slots_per_layer,
            "speculating_extra": None if speculating is None else speculating.extra_slots,
            "without_draft": plain.slots_per_layer, "without_draft_extra": plain.extra_slots, "draft_bytes": draft_bytes,
            "speculating_refused": None if why is None else str(why),
            # what the budget leaves beyond the slots (less than one), and the budget of one slot more
            "speculating_idle_bytes": None if speculating is None else speculating.idle_bytes,
            "speculating_next_budget": None if speculating is None else speculating.next_slot_budget,
            "without_draft_idle_bytes": plain.idle_bytes, "without_draft_next_budget": plain.next_slot_budget}


def placement_summary(spec: Any, expert_bytes: int, config: Any, residents: int | None, cpu_experts: str,
                      measure_dtype: Any = None, layer_slots: tuple[int, ...] = ()) -> dict:
    """The host-expert count of placement `cpu_experts` for an engine with `residents` slots per layer, placed as the
    builder places at load (an empty cache); with `measure_dtype`, the costs measured as the builder calibrates them
    (one expert of the model's shape in that dtype, random values) and `auto`'s decisions and predicted times."""
    from specter.experts.costs import routing_profile
    from specter.build import placement_policy, speculation
    from specter.experts.host import default_threads
    from specter.placement import (OVERLAP, Placement, PlacementState, check_slot_count, copy_seconds, host_seconds,
                                   routing_source, token_seconds)
    from specter.plugins import is_allowed

    layers, experts = len(spec.moe_layers), spec.num_experts
    slots = residents if residents is not None else spec.top_k
    if layers:
        check_slot_count("--residents", slots, spec.top_k, experts)
    else:  # no expert to place: --residents caps nothing, as at load (memory._slots)
        slots = min(max(slots, spec.top_k), experts)
    if measure_dtype is not None:
        host_s, link, source, host_source, host_kernel, job_s = measured_costs(spec, config, measure_dtype)
    else:
        from specter.config import parse_link

        gbps = parse_link(config.link)
        host_s, link, source = None, gbps * 1e9 if gbps is not None else None, "emulated" if gbps is not None else None
        host_source = host_kernel = job_s = None
    profile = config.placement_profile
    counts, sequence = routing_profile(profile, layers, experts) if profile is not None else (None, None)
    state = PlacementState(num_layers=layers, num_experts=experts, top_k=spec.top_k, slots_per_layer=slots,
                           layer_slots=layer_slots if len(set(layer_slots)) > 1 else (),
                           initial_residents=tuple(() for _ in range(layers)), expert_bytes=expert_bytes,
                           row_bucket=config.row_bucket, host_threads=config.cpu_threads or default_threads(),
                           link_bytes_per_s=link, host_expert_s={config.row_bucket: host_s} if host_s is not None else {},
                           host_job_s=job_s, route_counts=counts, route_sequence=sequence, **speculation(config))
    def policy(name: str) -> Any:  # as the builder loads it: EngineConfig.placement_overlap goes to auto and cpu_experts
        overlap = config.placement_overlap if name in ("auto", cpu_experts) else None
        return placement_policy(config.model_copy(update={"cpu_experts": name, "placement_overlap": overlap}))

    # `all` and `auto` are shown beside the one asked for, where SPECTER_PLUGINS lets them load (the one asked for
    # must: its refusal is the user's answer); an allow-list without them leaves their figures out, not info failing.
    shown = [name for name in dict.fromkeys(("all", "auto", cpu_experts))
             if name != "off" and (name == cpu_experts or is_allowed("placement", name))]
    policies = {name: policy(name) for name in shown}
    placed = {"off": Placement.device_only(layers, experts)} | {name: p.place(state=state) for name, p in policies.items()}
    placement, auto = placed[cpu_experts], placed.get("auto")
    overlap = getattr(policies["auto"], "overlap", OVERLAP) if auto is not None else None
    ms = lambda seconds: None if seconds is None else round(seconds * 1e3, 4)  # noqa: E731
    return {"cpu_experts": cpu_experts, "placement_slots": slots, "host_experts": placement.total,
            "host_experts_per_layer": placement.counts(), "host_threads": state.host_threads, "row_bucket": state.row_bucket,
            "link_gbps": None if link is None else round(link / 1e9, 3), "link_source": source,
            "copy_ms_per_expert": ms(copy_seconds(state)), "host_ms_per_expert": ms(host_seconds(state, 1)),
            "host_ms_per_job": ms(job_s),
            "host_source": host_source, "host_kernel": host_kernel,
            "auto_host_experts": None if auto is None else auto.total,
            "auto_host_experts_per_layer": None if auto is None else auto.counts(),
            "routing": routing_source(state), "speculates": state.speculates,
            "auto_prices_misses": None if auto is None else getattr(policies["auto"], "prices_misses", lambda state: True)(state),
            "auto_overlap": overlap, "self_profile_tokens": config.self_profile_tokens,
            "predicted_ms_per_token": {name: ms(token_seconds(state, placed[name], overlap=OVERLAP if overlap is None else overlap))
                                       for name in ("off", "all", "auto") if name in placed}}


def measured_costs(spec: Any, config: Any, dtype: Any) -> tuple[float, float | None, str | None, str, str, float | None]:
    """(host seconds of one expert on a block of row_bucket rows, link bytes per second, where the link figure comes
    from: 'emulated', 'measured', 'stored' or None, where the host figure comes from: 'measured' or 'stored', the host
    kernel it is for, a host job's fixed seconds beside it or None): the builder's own calibration (`costs.calibrate`, with this machine's stored figures unless
    `config.recalibrate`, storing what it measures) on random experts of the model's shape, so the pinned pool holds
    (REPEATS + 1) x top_k experts per kernel, and REPEATS + 1 for the jobs of one expert, for the while where the host is timed. They are written just before, so
    where the last-level cache holds several of them the figure can read lower than the engine's, whose pool was
    written at load."""
    import asyncio

    import torch

    from specter.config import parse_link
    from specter.experts import costs
    from specter.experts.host import default_threads
    from specter.experts.pool import ExpertPool
    from specter.kernel import Kernel
    from specter.placement import PlacementState

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    threads = config.cpu_threads or default_threads()
    parallel = config.tuning.host.parallel_experts
    per_job = costs.experts_per_job(spec.top_k, parallel)
    kernels = costs.host_kernels(config.tuning.host.kernel, costs.reference_expert(spec.hidden_size, spec.expert_intermediate),
                                 spec.hidden_size, spec.expert_intermediate, dtype)
    element = torch.empty((), dtype=dtype).element_size()
    store = costs.default_cost_store()
    key = costs.cost_key(spec.expert_numel * element, dtype, spec.hidden_size, config.row_bucket, threads, per_job,
                         parallel, device, [kernel.name for kernel in kernels])
    stored = costs.stored_costs(store, key, kernels, config.recalibrate)[1]  # what the calibration will take
    gbps = parse_link(config.link)
    host_source = "stored" if "host_expert_s" in stored else "measured"
    link_source = "emulated" if gbps is not None else "stored" if stored.get("link_bytes_per_s") else None

    class Memory:
        def alloc_host(self, numel: int, dtype: Any) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, pin_memory=cuda)

    timed = host_source == "measured"
    experts = (costs.REPEATS + 1) * (per_job * len(kernels) + (per_job > 1))  # cold: each job on experts no other read
    pool = ExpertPool(Memory(), 1, experts if timed else 1, spec.expert_numel, dtype)
    for expert in range(pool.num_experts):  # a link is timed on any bytes: random ones only where the host computes
        weights = torch.empty(spec.expert_numel, dtype=dtype)
        pool.write(0, expert, weights.normal_(std=0.02) if timed else weights)
    state = PlacementState(num_layers=1, num_experts=pool.num_experts, top_k=spec.top_k, slots_per_layer=1,
                           initial_residents=((),), expert_bytes=pool.expert_bytes, row_bucket=config.row_bucket,
                           host_threads=threads, link_bytes_per_s=None if gbps is None else gbps * 1e9)

    async def calibrated() -> costs.Calibration:
        with Kernel() as kernel:
            return await costs.calibrate(kernel, pool, kernels, state, spec.hidden_size, device, parallel=parallel,
                                         store=store, fresh=config.recalibrate)

    calibration = asyncio.run(calibrated())
    link = state.link_bytes_per_s or calibration.link_bytes_per_s
    if link_source is None and link:
        link_source = "measured"
    return (calibration.host_expert_s[config.row_bucket], link, link_source, host_source, calibration.host_kernel,
            calibration.host_job_s)


def _format_info(summary: dict) -> str:
    from specter.memory import fmt

    rows = [
        ("checkpoint", summary["path"]),
        ("family", f"{summary['family']} ({summary['dtype']})"),
        ("layers", f"{summary['layers']} ({summary['moe_layers']} MoE), {summary['experts']} experts, "
                   f"{summary['active_experts']} active per token"),
        ("parameters", f"{_count(summary['parameters'])} total, {_count(summary['active_parameters'])} active per token"),
        ("expert bytes", f"{fmt(summary['expert_bytes'])} each, {fmt(summary['all_expert_bytes'])} all"),
        ("fixed bytes", f"non-expert {fmt(summary['dense_bytes'])}, draft ({summary['draft_quant']}) {fmt(summary['draft_bytes'])}, "
                        f"KV for {summary['max_context']} tokens {fmt(summary['kv_bytes'])}"),
        ("minimum budget", fmt(summary["minimum_budget"], round_up=True)),  # as printed, a budget that suffices
        ("full residency", fmt(summary["resident_budget"], round_up=True)),
        *([("at budget", _budget_line(summary["budget_slots"]))] if summary.get("budget_slots") else []),
        ("host experts", f"{summary['host_experts']} of {summary['moe_layers'] * summary['experts']} "
                         f"(--cpu-experts {summary['cpu_experts']}, {summary['placement_slots']} slots per layer)"),
        ("expert costs", _costs_line(summary)),
        ("auto would", _auto_line(summary)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _budget_line(slots: dict) -> str:
    from specter.memory import fmt

    def count(kind: str) -> str:
        per, extra = slots[kind], slots[f"{kind}_extra"]
        if per >= slots["experts"]:
            return f"all {per} resident"
        return f"{per}" + (f" ({per + 1} in {extra} of {slots['moe_layers']} layers)" if extra else "")

    def spare(kind: str) -> str:  # "; " + the budget beyond the slots and the budget of one slot more
        nxt = slots[f"{kind}_next_budget"]
        return "" if nxt is None else f"; {fmt(slots[f'{kind}_idle_bytes'])} idle, {fmt(nxt, round_up=True)} for one slot more"

    plain = f"{count('without_draft')} without a draft (--k-max 0: on-demand offloading{spare('without_draft')})"
    if slots["speculating"] is None:
        return f"{fmt(slots['budget'])}: below the minimum with the draft; expert slots per layer {plain}"
    return (f"{fmt(slots['budget'])}: expert slots per layer {count('speculating')} speculating (the draft "
            f"takes {fmt(slots['draft_bytes'])}{spare('speculating')}), {plain}")


def _costs_line(summary: dict) -> str:
    copy, host = summary["copy_ms_per_expert"], summary["host_ms_per_expert"]
    link = ("link not measured (the CPU: give --link)" if copy is None
            else f"copy {copy:.3f} ms ({summary['link_source']} link, {summary['link_gbps']} GB/s)")
    compute = ("host not measured" if host is None else
               f"host {host:.3f} ms per block of {summary['row_bucket']} rows"
               + (f" and {summary['host_ms_per_job']:.3f} ms per job" if summary.get("host_ms_per_job") is not None else "")
               + f" ({summary.get('host_kernel') or 'torch'} kernel, {summary['host_threads']} threads, "
               f"{summary.get('host_source') or 'measured'})")
    return f"{link}; {compute}"


def _auto_line(summary: dict) -> str:
    if summary["auto_host_experts"] is None:
        return "auto not shown: SPECTER_PLUGINS does not allow the placement 'auto'"
    predicted = summary["predicted_ms_per_token"]
    times = ", ".join(f"{name} {'-' if ms is None else f'{ms:.3f}'}" for name, ms in predicted.items())
    per_layer = summary["auto_host_experts_per_layer"]
    spread = (f"{per_layer[0]} per layer" if len(set(per_layer)) == 1 else f"per layer {', '.join(map(str, per_layer))}")
    own = summary.get("self_profile_tokens") or 0
    why = ("" if summary.get("auto_prices_misses", True) else
           f"; this engine speculates and has no routing trace to price its misses: where the link is measured (CUDA, "
           f"or --link) it decodes {own} tokens of the model's own text at load to record one and places from that, so "
           "what it places is known only then (pass --placement-profile TRACE, a `generate --trace` of your text, to "
           "see it here)" if own else
           "; this engine speculates and has no routing trace to price its misses, so auto keeps every expert on the "
           "device (pass --placement-profile TRACE, a `generate --trace` of your text)")
    overlap = summary.get("auto_overlap")
    return (f"{summary['auto_host_experts']} host experts ({spread}); predicted expert ms per token: {times} "
            f"({summary['routing']} routing{f', overlap {overlap:g}' if overlap else ''}){why}")  # (auto's default 0: unsaid)


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
