"""Routing traces: what the draft predicted and the target used per round, as JSON lines, for CPU replay.

Format (version 1), one JSON object per line, UTF-8:

Line 1, the header::

    {"format": "specter-trace", "version": 1, "model": "<name>", "num_layers": L, "num_experts": E,
     "expert_bytes": B, "top_k": A, "slots_per_layer": S, ...}

`expert_bytes` is what one routed expert moves across the link, `top_k` the router's active experts per
token, `slots_per_layer` the cache slots per layer of the run that recorded it (the fewest, where layers differ).
Optional: `"layer_slots": [S0, S1, ...]`, each layer's own slots where the recording cache gave some layers one more
(`MemoryPlan.layer_slots`; L counts, the fewest equal to `slots_per_layer`); `"eviction"` and `"prefetch"`, the
recording engine's plug-ins by name (a replay holds only that prefetch policy to the rounds' recorded `checkpoints`).
Other keys (e.g. the measured bandwidth, a date) are kept in `TraceHeader.extra`, these two as well. The reader bounds the shape far above any real model's (a replay allocates
per layer and expert, so a 200-byte header must not ask for 1e8 experts): 1 <= L <= `MAX_LAYERS`,
1 <= E <= `MAX_EXPERTS`, 1 <= B <= `MAX_EXPERT_BYTES`, 1 <= A <= E, and every layer's slots in 1..E.

Then one line per speculative round (the engine records no k = 0 round: nothing was predicted; a reader accepts
them)::

    {"round": r, "k": k, "accepted": n, "draft_step_s": t,
     "layers": [{"predicted": {"<expert>": count, ...}, "used": [expert, ...]}, ...]}

`r` is the request's round count (an int >= 0; a trace of several requests repeats them), `k` the draft depth
(0: plain decode; at most `MAX_DRAFT_DEPTH`), `accepted` the accepted draft tokens (0..k), `draft_step_s` the
engine's estimate of one draft step's seconds as it stood before the round (`Estimates.draft_step_s`, what its
prefetch timing planned with, its fallback of 1e-3 s before it first timed a draft step: `Runtime._timing`), not
the round's measured time. A replay takes it as recorded: the round's drafting hides k * draft_step_s of the link's
time.
Optional: `loaded_bytes`, the H2D bytes the engine moved in the round (its prefetches and its verify's misses), for
checking a replay against the run that recorded the trace; and `checkpoints`, the counts each of the engine's prefetch
plans saw, in order::

    "checkpoints": [{"steps": s, "predicted": [{"<expert>": count, ...}, ...one per layer]}, ...]

(`steps`: draft steps done when the plan was made; a replay plans from these instead of scaling the round's
totals); and `drafted`, the draft steps the round's prefetch plans were made for, where it is not `k`: k + 1 in a round
that drafted ahead (its last step guesses the target's next token, `DraftConfig.overlap`), which the engine's prefetch
policy saw as its `k` and a replay gives it likewise. `layers` has exactly L entries in layer order: `predicted` maps expert id
(a JSON key, so a string) to the draft's top-k hits on it over the round's draft steps (`plan_k`: k, or k + 1 in a round that drafted ahead) (a finite number >= 0; zero
counts may be left out); `used` lists the distinct experts (JSON ints, no repeats) the target's verify pass used at
that layer, the device path's in the order it first used them, then the host path's (a placement's): at most (k + 1) * A of them, the verify's k + 1 rows choosing A each.
Unknown keys are ignored, so version 1 may grow optional fields. Lines are split on "\n" alone (JSON strings may hold
U+2028 and other characters `str.splitlines` would split on).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from specter.errors import OutputError, SpecterError, abbreviate
from specter.paths import json_value, write_advice

TRACE_FORMAT = "specter-trace"
TRACE_VERSION = 1
_HEADER_INTS = ("num_layers", "num_experts", "expert_bytes", "top_k", "slots_per_layer")
MAX_LAYERS = 512
"""Most MoE layers a trace's header may give: real models have at most a hundred or so (DeepSeek-V3 58, Qwen3-235B 94)."""
MAX_EXPERTS = 4096
"""Most routed experts per layer a trace's header may give: real models have at most a few hundred (DeepSeek-V3 256,
Qwen3-Next 512). With MAX_LAYERS it caps a replay's [L, E] arrays at 2M entries (a replay's work grows with L x E
and the rounds: at both bounds `--placement off,all,auto` takes minutes, at a real model's shape seconds)."""
MAX_EXPERT_BYTES = 1 << 40
"""Most bytes one expert may move (1 TiB): the largest real experts are about a GB (Grok-1's, bf16: 1.2 GB)."""
MAX_DRAFT_DEPTH = 1024
"""Most draft steps a round may give: the engine drafts at most `DraftConfig.k_max` <= 32; a replay's prefetch
policies plan per step, so a k of 1e12 would hang it."""


