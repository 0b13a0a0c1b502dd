"""The measurement protocol (benchmarks/README.md): same prompts, same budget, same initial cache, every system.

Per model: the resident run gives the target-only baseline tokens; one offloaded runtime then serves every
offloaded system, memory setting and link (slots and link are switched, weights are loaded once). Per
system: a warm-up request (excluded), then each prompt x repeat from the same restored cache state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from specter.config import DraftConfig, EngineConfig, GenerationConfig, TuningConfig, parse_link
from specter.engine import CheckpointWeights, WeightSource
from specter.errors import BudgetError, CheckpointError, MemoryShortError, PluginError, SpecterError
from specter.experts.cache import CacheSnapshot, CacheStats, LayerStats
from specter.experts.costs import route_profile
from specter.build import resolve_dtype
from specter.log import get_logger
from specter.paths import json_value
from specter.memory import split_slots
from specter.model.checkpoint import Checkpoint
from specter.model.spec import ModelSpec
from specter.bench.report import CELL_FIELDS
from specter.bench.stopping import Stopper
from specter.bench.widen import WidenedCheckpoint
from specter.bench.systems import (SCHEDULE_SOURCE, SYSTEMS, BenchRuntime, Routes, Setting, System, decode_floor_loads,
                                   initial_state, memory_summary, system_slots)

log = get_logger(__name__)

PROMPT_TOKENS = 16
DESKTOP_LINK = "ddr4-desktop"
"""The link preset of a desktop, whose cells give the host expert path `Options.desktop_threads` threads."""
SAMPLING_MODES: dict[str, dict[str, float]] = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
"""How a request picks its tokens (issue 28 item 3): greedy, or seeded sampling as chat users run it. A sampled request's
seed is fixed by its prompt (`Prompt.seed`), so its baseline, run with the same parameters and seed, is comparable."""


@dataclasses.dataclass
class Prompt:
    kind: str
    index: int
    ids: list[int]
    sampling: str = "greedy"
    """A key of SAMPLING_MODES: how this request picks its tokens."""

    @property
    def key(self) -> tuple[str, str, int]:
        """What a request's baseline tokens and recorded routes are filed under: the same tokens for the same key."""
        return (self.sampling, self.kind, self.index)

    @property
    def seed(self) -> int:
        """The sampling seed of this prompt: fixed by kind and index, the same for every system and repeat."""
        return zlib.crc32(f"{self.kind}:{self.index}".encode()) % 2**31

    def generation(self, max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, seed=self.seed, **SAMPLING_MODES[self.sampling])


@dataclasses.dataclass
class ModelTarget:
    """One model of the matrix: how to make its weights, its full-depth spec, prompts and settings."""

    label: str
    make_source: Callable[[], WeightSource]
    spec: ModelSpec
    full_spec: ModelSpec
    prompts: list[Prompt]
    warmup: Prompt
    settings: list[Setting]
    path: Path | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    widen: int | None = None
    """F: the checkpoint at `path` is narrow and runs as its model widened F times (WidenedCheckpoint, bf16); None: as
    it is."""


@dataclasses.dataclass
class Options:
    """The protocol's knobs (the CLI fills them)."""

    systems: list[str]
    links: list[str]
    max_new_tokens: int = 128
    warmup_tokens: int = 32
    repeats: int = 1
    k: int = 4
    k_max: int = 15
    row_bucket: int = 16
    """EngineConfig.row_bucket of every system (the exact row block; the static verify's rows per pass)."""
    device: str = "auto"
    dtype: str = "auto"
    progress: bool = True
    hf: bool = True
    static_verify: bool | None = None
    quant: str = "int4"
    """The draft's expert format (DraftConfig.quant) for every speculative system."""
    tuning: TuningConfig = dataclasses.field(default_factory=TuningConfig)
    """EngineConfig.tuning of every system (`--tune SECTION.FIELD=VALUE`, `--copy-gaps`)."""
    sampling: list[str] = dataclasses.field(default_factory=lambda: ["greedy"])
    """Keys of SAMPLING_MODES: every prompt runs once per mode, held to a baseline run in the same mode."""
    desktop_threads: int = 8
    """Torch threads of the host expert path in cells at DESKTOP_LINK (a desktop CPU has about 8 cores; the GPU
    machine's host has more); other cells take the engine's `cpu_threads` default."""
    threads: int | None = None
    """EngineConfig.threads of every runtime (torch's intra-op threads of the process; None: the engine's default)."""
    placement_overlap: float | None = None
    """`Auto(overlap=...)` for every cell that places with `auto` (`--placement-overlap`; None: auto's default)."""
    placement_profile: Path | None = None
    """EngineConfig.placement_profile of every engine (`--placement-profile`): the routing trace `auto` places from
    (None: a speculating system's, the engine's own, `self_profile_tokens`; a plain one's, uniform routing)."""
    self_profile_tokens: int = EngineConfig.model_fields["self_profile_tokens"].default
    """EngineConfig.self_profile_tokens of every engine (`--self-profile-tokens`): without a placement profile, the
    tokens of its own text a runtime decodes, once, to record the routing trace `auto` prices a speculating system's
    placement from (`BenchRuntime.own_profile`); 0: none, and `auto` places such a system off."""
    custom: dict[str, System] = dataclasses.field(default_factory=dict)
    """The run's own systems by name (`--system NAME:KEY=VALUE,...`: installed plug-ins), beside SYSTEMS."""

    def system(self, name: str) -> System:
        """The system `name` of this run: a built-in one or its own."""
        return self.custom[name] if name in self.custom else SYSTEMS[name]