class TraceError(SpecterError, ValueError):
    """A routing trace file is malformed (names the file, the line and what was expected)."""


@dataclass(frozen=True)
class TraceHeader:
    """The trace's first line: the model and the cache shape the rounds refer to."""

    model: str
    num_layers: int
    num_experts: int
    expert_bytes: int
    top_k: int
    slots_per_layer: int
    extra: Mapping[str, Any] = field(default_factory=dict)
    layer_slots: tuple[int, ...] = ()
    """Each layer's own slots where they differ; empty: `slots_per_layer` in every layer."""

    def __post_init__(self) -> None:
        if self.layer_slots and (len(self.layer_slots) != self.num_layers or min(self.layer_slots) != self.slots_per_layer):
            raise ValueError(f"layer_slots={list(self.layer_slots)}: expected num_layers={self.num_layers} counts whose "
                             f"fewest is slots_per_layer={self.slots_per_layer}")

    def slots(self) -> tuple[int, ...]:
        """Each layer's slots in the recording run."""
        return self.layer_slots or (self.slots_per_layer,) * self.num_layers

    @property
    def recorded_prefetch(self) -> str | None:
        """The recording engine's prefetch plug-in (the header's `prefetch`), whose plans the rounds' checkpoints are;
        None where the trace does not say."""
        name = self.extra.get("prefetch")
        return name if isinstance(name, str) else None

    def to_json(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in ("model", *_HEADER_INTS)}
        varied = {"layer_slots": list(self.layer_slots)} if len(set(self.layer_slots)) > 1 else {}
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, **fields, **varied, **self.extra}


@dataclass(frozen=True)
class LayerRoutes:
    """One layer of one round: the draft's predicted counts and the experts the target used."""

    predicted: Mapping[int, float]
    used: list[int]


@dataclass(frozen=True)
class TraceRound:
    """One decode round of a trace."""

    round: int
    k: int
    accepted: int
    draft_step_s: float
    layers: list[LayerRoutes]
    loaded_bytes: int | None = None
    """The H2D bytes the recording engine moved in this round; None where the trace does not say."""
    checkpoints: tuple[tuple[int, tuple[Mapping[int, float], ...]], ...] | None = None
    """(steps done, per-layer counts) of each prefetch plan the recording engine made; None where not recorded."""
    drafted: int | None = None
    """The draft steps the round's prefetch plans were made for (their `k`): k + 1 where the round drafted ahead; None: k."""

    @property
    def plan_k(self) -> int:
        """The `k` the recording engine's prefetch policy planned this round with."""
        return self.k if self.drafted is None else self.drafted

    @classmethod
    def from_arrays(
        cls,
        round: int,
        k: int,
        accepted: int,
        draft_step_s: float,
        route_counts: np.ndarray,  # [L, E]
        used: Iterable[Iterable[int]],
        loaded_bytes: int | None = None,
        checkpoints: Iterable[tuple[int, np.ndarray]] | None = None,  # (steps done, [L, E] counts)
        drafted: int | None = None,
    ) -> TraceRound:
        """Build a round from the draft's `[L, E]` route counters and the target's per-layer used experts."""
        layers = [
            LayerRoutes(_nonzero(row), [int(e) for e in layer_used])
            for row, layer_used in zip(np.asarray(route_counts), used, strict=True)
        ]
        planned = None if checkpoints is None else tuple(
            (int(steps), tuple(_nonzero(row) for row in np.asarray(counts))) for steps, counts in checkpoints
        )
        return cls(round=round, k=k, accepted=accepted, draft_step_s=draft_step_s, layers=layers,
                   loaded_bytes=loaded_bytes, checkpoints=planned, drafted=None if drafted == k else drafted)

    def predicted_counts(self, num_experts: int) -> np.ndarray:
        """The predicted counts as a dense `[L, E]` float array."""
        return _dense([routes.predicted for routes in self.layers], num_experts)

    def checkpoint_counts(self, num_experts: int) -> list[tuple[int, np.ndarray]]:
        """The recorded checkpoints as (steps done, dense `[L, E]` counts); empty where none were recorded."""
        return [(steps, _dense(layers, num_experts)) for steps, layers in self.checkpoints or ()]

    def to_json(self) -> dict[str, Any]:
        layers = [
            {"predicted": _counts_json(r.predicted), "used": list(r.used)}
            for r in self.layers
        ]
        scalars = {"round": self.round, "k": self.k, "accepted": self.accepted, "draft_step_s": self.draft_step_s}
        if self.loaded_bytes is not None:
            scalars["loaded_bytes"] = self.loaded_bytes
        if self.drafted is not None:
            scalars["drafted"] = self.drafted
        if self.checkpoints is not None:
            scalars["checkpoints"] = [
                {"steps": steps, "predicted": [_counts_json(row) for row in rows]}
                for steps, rows in self.checkpoints
            ]
        return {**scalars, "layers": layers}


def _nonzero(row: np.ndarray) -> dict[int, float]:
    return {int(e): float(row[e]) for e in np.flatnonzero(row)}


def _dense(rows: Iterable[Mapping[int, float]], num_experts: int) -> np.ndarray:
    rows = list(rows)
    counts = np.zeros((len(rows), num_experts), dtype=np.float64)
    for layer, row in enumerate(rows):
        for expert, count in row.items():
            counts[layer, expert] = count
    return counts


def _counts_json(row: Mapping[int, float]) -> dict[str, float | int]:
    """{expert: count} as JSON wants it: string keys in expert order, whole counts as ints."""
    return {str(e): _plain_number(c) for e, c in sorted(row.items())}


def _plain_number(count: float) -> float | int:
    return int(count) if float(count).is_integer() else float(count)


def use_counts(rounds: Iterable[TraceRound], num_layers: int, num_experts: int) -> list[list[float]]:
    """Per layer and expert, how many of `rounds` used it (each round's verify counts an expert once): the routing
    profile a placement's cost model scales to uses per token."""
    counts = [[0.0] * num_experts for _ in range(num_layers)]
    for trace_round in rounds:
        for layer, routes in enumerate(trace_round.layers):
            for expert in set(routes.used):
                counts[layer][expert] += 1.0
    return counts


class TraceWriter:
    """Writes a trace: the header at construction, then one line per `write_round`. Use as a context manager."""

    def __init__(self, path: str | Path, header: TraceHeader) -> None:
        self.path = Path(path)
        self.header = header
        with self._writing():
            self._file: IO[str] = self.path.open("w", encoding="utf-8")
        self._write_line(header.to_json())

    def write_round(self, trace_round: TraceRound) -> None:
        assert len(trace_round.layers) == self.header.num_layers, "a round must have one entry per layer"
        self._write_line(trace_round.to_json())

    def flush(self) -> None:
        with self._writing():
            self._file.flush()

    def close(self) -> None:
        with self._writing():
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_line(self, obj: dict[str, Any]) -> None:
        with self._writing():
            self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:  # a full disk, a device that takes no writes: the user's path, said so
            raise OutputError(f"cannot write the routing trace {self.path}: {error.strerror or error}; "
                              f"{write_advice(error, 'choose another path')}") from None