class Clock:
    """The run's time budget, shared out between models so every model gets some results."""

    def __init__(self, budget_s: float | None) -> None:
        self.deadline = time.monotonic() + budget_s if budget_s is not None else None  # the CLI refuses budgets <= 0

    def model_deadline(self, models_left: int) -> float | None:
        if self.deadline is None:
            return None
        return time.monotonic() + max(0.0, self.deadline - time.monotonic()) / max(1, models_left)

    @staticmethod
    def fits(deadline: float | None, expected_s: float) -> bool:
        return deadline is None or time.monotonic() + expected_s <= deadline


CellKey = tuple[str, str, str, str]
"""(model, setting, link, system): one cell of the matrix, as its status in results.json's `cells` names it."""


def planned_cells(target: ModelTarget, options: Options) -> dict[str, list[CellKey]]:
    """The cells the matrix will run for `target`, by part ('resident', 'offloaded', 'hf'), in the order it runs them:
    what a partial results.json lists as still to run."""
    systems = [options.system(name) for name in options.systems]
    parts: dict[str, list[CellKey]] = {"resident": [], "offloaded": [], "hf": []}
    if any(system.resident for system in systems):
        parts["resident"].append((target.label, "all", "-", "resident"))
    parts["offloaded"] = [(target.label, setting.label, link, system.name) for link in options.links
                          for setting in target.settings for system in systems if not system.resident]
    if options.hf and target.path is not None and target.widen is None and options.max_new_tokens >= 2:
        from specter.bench.hf_baseline import unavailable_reason

        if unavailable_reason() is None:  # else run_hf skips it with a note
            parts["hf"] = [(target.label, setting.label, "native", "hf-accelerate") for setting in target.settings
                           if setting.residents is not None or setting.budget is not None]
    return parts


@dataclasses.dataclass
class Progress:
    """The matrix so far, handed to `bench_models`' `on_cell` after every cell that ended (ran or was skipped): the
    records of whole cells only (an abandoned cell leaves none), every cell's status, and the planned cells that
    have not ended, in order."""

    records: list[dict[str, Any]]
    cells: list[dict[str, Any]]
    remaining: list[dict[str, str]]


# ---- prompts --------------------------------------------------------------------------------------------

def synthetic_prompts(vocab_size: int, per_kind: int, seed: int = 0) -> list[Prompt]:
    """16-token prompts from several seeded distributions: uniform ids, Zipf-skewed ids, a repeated motif."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab_size + 1)
    zipf = 1.0 / ranks**1.1
    permutation = rng.permutation(vocab_size)
    prompts = []
    for index in range(per_kind):
        uniform = rng.integers(0, vocab_size, PROMPT_TOKENS)
        skewed = permutation[rng.choice(vocab_size, PROMPT_TOKENS, p=zipf / zipf.sum())]
        motif = np.tile(rng.integers(0, vocab_size, 4), PROMPT_TOKENS // 4)
        for kind, ids in (("uniform", uniform), ("zipf", skewed), ("motif", motif)):
            prompts.append(Prompt(kind, index, [int(t) for t in ids]))
    return prompts


def bench_context(options: Options) -> int:
    """The context (tokens) every engine of the bench plans for: a prompt, the longer of a request and the warm-up, the
    deepest draft's tokens past the last one kept, and 8 of slack."""
    return PROMPT_TOKENS + max(options.max_new_tokens, options.warmup_tokens) + options.k_max + 8


def checkpoint_prompts(path: Path, vocab_size: int, per_kind: int) -> list[Prompt]:
    """The reference model's held-out corpus snippets (prompts.json) when present, else synthetic ones."""
    kinds = listed_prompts(path)
    if kinds is None:
        return synthetic_prompts(vocab_size, per_kind)
    return [Prompt(kind, i, ids[:PROMPT_TOKENS]) for kind, snippets in kinds.items()
            for i, ids in enumerate(snippets[:per_kind])]


def listed_prompts(path: Path) -> dict[str, list[list[int]]] | None:
    """prompts.json's token-id snippets by kind (benchmarks/reference_model.py writes it beside its checkpoint), or
    None without the file; a malformed one is a CheckpointError naming it (it was a traceback)."""
    return token_lists(path / "prompts.json", "kinds", "{\"kinds\": {KIND: [[token ids], ...]}}", named=True)


def token_lists(file: Path, key: str, shape: str, named: bool = False) -> Any:
    """`key`'s value in the JSON object of `file`: a list of token-id lists, or with `named` a mapping of names to
    such lists; None without the file."""
    if not file.is_file():
        return None
    try:
        value = json_value(file.read_text())[key]
        if not isinstance(value, dict if named else list):
            raise ValueError(f"'{key}' is a {type(value).__name__}")
        groups = value.values() if named else [value]
        if not all(isinstance(group, list) and all(_ids(ids) for ids in group) for group in groups):
            raise ValueError("every entry must be a list of token ids (integers >= 0)")
    except OSError as error:
        raise CheckpointError(f"{file}: cannot be read ({error.strerror or error}); fix or remove the file") from None
    except (ValueError, KeyError, TypeError) as error:
        detail = f"no {error}" if isinstance(error, KeyError) else str(error) or type(error).__name__
        raise CheckpointError(f"{file}: expected {shape} ({detail}); fix or remove the file") from None
    return value


def _ids(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)


def warmup_prompt(vocab_size: int) -> Prompt:
    ids = np.random.default_rng(12345).integers(0, vocab_size, PROMPT_TOKENS)
    return Prompt("warmup", 0, [int(t) for t in ids])


def checkpoint_target(path: Path, settings: list[Setting], per_kind: int, widen: int | None = None, device: str = "cpu") -> ModelTarget:
    """The checkpoint at `path`; with `widen` = F, as its model widened F times in bf16, each tensor widened as the
    loader reads it (no wide copy on disk), labelled 'NAME xF'; prompts from the narrow checkpoint's files."""
    def open_checkpoint() -> Checkpoint | WidenedCheckpoint:
        return Checkpoint(path) if widen is None else WidenedCheckpoint(path, widen, torch.bfloat16, device)

    checkpoint = open_checkpoint()
    spec = checkpoint.spec
    checkpoint.close()
    return ModelTarget(label=path.name if widen is None else f"{path.name} x{widen}",
                       make_source=lambda: CheckpointWeights(open_checkpoint()), spec=spec, full_spec=spec,
                       prompts=checkpoint_prompts(path, spec.vocab_size, per_kind), warmup=warmup_prompt(spec.vocab_size),
                       settings=settings, path=path, widen=widen)


# ---- one model ------------------------------------------------------------------------------------------