def read_trace(path: str | Path) -> tuple[TraceHeader, list[TraceRound]]:
    """Read and validate a whole trace; raises TraceError naming the file and line of the first problem."""
    if isinstance(path, str) and not path.strip():  # Path('') is the current directory: "Is a directory: '.'"
        raise TraceError("the trace path is empty; give a routing trace file (`specter generate --trace PATH` records one)")
    path = Path(path)
    try:
        # "\n" alone ends a line (as the writer writes them): str.splitlines would also split a JSON string at U+2028,
        # U+0085 and the like, which JSON leaves unescaped; a CRLF line keeps its "\r", JSON whitespace.
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    except UnicodeDecodeError as exc:  # a ValueError, not an OSError: a binary file would escape as a traceback
        raise TraceError(f"{path} is not a routing trace (not UTF-8 text: {exc.reason} at byte {exc.start}); expected "
                         f"a '{TRACE_FORMAT}' header line, then one JSON line per round") from exc
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise TraceError(f"{path}: empty file; expected a '{TRACE_FORMAT}' header line, then one line per round")
    header = _parse(path, *numbered[0], _header_from_json)
    rounds = [_parse(path, number, line, lambda obj: _round_from_json(obj, header)) for number, line in numbered[1:]]
    return header, rounds


def _parse(path: Path, number: int, line: str, build: Any) -> Any:
    try:
        obj = json_value(line)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        return build(obj)
    except (ValueError, TypeError, KeyError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise TraceError(f"{path} line {number}: {detail}. See the format in specter/trace.py.") from exc


def _header_from_json(obj: dict[str, Any]) -> TraceHeader:
    if obj.get("format") != TRACE_FORMAT or obj.get("version") != TRACE_VERSION:
        raise ValueError(
            f"header says format={obj.get('format')!r} version={obj.get('version')!r}; "
            f"expected format={TRACE_FORMAT!r} version={TRACE_VERSION}"
        )
    if not isinstance(obj["model"], str):
        raise ValueError(f"model={abbreviate(obj['model'])}; expected the model's name, a string")
    # Bounded before anything is sized from them: a replay allocates per layer and expert (see MAX_EXPERTS).
    layers = _int_in(obj["num_layers"], "num_layers", 1, MAX_LAYERS, "MAX_LAYERS, far above any real model's")
    experts = _int_in(obj["num_experts"], "num_experts", 1, MAX_EXPERTS, "MAX_EXPERTS, far above any real model's")
    expert_bytes = _int_in(obj["expert_bytes"], "expert_bytes", 1, MAX_EXPERT_BYTES, "MAX_EXPERT_BYTES, 1 TiB")
    top_k = _int_in(obj["top_k"], "top_k", 1, experts, "num_experts: a token picks top_k of the layer's experts")
    slots = _int_in(obj["slots_per_layer"], "slots_per_layer", 1, experts, "num_experts: no cache holds more")
    layer_slots = obj.get("layer_slots")
    if layer_slots is not None and not isinstance(layer_slots, list):
        raise ValueError(f"layer_slots={abbreviate(layer_slots)}; expected a list of num_layers={layers} ints")
    counts = tuple(_int_in(count, "layer_slots entry", 1, experts, "num_experts: no cache holds more")
                   for count in layer_slots or ())
    extra = {key: value for key, value in obj.items()
             if key not in ("format", "version", "model", "layer_slots", *_HEADER_INTS)}
    return TraceHeader(model=obj["model"], extra=extra, layer_slots=counts, num_layers=layers, num_experts=experts,
                       expert_bytes=expert_bytes, top_k=top_k, slots_per_layer=slots)


def _round_from_json(obj: dict[str, Any], header: TraceHeader) -> TraceRound:
    number = _int_at_least(obj["round"], "round", 0)
    k = _int_in(obj["k"], "k", 0, MAX_DRAFT_DEPTH, "MAX_DRAFT_DEPTH, far above the engine's k_max")
    accepted = _int_at_least(obj["accepted"], "accepted", 0)
    if accepted > k:
        raise ValueError(f"accepted={accepted} exceeds k={k}")
    layers = obj["layers"]
    if not isinstance(layers, list) or len(layers) != header.num_layers:
        raise ValueError(f"'layers' must be a list of num_layers={header.num_layers} entries")
    routes = [_layer_from_json(layer, index, header.num_experts) for index, layer in enumerate(layers)]
    most = (k + 1) * header.top_k  # the verify's k + 1 rows each choose top_k experts
    for index, layer in enumerate(routes):
        if len(layer.used) > most:
            raise ValueError(f"layer {index}: {len(layer.used)} experts used, more than the verify's k + 1 = {k + 1} rows "
                             f"choose at top_k={header.top_k} each ({most})")
    draft_step_s = _count(obj["draft_step_s"], "draft_step_s")
    loaded = obj.get("loaded_bytes")
    loaded_bytes = None if loaded is None else _int_at_least(loaded, "loaded_bytes", 0)
    checkpoints = None if obj.get("checkpoints") is None else _checkpoints_from_json(obj["checkpoints"], k, header)
    drafted = obj.get("drafted")
    if drafted is not None:  # a draft-ahead round drafts its k steps and one more, its guess
        drafted = _int_in(drafted, "drafted", k, k + 1, f"k + 1 = {k + 1}")
    return TraceRound(round=number, k=k, accepted=accepted, draft_step_s=draft_step_s, layers=routes,
                      loaded_bytes=loaded_bytes, checkpoints=checkpoints, drafted=None if drafted == k else drafted)


def _checkpoints_from_json(items: Any, k: int, header: TraceHeader) -> tuple[tuple[int, tuple[dict[int, float], ...]], ...]:
    if not isinstance(items, list):
        raise ValueError("'checkpoints' must be a list of {'steps': s, 'predicted': [one {expert: count} per layer]}")
    checkpoints = []
    for item in items:
        steps = _int_at_least(item["steps"], "checkpoint steps", 0)
        if steps > k + 1:  # a draft-ahead round drafts one step past k (its guess)
            raise ValueError(f"checkpoint steps={steps} exceeds k + 1 = {k + 1}")
        rows = item["predicted"]
        if not isinstance(rows, list) or len(rows) != header.num_layers:
            raise ValueError(f"a checkpoint's 'predicted' must list num_layers={header.num_layers} entries")
        layers = tuple(_layer_from_json({"predicted": row, "used": []}, layer, header.num_experts).predicted
                       for layer, row in enumerate(rows))
        checkpoints.append((steps, layers))
    return tuple(checkpoints)


def _layer_from_json(obj: Any, layer: int, num_experts: int) -> LayerRoutes:
    if not isinstance(obj, dict) or not isinstance(obj["predicted"], dict) or not isinstance(obj["used"], list):
        raise ValueError(f"layer {layer}: expected {{'predicted': {{expert: count}}, 'used': [experts]}}")
    predicted = {_expert_id(key, layer, num_experts): _count(count, f"layer {layer}: predicted count of expert {key}")
                 for key, count in obj["predicted"].items()}
    used = []
    for expert in obj["used"]:
        if isinstance(expert, bool) or not isinstance(expert, int):  # ids are JSON ints here (keys only are strings)
            raise ValueError(f"layer {layer}: used expert {abbreviate(expert)} is not an int in 0..{num_experts - 1}")
        used.append(_expert_id(expert, layer, num_experts))
    if len(set(used)) != len(used):  # the verify pays for each expert once: a repeat is a broken writer
        repeated = sorted(e for e, times in collections.Counter(used).items() if times > 1)
        raise ValueError(f"layer {layer}: 'used' lists expert(s) {repeated} more than once; expected distinct experts")
    return LayerRoutes(predicted=predicted, used=used)


def _expert_id(value: Any, layer: int, num_experts: int) -> int:
    expert = int(value)
    if str(expert) != str(value).strip() or not 0 <= expert < num_experts:
        raise ValueError(f"layer {layer}: expert id {value!r} is not an int in 0..{num_experts - 1}")
    return expert


def _int_at_least(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={abbreviate(value)}; expected an int >= {minimum}")
    return value


def _int_in(value: Any, name: str, minimum: int, maximum: int, why: str) -> int:
    """An int in minimum..maximum; `why` names the bound above."""
    value = _int_at_least(value, name, minimum)
    if value > maximum:
        raise ValueError(f"{name}={abbreviate(value)}; expected an int in {minimum}..{maximum} ({why})")
    return value


def _count(value: Any, name: str) -> float:
    """A finite JSON number >= 0: json reads NaN and Infinity, and float() would take "0.01" and true."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond a float's range
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name}={abbreviate(value)} must be >= 0 and finite, a JSON number")
    return number