class ModelBench:
    """Runs every cell (setting x link x system) of one model and collects one record per request."""

    def __init__(self, target: ModelTarget, options: Options, deadline: float | None) -> None:
        self.target, self.options, self.deadline = target, options, deadline
        self.systems = [options.system(name) for name in options.systems]
        self.records: list[dict[str, Any]] = []
        """One per measured request, of cells that ended: a cell's records are added when its last request ends."""
        self.cells: list[dict[str, Any]] = []
        self.planned = planned_cells(target, options)
        self.ended: set[CellKey] = set()
        """Planned cells that ran or were skipped (with a status in `cells` or a note)."""
        self.on_cell: Callable[[], None] | None = None
        """Called after every cell that ended (`bench_models` writes the results so far)."""
        self.first_cell_s = 0.0
        """What the time budget expects of a cell before one has run: each part's untimed baseline pass over every
        request (the cell's own requests at k = 0), times the repeats; see `expected_cell_s`."""
        self.first_cell_bytes = 0
        """The offloaded baseline pass's host-to-device bytes, times the repeats: it ran on the real link, so a cell on
        a slower emulated one is expected to take at least these bytes' time there."""
        self.baseline: dict[tuple[str, str, int], list[int]] = {}  # Prompt.key -> tokens: resident, k = 0
        self.offloaded_baseline: dict[tuple[str, str, int], list[int]] = {}  # offloaded, k = 0 (ondemand)
        self.placed_baseline: dict[tuple, list[int]] = {}
        """(setting, link, the placement's host sets, Prompt.key) -> tokens of that placement's k = 0 run from the
        cell's start."""
        self.placed: tuple[frozenset[int], ...] = ()  # the running cell's placement (its host sets; () for off)
        self._route_counts: list[list[float]] | None = None  # the placement profile's use counts (`_use_counts`)
        self.routes: dict[tuple[int, str, str, int], Routes] = {}
        self.schedules: dict[tuple[str, str, str, str, int], tuple[list[int], Routes]] = {}
        """(setting, link, *Prompt.key) -> the specter run's depth per round and verify routes."""
        self.requests = [dataclasses.replace(prompt, sampling=mode) for prompt in target.prompts for mode in options.sampling]
        """Every prompt in every sampling mode: what each cell runs (times the repeats)."""
        self.dtype = resolve_dtype(EngineConfig(dtype=options.dtype), target.spec)
        self.max_context = bench_context(options)
        self.cell_seconds: list[float] = []
        self.cell_bytes: list[int] = []  # each finished cell's host-to-device bytes (its measured requests)
        cells = len(self.planned["resident"]) + len(self.planned["offloaded"])  # the cells `_cell` counts off
        self.bar = tqdm(total=cells, desc=target.label, disable=not options.progress, unit="cell", leave=False)

    def generation(self, warm: bool = False, prompt: Prompt | None = None) -> GenerationConfig:
        """The warm-up is greedy; a measured request picks its tokens as its prompt's sampling mode says."""
        if warm or prompt is None:
            return GenerationConfig(max_new_tokens=self.options.warmup_tokens if warm else self.options.max_new_tokens)
        return prompt.generation(self.options.max_new_tokens)

    def engine_config(self, *, resident: bool, speculative: bool) -> EngineConfig:
        k_max = self.options.k_max if speculative else 0
        residents = None if resident else self.target.spec.top_k
        # The build's fixed depth decides only whether the runtime gets a draft (each system sets its own depth in
        # `configure`): at --k 0 it would get none, and specter, whose depth is the roofline's, could not run.
        k = max(self.options.k, 1) if speculative else 0
        return EngineConfig(device=self.options.device, dtype=self.options.dtype, residents=residents, max_context=self.max_context,
                            threads=self.options.threads,
                            draft=DraftConfig(k=k, k_max=k_max, quant=self.options.quant),
                            lookahead="fixed", row_bucket=self.options.row_bucket,
                            progress=self.options.progress, static_verify=self.options.static_verify,
                            tuning=self.options.tuning, placement_profile=self.options.placement_profile,
                            self_profile_tokens=self.options.self_profile_tokens)

    async def run(self) -> None:
        try:
            if any(system.resident for system in self.systems):
                await self._guarded("resident", self._run_resident)
            offloaded = [system for system in self.systems if not system.resident]
            if offloaded:
                await self._guarded("offloaded", lambda: self._run_offloaded(offloaded))
        finally:
            self.bar.close()

    def _ended(self, *keys: CellKey) -> None:
        """These planned cells ran or were skipped: tell `on_cell`."""
        self.ended.update(keys)
        if self.on_cell is not None:
            self.on_cell()

    async def _guarded(self, part: str, work) -> None:
        """A model part that cannot run here (too big, family missing) is noted, and the matrix goes on. A part is not
        loaded once its time is up (a load takes minutes at full depth): its cells are skipped for the time budget."""
        if not Clock.fits(self.deadline, 0.0):
            for model, setting, link, system in self.planned[part]:
                self.cells.append({"model": model, "setting": setting, "link": link, "system": system, "slots": None,
                                   "note": f"{part} part not loaded: its time was up", "host_threads": None,
                                   "status": "skipped: time budget"})
            self._ended(*self.planned[part])
            return
        try:
            await work()
        except (SpecterError, torch.cuda.OutOfMemoryError, MemoryError) as error:
            note = f"{self.target.label}: {part} part skipped: {self._in_bench_words(error)}"
            log.warning("bench.skipped", model=self.target.label, part=part, error=str(error))
            self.target.notes.append(note)
            self._ended(*self.planned[part])
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _in_bench_words(self, error: BaseException) -> str:
        """The engine's message with the bench's remedy where the engine's names options the bench does not have
        (--max-context: the bench sizes the context from --max-new-tokens; --residents and --budget do not shrink the
        host pool, nor the resident part)."""
        if not isinstance(error, MemoryShortError):
            return str(error)
        smaller = ("truncate the shape with --layers N (each layer's experts take memory)" if self.target.path is None
                   else "bench a smaller model, or on a machine with more memory")
        return f"{error.shortfall}; {smaller}, or lower --max-new-tokens (the KV cache and workspace grow with it)"

    # -- resident: the ceiling and the baseline tokens ------------------------------------------------------
    async def _run_resident(self) -> None:
        runtime = await BenchRuntime.build(self.target.make_source(), self.engine_config(resident=True, speculative=False))
        try:
            system = SYSTEMS["resident"]
            runtime.configure(system, 0)
            started = time.monotonic()
            for prompt in self.requests:
                self.baseline[prompt.key] = (await runtime.complete_ids(prompt.ids, self.generation(prompt=prompt))).tokens
            self._expect_first_cell(time.monotonic() - started)
            await self._cell(runtime, system, Setting(), "-", slots=None, initial=None)
        finally:
            await runtime.aclose()

    # -- offloaded systems: one runtime, switched between systems, settings and links --------------------------
    async def _run_offloaded(self, systems: list[System]) -> None:
        speculative = any(system.speculative for system in systems)
        runtime = await BenchRuntime.build(self.target.make_source(), self.engine_config(resident=False, speculative=speculative))
        try:
            self.memory = memory_summary(runtime.memory)
            # The offloaded systems' own baseline: the same engine with speculation off (the exactness contract). On CUDA
            # the resident run replays a graphed static step whose rounding differs from the eager offloaded path,
            # so offloaded tokens are held to this baseline and its agreement with the resident one is reported.
            await self._baseline_on(runtime)
            for depth in sorted({self._depth(system) for system in systems if system.exact_prefetch and not system.replay_schedule}):
                await self._record_routes(runtime, depth)
            for link in self.options.links:
                for setting in self.target.settings:
                    await self._setting(runtime, systems, setting, link)
        finally:
            await runtime.aclose()

    async def _baseline_on(self, runtime: BenchRuntime) -> None:
        """The target alone on the offloaded runtime (k=0, on demand): the offloaded systems' baseline tokens."""
        runtime.configure(SYSTEMS["ondemand"], 0)
        started, moved = time.monotonic(), 0
        for prompt in self.requests:
            key = prompt.key
            result = await runtime.complete_ids(prompt.ids, self.generation(prompt=prompt))
            self.offloaded_baseline[key], moved = result.tokens, moved + result.stats.h2d_bytes
            if key in self.baseline and self.baseline[key] != self.offloaded_baseline[key]:
                self.target.notes.append(f"prompt {key}: the resident (graphed) and offloaded (eager) baselines differ in "
                                         "rounding and here in tokens; offloaded systems are compared with the offloaded one")
        self._expect_first_cell(time.monotonic() - started, moved)

    def _expect_first_cell(self, pass_s: float, moved: int = 0) -> None:
        """A part's baseline pass took `pass_s` and copied `moved` bytes: a cell runs the same requests `repeats` times
        (and a warm-up)."""
        self.first_cell_s = max(self.first_cell_s, pass_s * self.options.repeats)
        self.first_cell_bytes = max(self.first_cell_bytes, moved * self.options.repeats)

    def expected_cell_s(self, link: str) -> float:
        """What the time budget expects the next cell at `link` to take: the longest cell so far; before any has run,
        the part's baseline pass (`first_cell_s`). The untimed passes ran on the real link and the cells so far may
        have run on a faster one, so on an emulated link a cell is also expected to take at least the most bytes a
        pass or cell copied, at that link's speed (on a slow link, most of a cell)."""
        expected, moved = ((max(self.cell_seconds), max(self.cell_bytes)) if self.cell_seconds
                           else (self.first_cell_s, self.first_cell_bytes))
        gbps = parse_link(link) if link not in ("native", "-") else None
        return expected if gbps is None else max(expected, moved / (gbps * 1e9))

    def _depth(self, system: System) -> int:
        return system.k if system.k is not None else self.options.k

    async def _record_routes(self, runtime: BenchRuntime, depth: int) -> None:
        """exact-prefetch's future: each prompt's verify routes at depth k, recorded in an untimed pass."""
        runtime.configure(dataclasses.replace(SYSTEMS["exact-prefetch"], exact_prefetch=False, eviction="lru", k=depth), self.options.k)
        for prompt, warm in [(self.target.warmup, True)] + [(p, False) for p in self.requests]:
            recorded = runtime.record_routes()
            await runtime.complete_ids(prompt.ids, self.generation(warm, prompt))
            self.routes[(depth, *prompt.key)] = list(recorded)

    async def _setting(self, runtime: BenchRuntime, systems: list[System], setting: Setting, link: str) -> None:
        slots = {}
        for system in systems:
            try:
                slots[system.name] = system_slots(system, setting, runtime.spec, self.target.full_spec, self.dtype, self.max_context,
                                                  self.options.k_max, expert_graphs=runtime.segmented is not None,
                                                  quant=self.options.quant, row_bucket=self.options.row_bucket)
            except BudgetError as error:
                self.target.notes.append(f"{self.target.label} {setting.label} link={link}: {system.name} skipped: {error}")
                self._ended((self.target.label, setting.label, link, system.name))
        if not slots:
            return
        if not Clock.fits(self.deadline, self.expected_cell_s(link)):  # not even the cells' common start (a warm-up
            for system in systems:  # on the emulated link) is run for cells that would not fit
                if system.name in slots:
                    count, note = slots[system.name]
                    await self._guarded_cell(runtime, system, setting, link, slots=count, initial=None, note=note)
            return
        most = tuple(max(counts) for counts in zip(*(counts for counts, _ in slots.values())))  # per layer
        initial = await self._initial_state(runtime, most, link)
        for system in systems:
            if system.name in slots:
                count, note = slots[system.name]
                await self._guarded_cell(runtime, system, setting, link, slots=count, initial=initial, note=note)

    async def _guarded_cell(self, runtime: BenchRuntime, system: System, setting: Setting, link: str,
                            slots: tuple[int, ...], initial: tuple[tuple[int, ...], ...] | None, note: str) -> None:
        """`_cell`, whose plug-in failure (a policy that raised or answered wrongly, or one SPECTER_PLUGINS does not
        allow) fails that cell alone: the engine ended the request and kept its state, so the other systems' cells run
        (one author's policy under test must not cost the baselines beside it). The cell is kept as failed, with why."""
        try:
            await self._cell(runtime, system, setting, link, slots=slots, initial=initial, note=note)
        except PluginError as error:
            fewest, extra = split_slots(slots)
            log.warning("bench.cell_failed", model=self.target.label, setting=setting.label, link=link,
                        system=system.name, error=str(error))
            self.cells.append({"model": self.target.label, "setting": setting.label, "link": link, "system": system.name,
                               "slots": fewest, "extra_slots": extra, "note": note, "host_threads": None,
                               "placement": None, "status": f"failed: {error}"})
            self._ended((self.target.label, setting.label, link, system.name))

    def _use_counts(self, runtime: BenchRuntime) -> list[list[float]] | None:
        """The placement profile's use counts per MoE layer and expert (None without a profile): the starting cache
        fills free slots with the most used, as `auto` keeps them."""
        path = self.options.placement_profile
        if path is None:
            return None
        if self._route_counts is None:  # read once per model: every cell's start fills from the same counts
            self._route_counts = route_profile(path, len(runtime.spec.moe_layers), runtime.spec.num_experts)
        return self._route_counts

    async def _initial_state(self, runtime: BenchRuntime, slots: tuple[int, ...], link: str) -> tuple[tuple[int, ...], ...]:
        """The same start for every system: the LRU cache an on-demand run of the warm-up prompt leaves."""
        await runtime.use_slots(slots)
        runtime.set_link(link)
        runtime.configure(SYSTEMS["ondemand"], 0)
        await runtime.use_placement("off")
        runtime.cache.reset()
        await runtime.complete_ids(self.target.warmup.ids, self.generation(warm=True))
        return runtime.cache.snapshot().layers

    # -- one cell: a system at a setting and a link -----------------------------------------------------------
    async def _cell(self, runtime: BenchRuntime, system: System, setting: Setting, link: str, slots: tuple[int, ...] | None,
                    initial: tuple[tuple[int, ...], ...] | None, note: str = "") -> None:
        """`slots`: each MoE layer's (None: every expert resident). The cell records the fewest a layer has and how
        many layers hold one more."""
        fewest, extra = split_slots(slots) if slots else (None, None)
        cell = {"model": self.target.label, "setting": setting.label if slots is not None else "all", "link": link,
                "system": system.name, "slots": fewest, "extra_slots": extra,
                "note": note, "host_threads": None, "placement": None}
        self.bar.set_postfix(system=system.name, link=link, setting=cell["setting"])
        self.bar.update(1)
        name = (cell["model"], cell["setting"], link, system.name)
        # The longest cell so far; before any cell ran, the part's baseline pass times the repeats (so the first cell
        # of a model is held to the budget too). Not a floor afterwards: the pass was the runtime's first use (graph
        # captures, compiles), and it would skip cells that now fit.
        if not Clock.fits(self.deadline, self.expected_cell_s(link)):
            self.cells.append(cell | {"status": "skipped: time budget"})
            self._ended(name)
            return
        if system.replay_schedule and (cell["setting"], link, *self.target.warmup.key) not in self.schedules:
            self.cells.append(cell | {"status": f"skipped: needs {SCHEDULE_SOURCE} earlier in the same run"})
            self._ended(name)
            return
        started = time.monotonic()
        if slots is not None:
            await runtime.use_slots(slots)
            runtime.set_link(link)
        runtime.configure(system, self.options.k)
        start_state = initial_state(initial, slots, runtime.spec.num_experts, self._use_counts(runtime)) if initial is not None else None
        key = (cell["setting"], link)
        if runtime.cache is not None:
            # Baselines are shared by placement, not by policy name: the same policy may place a speculating system
            # and its k = 0 sibling differently (a trace profile's prefetch model), and each is held to its own.
            profiled = runtime.own_profile
            placement = await runtime.use_placement(system.cpu_experts, start_state, self.desktop_threads(link),
                                                    self.placement_overlap(system))
            if runtime.own_profile is not profiled:  # the runtime's one own trace, decoded now: not this cell's time,
                started += runtime.own_profile.seconds  # which would set the time budget's longest cell
            self.placed = placement.host if placement is not None else ()
            cell["host_threads"] = runtime.host_threads
            cell["placement"] = runtime.placement_decision
            if system.cpu_experts != "off":
                await self._placement_baseline(runtime, system, start_state, key)
        await self._request(runtime, system, self.target.warmup, start_state, key, warm=True)
        if torch.cuda.is_available():
            # The peak is max_memory_reserved: without emptying the allocator's cache first it would carry blocks
            # cached by the load (a widening on CUDA) or by an earlier cell's larger slot pool, not this cell's own.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        records = []  # kept back until the cell ends: a stopped run keeps whole cells only
        for prompt in self.requests:
            for repeat in range(self.options.repeats):
                record = await self._request(runtime, system, prompt, start_state, key)
                records.append(cell | record | {"repeat": repeat})
        self.records += records
        self.cell_seconds.append(time.monotonic() - started)
        self.cell_bytes.append(sum(record["h2d_bytes"] for record in records))
        self.cells.append(cell | {"status": "ok", "seconds": round(self.cell_seconds[-1], 2)})
        self._ended(name)

    def placement_overlap(self, system: System) -> float | None:
        """`auto`'s overlap for `system`: its own (`System.placement_overlap`), else `--placement-overlap`'s; None
        (auto's default) for the other placements (`all` takes none)."""
        overlap = system.placement_overlap if system.placement_overlap is not None else self.options.placement_overlap
        return overlap if system.cpu_experts == "auto" else None

    def desktop_threads(self, link: str) -> int | None:
        """The host path's threads at `link`: the desktop's at DESKTOP_LINK, else None (the engine's default)."""
        return self.options.desktop_threads if link == DESKTOP_LINK else None

    async def _placement_baseline(self, runtime: BenchRuntime, system: System, start_state, cell: tuple[str, str]) -> None:
        """The baseline of a system with host experts: the same placement at k = 0 from the same start (the engine
        alone, one token at a time: the exactness contract), run untimed once per cell and placement. A host expert rounds
        as the host does, so the placement-off baseline is not the one its tokens must equal."""
        if all((*cell, self.placed, prompt.key) in self.placed_baseline for prompt in self.requests):
            return
        runtime.configure(dataclasses.replace(SYSTEMS["ondemand"], cpu_experts=system.cpu_experts), 0)
        for prompt in self.requests:
            if start_state is not None:
                await runtime.cache.restore(CacheSnapshot(start_state))
            result = await runtime.complete_ids(prompt.ids, self.generation(prompt=prompt))
            self.placed_baseline[(*cell, self.placed, prompt.key)] = result.tokens
        runtime.configure(system, self.options.k)

    async def _request(self, runtime: BenchRuntime, system: System, prompt: Prompt, start_state, cell: tuple[str, str],
                       warm: bool = False) -> dict[str, Any]:
        if start_state is not None:
            await runtime.cache.restore(CacheSnapshot(start_state))
            runtime.cache.stats = CacheStats([LayerStats() for _ in range(runtime.cache.num_layers)])
        schedule_key = (*cell, *prompt.key)
        recording = runtime.record_schedule() if system.name == SCHEDULE_SOURCE and runtime.cache is not None else None
        routes = recording[1] if recording is not None else (runtime.record_routes() if runtime.cache is not None else None)
        if system.replay_schedule:
            runtime.replay_schedule(*self.schedules[schedule_key])
        elif system.exact_prefetch:
            runtime.replay_routes(self.routes[(self._depth(system), *prompt.key)])
        started = time.perf_counter()
        result = await runtime.complete_ids(prompt.ids, self.generation(warm, prompt))
        wall_s = time.perf_counter() - started
        if recording is not None:
            self.schedules[schedule_key] = (list(recording[0]), list(recording[1]))
        if warm:
            return {}
        baselines = self.offloaded_baseline if runtime.cache is not None else self.baseline
        expected = baselines.get(prompt.key)
        if system.cpu_experts != "off":  # like with like: the same placement's own k = 0 run
            expected = self.placed_baseline.get((*cell, self.placed, prompt.key))
        floor = None
        if routes is not None:  # the fewest decode bytes any system with these slots could have moved for these rounds
            floor = decode_floor_loads(routes, runtime.cache.layer_slots) * runtime.cache.pool.expert_bytes
        return {"prompt_kind": prompt.kind, "prompt_index": prompt.index, "sampling": prompt.sampling,
                "h2d_decode_floor_bytes": floor,
                "seed": prompt.seed if prompt.sampling != "greedy" else None, **request_record(result.tokens, expected, result.stats),
                "predictor_recall": runtime.predictor_recall, "wall_s": round(wall_s, 4), "peak_gpu_bytes": peak_gpu_bytes(),
                **gpu_memory_parts(), "planned_gpu_bytes": runtime.memory.device_bytes,
                "unused_draft_bytes": unused_draft_bytes(runtime, system), "host_experts_placed": placed_host_experts(runtime)}


def unused_draft_bytes(runtime: BenchRuntime, system: System) -> int:
    """The draft's planned bytes when the runtime holds one that `system` does not use: the offloaded systems share one
    runtime, built with the draft if any of them speculates, while a system that does not is planned (its slots) as if
    it had none; its own peak is the runtime's less these."""
    return runtime.memory.draft_bytes if runtime.draft is not None and not system.speculative else 0


def placed_host_experts(runtime: BenchRuntime) -> int:
    """The (layer, expert) pairs the cell's placement computes on the host while decoding (0: none, or resident)."""
    host = getattr(runtime.experts, "host", None)
    return host.decode.total if host is not None else 0


def request_record(tokens: list[int], expected: list[int] | None, stats) -> dict[str, Any]:
    """One request's measurements: the engine's stats plus the comparison with the baseline tokens."""
    mismatch = next((i for i, (a, b) in enumerate(zip(tokens, expected or [])) if a != b), None)
    if expected is not None and mismatch is None and len(tokens) != len(expected):
        mismatch = min(len(tokens), len(expected))
    return {
        **stats.as_dict(), "tokens_equal": expected is not None and mismatch is None, "first_mismatch": mismatch,
        "recall_hits": stats.recall_hits, "recall_total": stats.recall_total,
        "scout_recall_hits": stats.scout_recall_hits, "scout_recall_total": stats.scout_recall_total, "drafted": stats.drafted, "accepted": stats.accepted,
        "copy_busy_s": stats.copy_busy_s, "copy_window_s": stats.copy_window_s, "copy_idle_s": dict(stats.copy_idle_s),
        "pump_gaps": [[round(late, 7), None if lag is None else round(lag, 7)] for late, lag in stats.pump_gaps],
        "recall_by_layer": {str(layer): list(counts) for layer, counts in sorted(stats.recall_by_layer.items())},
    }


def peak_gpu_bytes() -> int | None:
    return int(torch.cuda.max_memory_reserved()) if torch.cuda.is_available() else None


def gpu_memory_parts() -> dict[str, int | None]:
    """What the peak reserve (`peak_gpu_bytes`) holds, since the cell's warm-up (CUDA; None elsewhere): the peak of
    live tensors, which the memory plan accounts for, and the peak of free bytes inside blocks still partly in use,
    which `empty_cache` cannot give back (the allocator's fragmentation, which no plan counts)."""
    if not torch.cuda.is_available():
        return {"peak_gpu_allocated_bytes": None, "peak_gpu_inactive_split_bytes": None}
    return {"peak_gpu_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_gpu_inactive_split_bytes": int(torch.cuda.memory_stats().get("inactive_split_bytes.all.peak", 0))}


async def bench_models(targets: Sequence[ModelTarget], options: Options, budget_s: float | None,
                       on_cell: Callable[[Progress], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Every model of the matrix in turn; returns (request records, cell statuses). `on_cell` gets the matrix so far
    after every cell that ended (the CLI writes it, so a run stopped or killed mid-way keeps its finished cells)."""
    clock = Clock(budget_s)
    records, cells = [], []
    planned = [[key for part in planned_cells(target, options).values() for key in part] for target in targets]
    ended: set[CellKey] = set()

    def report(bench: ModelBench | None = None) -> None:
        if on_cell is None:
            return
        done = ended | (bench.ended if bench is not None else set())
        on_cell(Progress(records=records + (bench.records if bench is not None else []),
                         cells=cells + (bench.cells if bench is not None else []),
                         remaining=[dict(zip(CELL_FIELDS, key)) for keys in planned for key in keys if key not in done]))

    for index, target in enumerate(tqdm(targets, desc="models", disable=not options.progress, unit="model")):
        bench = ModelBench(target, options, clock.model_deadline(len(targets) - index))
        bench.on_cell = lambda bench=bench: report(bench)
        await bench.run()
        records += bench.records
        cells += bench.cells
        if options.hf and target.path is not None and target.widen is not None:
            target.notes.append(f"{target.label}: hf-accelerate skipped (transformers would read the narrow checkpoint, "
                                "not its widened model)")
        elif options.hf and target.path is not None:
            from specter.bench.hf_baseline import run_hf

            hf_records, hf_note = run_hf(target, bench, options)
            records += hf_records
            if hf_note:
                target.notes.append(hf_note)
        ended.update(planned[index])  # whatever of this model did not run was skipped, and said so
        report()
    return records, cells


def run_matrix(targets: Sequence[ModelTarget], options: Options, budget_s: float | None,
               on_cell: Callable[[Progress], None] | None = None, stopper: Stopper | None = None) -> tuple[list[dict], list[dict]]:
    """bench_models to its end; with a `stopper` (specter.bench.stopping), a stop signal abandons the cell in progress
    and raises BenchStopped once the runtimes have closed."""
    matrix = bench_models(targets, options, budget_s, on_cell)
    return stopper.run(matrix) if stopper is not None else asyncio.run(matrix)


__all__ = ["CELL_FIELDS", "Clock", "ModelBench", "ModelTarget", "Options", "Progress", "Prompt", "bench_models",
           "checkpoint_target", "planned_cells", "run_matrix", "synthetic_prompts"]
