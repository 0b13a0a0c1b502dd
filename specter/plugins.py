"""Plug-in loading per entry-point group, allow-listed by SPECTER_PLUGINS, validated and guarded.

Groups: `specter.eviction`, `specter.prefetch`, `specter.lookahead`, `specter.placement` (policies) and
`specter.backends`.
SPECTER_PLUGINS: comma-separated `name` or `group:name` (e.g. `lru,prefetch:none`); unset allows every
installed plug-in, set but empty allows none. Every error names the plug-in, its group and distribution.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Any

import numpy as np

from specter.errors import PluginError, abbreviate
from specter.log import get_logger
from specter.placement import Placement, PlacementState
from specter.policy import (
    LinkTiming,
    LookaheadState,
    Plan,
    RoundOutcome,
    UseHistory,
    protocol_problems,
)

log = get_logger(__name__)

ALLOW_LIST_ENV = "SPECTER_PLUGINS"
GROUP_PREFIX = "specter."
POLICY_GROUPS = ("eviction", "prefetch", "lookahead", "placement")
BACKEND_GROUP = "backends"

SLOW_CALL_S = 0.05
"""A policy call longer than this is logged once per method (`plugin.slow_call`): it held the event loop."""

LOAD_SLOW_CALL_S = 10.0
"""The same for a placement's load-time methods (`GuardedPlacement._at_load`): the engine asks them once while it loads
(the bench once per cell), before any request waits, and a cost model may take a while there (`auto` replays a routing
trace), so only a call that visibly delays the load is worth a warning."""

_scan_lock = threading.RLock()
_scanned: dict[str, dict[str, EntryPoint]] = {}


@dataclass(frozen=True)
class PluginOrigin:
    """Where a plug-in came from, for error messages: group, name, distribution and version."""

    group: str
    name: str
    dist: str | None = None
    version: str | None = None
    cls: str | None = None
    """The class of a policy object handed over directly (not loaded by name): its `name` may be any, a reference
    plug-in's too, so its errors name the class that made the decision."""

    def label(self) -> str:
        source = f"dist {self.dist} {self.version}" if self.dist else f"an object of {self.cls}" if self.cls else "dist unknown"
        return f"{self.group} plug-in {self.name!r} ({source})"

    @classmethod
    def of(cls, group: str, entry_point: EntryPoint) -> PluginOrigin:
        dist = getattr(entry_point, "dist", None)
        if dist is None:
            return cls(group, entry_point.name)
        return cls(group, entry_point.name, dist.metadata["Name"], dist.version)


def short_group(group: str) -> str:
    """'specter.eviction' or 'eviction' -> 'eviction'."""
    short = group.removeprefix(GROUP_PREFIX)
    if short not in (*POLICY_GROUPS, BACKEND_GROUP):
        known = ", ".join(GROUP_PREFIX + g for g in (*POLICY_GROUPS, BACKEND_GROUP))
        raise PluginError(f"unknown plug-in group {group!r}; the groups are {known}")
    return short


def installed(group: str, *, refresh: bool = False) -> dict[str, EntryPoint]:
    """Name -> entry point of every installed plug-in of `group`, allowed or not (scan cached)."""
    short = short_group(group)
    with _scan_lock:
        if refresh or short not in _scanned:
            _scanned[short] = _scan(short)
        return dict(_scanned[short])


def _scan(short: str) -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for entry_point in entry_points(group=GROUP_PREFIX + short):
        if not _selectable(entry_point.name):
            # SPECTER_PLUGINS splits on ',' and reads 'group:name': a ',' makes the name unselectable there, a ':'
            # lets `prefetch:none` (an eviction plug-in's name) pass an allow-list meant for the prefetch `none`
            log.warning("plugin.bad_name", group=short, name=entry_point.name, value=entry_point.value,
                        dist=PluginOrigin.of(short, entry_point).dist,
                        advice="a plug-in's name holds no ',' or ':' and no space at its ends; rename the entry point "
                               "in its distribution (it is skipped until then)")
            continue
        if entry_point.name not in found:
            found[entry_point.name] = entry_point
            continue
        # Two distributions claim one name. A reference plug-in's name stays the reference plug-in's: else whichever
        # importlib.metadata lists first (an order of sys.path the user never chose) would silently run a third party's
        # code as `lru` in every engine, replay and bench baseline, and through an allow-list that names `lru` only.
        # Between two third parties, keep the first.
        kept, ignored = found[entry_point.name], entry_point
        if _is_reference(ignored) and not _is_reference(kept):
            kept, ignored = ignored, kept
            found[entry_point.name] = kept
        ignored_dist = PluginOrigin.of(short, ignored).dist
        advice = (f"rename the entry point in {ignored_dist or 'its distribution'}: {entry_point.name!r} is a reference "
                  f"plug-in's name, which a third party cannot replace; select yours by its new name"
                  if _is_reference(kept) and not _is_reference(ignored) else
                  "uninstall one of the two distributions; SPECTER_PLUGINS selects names, not distributions")
        log.warning("plugin.duplicate", group=short, name=entry_point.name, kept=kept.value,
                    kept_dist=PluginOrigin.of(short, kept).dist, ignored=ignored.value, ignored_dist=ignored_dist,
                    advice=advice)
    return found


def _selectable(name: str) -> bool:
    """Whether `name` can be named on the command line and in SPECTER_PLUGINS (`is_allowed`) as it is."""
    return bool(name) and name == name.strip() and not any(mark in name for mark in ",:")


def _is_reference(entry_point: EntryPoint) -> bool:
    """Whether an entry point names one of the engine's own plug-ins (`policies/`, `backends/`): its module is one of
    those packages, which one process imports from one place, whichever distribution declared the entry point."""
    module = entry_point.value.partition(":")[0].strip()
    return module.partition(".")[0] in ("policies", "backends")


def refresh() -> None:
    """Forget the cached entry-point scan (after installing a plug-in into the running process)."""
    with _scan_lock:
        _scanned.clear()
        _checked_allow_lists.clear()


def is_allowed(group: str, name: str) -> bool:
    """Whether SPECTER_PLUGINS lets the plug-in `name` of `group` load."""
    allow_list = os.environ.get(ALLOW_LIST_ENV)
    if allow_list is None:
        return True
    entries = {entry.strip() for entry in allow_list.split(",") if entry.strip()}
    _warn_unmatched(allow_list, entries)
    short = short_group(group)
    return name in entries or f"{short}:{name}" in entries or f"{GROUP_PREFIX}{short}:{name}" in entries


_checked_allow_lists: set[str] = set()


def _warn_unmatched(allow_list: str, entries: set[str]) -> None:
    """Log once per allow-list value the entries that name no installed plug-in.

    A misspelt entry allows nothing, so the plug-in it meant is refused later under its own name; the warning
    names the misspelling itself.
    """
    groups = (*POLICY_GROUPS, BACKEND_GROUP)
    with _scan_lock:  # (reentrant: installed() takes it too)
        if allow_list in _checked_allow_lists:
            return
        names = {group: installed(group) for group in groups}
        _checked_allow_lists.add(allow_list)  # after the scan: a scan that failed is tried again
    unmatched = []
    for entry in sorted(entries):
        group, _, name = entry.rpartition(":")
        if group.removeprefix(GROUP_PREFIX) not in ("", *groups):
            unmatched.append(f"{entry!r} (no group {group!r}; the groups are {', '.join(groups)})")
        elif not any(name in names[g] for g in ((group.removeprefix(GROUP_PREFIX),) if group else groups)):
            unmatched.append(f"{entry!r} (no such plug-in installed)")
    if unmatched:
        log.warning("plugin.allow_list_unmatched", variable=ALLOW_LIST_ENV, entries=unmatched,
                    installed={g: sorted(found) for g, found in names.items()},
                    advice=f"correct or remove these {ALLOW_LIST_ENV} entries; as written they allow nothing")


def available(group: str, *, refresh: bool = False) -> dict[str, EntryPoint]:
    """The installed plug-ins of `group` that the allow-list lets load."""
    return {name: ep for name, ep in installed(group, refresh=refresh).items() if is_allowed(group, name)}


def load_policy(group: str, name: str, *, guard: bool = True, refresh: bool = False, **options: Any) -> Any:
    """Load, construct (with `options` as keywords) and validate the policy `name` of `group`.

    Returns it wrapped by `guarded` unless guard=False. Raises PluginError when the name is unknown or not
    allowed, the import or constructor fails, or the object does not satisfy the group's protocol.
    """
    short = short_group(group)
    if short not in POLICY_GROUPS:
        raise PluginError(f"{group!r} is not a policy group; expected one of {', '.join(POLICY_GROUPS)}")
    policy, origin = _load_and_construct(short, name, refresh, options)
    problems = _checked_protocol(policy, short, origin)
    if problems:
        raise PluginError(f"{origin.label()}: {'; '.join(problems)}")
    log.debug("plugin.loaded", group=short, name=name, dist=origin.dist, version=origin.version)
    return guarded(policy, short, origin) if guard else policy


def load_backend(name: str, *, refresh: bool = False, required: Sequence[str] | None = None, **options: Any) -> Any:
    """Load and construct the backend `name` (`specter.backends`), checked for the methods it must have.

    `required` defaults to the methods of the `Backend` protocol in `backends.base`.
    """
    backend, origin = _load_and_construct(BACKEND_GROUP, name, refresh, options)
    methods = _backend_protocol_methods() if required is None else tuple(required)
    problems = [f"{method}() missing" for method in methods if not callable(getattr(backend, method, None))]
    if not isinstance(getattr(backend, "name", None), str):
        problems.append("`name` attribute missing or not a str")
    if problems:
        raise PluginError(f"{origin.label()}: {'; '.join(problems)}")
    log.debug("plugin.loaded", group=BACKEND_GROUP, name=name, dist=origin.dist, version=origin.version)
    return backend


def _backend_protocol_methods() -> tuple[str, ...]:
    # Imported late: the protocol module needs torch, which policy loading and replay do not.
    from backends.base import Backend

    return tuple(name for name, member in vars(Backend).items() if callable(member) and not name.startswith("_"))


def _load_and_construct(short: str, name: str, refresh: bool, options: dict[str, Any]) -> tuple[Any, PluginOrigin]:
    entry_point = _find(short, name, refresh)
    origin = PluginOrigin.of(short, entry_point)
    if not re.fullmatch(r"[\w.]+(\s*:\s*[\w.]+)?(\s*\[.*\])?", entry_point.value.strip()):
        raise PluginError(f"{origin.label()}: its entry point {entry_point.value!r} is not 'module:attribute' "
                          f"(e.g. 'mypackage.policies:MyPolicy'); fix the distribution's entry points")
    # SystemExit too, as in a decision (`_Guarded._call`): a plug-in's exit() at import or construction is its bug,
    # and it would end the process without a word (a replay over every installed plug-in, a server starting).
    try:
        factory = entry_point.load()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 (see `_Guarded._call`)
        raise PluginError(f"{origin.label()}: importing {entry_point.value!r} failed: {exc!r}; fix or reinstall the "
                          f"distribution that declares it, or uninstall it") from exc
    if not callable(factory):
        raise PluginError(f"{origin.label()}: {entry_point.value!r} is not a class or factory")
    try:
        made = factory(**options)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001
        advice = ("; the engine calls a plug-in's entry point with no arguments, so give every parameter of its "
                  "constructor a default, or point the entry point at a factory that supplies them"
                  if not options and isinstance(exc, TypeError) and "required" in str(exc) else "")
        if isinstance(exc, SystemExit):
            detail, advice = f"it called exit({exc.code!r})", "; a plug-in must raise an exception, never exit the process"
        else:  # the type too: str() of an AssertionError is empty, of a KeyError its key alone
            detail = str(exc) if advice else f"raised {abbreviate(exc)}"
        raise PluginError(f"{origin.label()}: construction with options {options} failed: {detail}{advice}") from exc
    # What the protocol check would say of these (a missing method, `self` unfilled) points away from the slip
    if made is None:
        raise PluginError(f"{origin.label()}: its entry point {entry_point.value!r} returned None; a factory must return "
                          "the policy object (point the entry point at the class itself, or return an instance)")
    if isinstance(made, type):
        raise PluginError(f"{origin.label()}: its entry point {entry_point.value!r} returned the class {made.__name__}, "
                          "not an instance; return an instance (e.g. `return MyPolicy()`), or point the entry point at "
                          "the class itself")
    return made, origin


def _checked_protocol(policy: object, short: str, origin: PluginOrigin) -> list[str]:
    """protocol_problems, with a plug-in whose attribute lookup itself raises (a `name` property, `__getattr__`)
    named rather than a traceback from the check."""
    with _plugin_errors(f"{origin.label()}: checking its methods and name"):
        return protocol_problems(policy, short)


_PASSING = (KeyboardInterrupt, PluginError)
"""What a plug-in's code may raise through the guard: the user's interrupt, and a guard's own error. Everything else,
not only Exception, is the plug-in's failure: its code is synchronous, so a SystemExit, a GeneratorExit or even a
CancelledError raised there is its own (the engine's cancellation reaches its task at an await, never inside a
policy call)."""


@contextlib.contextmanager
def _plugin_errors(what: str) -> Iterator[None]:
    """Every exception of a plug-in's code run inside (but `_PASSING`) as a PluginError saying `what` ran; for the
    cold paths: a decision's own call and its ids (`_Guarded._call`, `_ids`) build no message unless one fails."""
    try:
        yield
    except _PASSING:
        raise
    except BaseException as exc:  # noqa: BLE001
        raise PluginError(f"{what} raised {abbreviate(exc)}") from exc


def _find(short: str, name: str, refresh: bool) -> EntryPoint:
    plugins = installed(short, refresh=refresh)
    if name not in plugins:
        names = ", ".join(sorted(plugins)) or "none"
        raise PluginError(
            f"no {short} plug-in named {name!r}; installed: {names}. "
            f"Install the package that provides it, or pick one of these."
        )
    if not is_allowed(short, name):
        raise PluginError(
            f"{short} plug-in {name!r} is installed but {ALLOW_LIST_ENV}={os.environ.get(ALLOW_LIST_ENV)!r} "
            f"does not allow it; add '{name}' or '{short}:{name}' to {ALLOW_LIST_ENV}, or unset it"
        )
    return plugins[name]


def guarded(policy: Any, group: str, origin: PluginOrigin | None = None) -> Any:
    """Wrap a policy so that any exception or wrong answer from a decision becomes a PluginError naming it.

    The engine calls the wrapper as it would the policy and stays usable after a PluginError. Already
    guarded policies are returned as they are. Extra attributes pass through to the policy.
    """
    if isinstance(policy, _Guarded):
        return policy
    short = short_group(group)
    if origin is None:
        try:
            named = str(getattr(policy, "name", type(policy).__name__))
        except Exception:  # noqa: BLE001 (a `name` property that raises: the protocol check below names it)
            named = type(policy).__name__
        origin = PluginOrigin(short, named, cls=f"{type(policy).__module__}.{type(policy).__qualname__}")
    wrappers = {"eviction": GuardedEviction, "prefetch": GuardedPrefetch, "lookahead": GuardedLookahead,
                "placement": GuardedPlacement}
    if short not in wrappers:
        raise PluginError(f"cannot guard a {short} plug-in; only {', '.join(wrappers)} policies are guarded")
    problems = _checked_protocol(policy, short, origin)
    if problems:
        raise PluginError(f"{origin.label()}: {'; '.join(problems)}")
    return wrappers[short](policy, origin)


class _Guarded:
    """Shared part of the guarded wrappers: the policy, its origin, and the call that names it on error."""

    _at_load: frozenset[str] = frozenset()
    """Methods the engine calls only while it loads, before any request waits (timed against `LOAD_SLOW_CALL_S`);
    every other method is a decision on the event loop (`SLOW_CALL_S`)."""

    def __init__(self, policy: Any, origin: PluginOrigin) -> None:
        self.policy = policy
        self.origin = origin
        # The name it was selected by (its entry point's), not the object's own `name`, which the docs ask for but do
        # not tie to the entry point: the replay labels its rows with this, and an object named as another plug-in
        # (a copied `name = "lru"`) must not show as that one.
        self.name: str = origin.name
        self._slow: set[str] = set()

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "policy":  # not yet set (copy, unpickle): do not recurse
            raise AttributeError(attribute)
        return getattr(self.policy, attribute)

    def __repr__(self) -> str:
        return f"guarded({self.policy!r})"

    def _call(self, method: str, **arguments: Any) -> Any:
        started = time.perf_counter()
        try:
            return getattr(self.policy, method)(**arguments)
        except _PASSING:
            raise
        except BaseException as exc:  # noqa: BLE001 (see _PASSING)
            raise PluginError(f"{self.origin.label()}: {method}() raised {abbreviate(exc)}") from exc
        finally:
            self._time(method, time.perf_counter() - started)

    def _reading(self, method: str) -> contextlib.AbstractContextManager[None]:
        """The check of `method`'s answer, which reads the plug-in's objects (a generator, a mapping's items): their
        code's exceptions are the plug-in's too."""
        return _plugin_errors(f"{self.origin.label()}: reading the answer of {method}()")

    def _time(self, method: str, seconds: float) -> None:
        """Warn once per method of a policy whose call held the event loop long: every decision runs on it, so the
        copies, the GPU's next launches and every other request wait for it. A load-time method (`_at_load`) holds up
        no request, only the load, and is held to `LOAD_SLOW_CALL_S`."""
        at_load = method in self._at_load
        if seconds > (LOAD_SLOW_CALL_S if at_load else SLOW_CALL_S) and method not in self._slow:
            self._slow.add(method)
            advice = (f"{method}() runs once while the engine loads (once per bench cell), before any request waits: it "
                      "held up no request, but it delayed the load; keep it to a few seconds (bound what it computes)"
                      if at_load else "a policy runs on the engine's event loop; keep each decision to a millisecond or so")
            log.warning("plugin.slow_call", plugin=self.origin.label(), method=method, ms=round(seconds * 1e3, 1),
                        advice=advice)

    def _wrong(self, method: str, problem: str) -> PluginError:
        return PluginError(f"{self.origin.label()}: {method}() returned a wrong answer: {problem}")

    def _ids(self, method: str, value: Any, what: str) -> list[int]:
        """`value` as a list of ints (numpy's integers too), or a wrong answer: a float, a str or a bool is an id
        only by accident (int() would take 2.7 as expert 2), and a generator is read once, here."""
        try:
            iterator = iter(value)
        except TypeError:
            raise self._wrong(method, f"{what} {abbreviate(value)} is not a list of ids") from None
        try:
            items = list(iterator)  # a generator's code runs here: its exceptions are the plug-in's
        except _PASSING:
            raise
        except BaseException as exc:  # noqa: BLE001 (see _PASSING)
            raise PluginError(f"{self.origin.label()}: reading the answer of {method}() raised {abbreviate(exc)}") from exc
        if not all(isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)) for item in items):
            raise self._wrong(method, f"{what} {abbreviate(items)} is not a list of int ids")
        return [int(item) for item in items]


class GuardedEviction(_Guarded):
    """An eviction policy whose victims() is checked: exactly `count` distinct unprotected residents."""

    def victims(
        self,
        layer: int,
        residents: Sequence[int],
        protected: Set[int],
        count: int,
        history: UseHistory,
        plan: Plan | None,
    ) -> list[int]:
        resident_set, protected_set = set(residents), set(protected)  # before the call, which might change them
        chosen = self._ids("victims", self._call(
            "victims", layer=layer, residents=residents, protected=protected, count=count, history=history, plan=plan
        ), "the victims")
        if len(chosen) != count or len(set(chosen)) != count:
            raise self._wrong("victims", f"{abbreviate(chosen)} is not {count} distinct experts")
        if not set(chosen) <= resident_set or set(chosen) & protected_set:
            bad = sorted(set(chosen) - (resident_set - protected_set))
            raise self._wrong("victims", f"{abbreviate(bad)} are not resident or are protected (layer {layer})")
        return chosen


class GuardedPrefetch(_Guarded):
    """A prefetch policy whose checkpoints and plans are checked against k, E and the slot count."""

    def checkpoints(self, k: int, timing: LinkTiming) -> list[int]:
        steps = self._ids("checkpoints", self._call("checkpoints", k=k, timing=timing), "the draft-step counts")
        if steps != sorted(set(steps)) or any(not 1 <= step <= k for step in steps):
            raise self._wrong("checkpoints", f"{abbreviate(steps)} are not sorted distinct steps in 1..{k}")
        return steps

    def plan(
        self,
        route_counts: np.ndarray,
        resident: np.ndarray,
        steps_done: int,
        k: int,
        timing: LinkTiming,
        slots_per_layer: int,
        layer_slots: Sequence[int] | None = None,
    ) -> Plan:
        """The policy's plan, each layer's list checked against that layer's slots (`layer_slots`, the cache's own
        counts, which the policy does not see; None: `slots_per_layer` in every layer)."""
        plan = self._call(
            "plan",
            route_counts=route_counts,
            resident=resident,
            steps_done=steps_done,
            k=k,
            timing=timing,
            slots_per_layer=slots_per_layer,
        )
        if not isinstance(plan, Plan):
            raise self._wrong("plan", f"{type(plan).__name__} is not a specter.policy.Plan")
        num_layers, num_experts = np.shape(route_counts)
        experts = {}
        for layer, listed in self._layers(plan.experts, "experts", num_layers):
            own = layer_slots[layer] if layer_slots is not None and 0 <= layer < len(layer_slots) else slots_per_layer
            experts[layer] = self._layer_plan(layer, self._ids("plan", listed, f"layer {layer}'s experts"), num_experts, own)
        scores = {layer: self._layer_scores(layer, scored, num_experts)
                  for layer, scored in self._layers(plan.scores, "scores", num_layers)}
        # The engine and the eviction policy read this copy, never the policy's object: read-only, so an eviction
        # policy cannot edit the plan under the engine, and a Plan subclass's own methods are not the engine's.
        return Plan(experts=MappingProxyType({layer: tuple(ids) for layer, ids in experts.items()}),
                    scores=MappingProxyType({layer: MappingProxyType(scored) for layer, scored in scores.items()}))

    def _layers(self, mapping: Any, field: str, layers: int) -> list[tuple[int, Any]]:
        if not isinstance(mapping, Mapping):
            raise self._wrong("plan", f"Plan.{field} {abbreviate(mapping)} is not a mapping of layer -> ...")
        with self._reading("plan"):
            items = list(mapping.items())
        bad = [layer for layer, _ in items
               if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layers]
        if bad:
            raise self._wrong("plan", f"Plan.{field} names layers {abbreviate(bad)}, not ints in 0..{layers - 1}")
        return [(int(layer), value) for layer, value in items]

    def _layer_plan(self, layer: int, experts: list[int], num_experts: int, slots: int) -> list[int]:
        if len(experts) > slots or len(set(experts)) != len(experts):
            raise self._wrong("plan", f"layer {layer} lists {abbreviate(experts)}: not at most {slots} distinct experts")
        if any(not 0 <= expert < num_experts for expert in experts):
            raise self._wrong("plan", f"layer {layer} lists {abbreviate(experts)}: ids outside 0..{num_experts - 1}")
        return experts

    def _layer_scores(self, layer: int, scored: Any, num_experts: int) -> dict[int, float]:
        if not isinstance(scored, Mapping):
            raise self._wrong("plan", f"layer {layer}'s scores {abbreviate(scored)} are not a mapping of expert -> weight")
        ids = self._ids("plan", scored.keys(), f"layer {layer}'s scored experts")
        if any(not 0 <= expert < num_experts for expert in ids):
            raise self._wrong("plan", f"layer {layer} scores {abbreviate(ids)}: ids outside 0..{num_experts - 1}")
        with self._reading("plan"):
            weights = list(scored.values())
        if not all(isinstance(w, (int, float, np.integer, np.floating)) and not isinstance(w, bool) and math.isfinite(w)
                   for w in weights):
            raise self._wrong("plan", f"layer {layer}'s score weights {abbreviate(weights)} are not finite numbers")
        return dict(zip(ids, map(float, weights), strict=True))


class GuardedLookahead(_Guarded):
    """A lookahead policy whose next_k() is checked to lie in 0..k_max."""

    def next_k(self, state: LookaheadState) -> int:
        k = self._call("next_k", state=state)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= state.k_max:
            raise self._wrong("next_k", f"{k!r} is not an int in 0..{state.k_max}")
        return int(k)

    def observe(self, outcome: RoundOutcome) -> None:
        self._call("observe", outcome=outcome)


class GuardedPlacement(_Guarded):
    """A placement policy whose place() is checked: a `Placement` of every MoE layer with ids in range; and whose
    optional place_prefill() is checked too (its host experts within the decode placement's), `decode` without one.
    The state it is given is read-only (`PlacementState`): the engine keeps it for its record and the prompts' calls."""

    _at_load = frozenset({"place", "prices_misses"})  # place_prefill runs before each prompt, on the event loop

    def place(self, state: PlacementState) -> Placement:
        return self._checked("place", self._call("place", state=state), state)

    def prices_misses(self, state: PlacementState) -> bool:
        """The policy's optional answer (True where it has none): whether it can price a speculating engine's misses."""
        if not hasattr(self.policy, "prices_misses"):
            return True
        answer = self._call("prices_misses", state=state)
        if not isinstance(answer, (bool, np.bool_)):
            raise self._wrong("prices_misses", f"{abbreviate(answer)} is not a bool")
        return bool(answer)

    def place_prefill(self, state: PlacementState, decode: Placement, rows: int) -> Placement:
        if not hasattr(self.policy, "place_prefill"):
            return decode
        placement = self._checked("place_prefill", self._call("place_prefill", state=state, decode=decode, rows=rows), state)
        outside = {layer: sorted(experts - decode.host[layer]) for layer, experts in enumerate(placement.host)
                   if not experts <= decode.host[layer]}
        if outside:
            raise self._wrong("place_prefill", f"host experts outside the decode placement's (layer: experts) {outside}; a "
                                               "prompt may only move decode host experts to the device")
        return placement

    def _checked(self, method: str, placement: Any, state: PlacementState) -> Placement:
        if not isinstance(placement, Placement):
            raise self._wrong(method, f"{type(placement).__name__} is not a specter.placement.Placement")
        if placement.num_layers != state.num_layers or placement.num_experts != state.num_experts:
            raise self._wrong(method, f"a placement of {placement.num_layers} layers x {placement.num_experts} experts "
                                      f"for a model of {state.num_layers} x {state.num_experts}")
        host = []
        for layer, experts in enumerate(placement.host):
            ids = self._ids(method, experts, f"layer {layer}'s host experts")
            if any(not 0 <= expert < state.num_experts for expert in ids):  # Placement's own check is an assert
                raise self._wrong(method, f"layer {layer}'s host experts {abbreviate(sorted(ids))} are outside "
                                          f"0..{state.num_experts - 1}")
            host.append(frozenset(ids))
        # A copy of frozensets: the policy's own sets, if it kept them, could change the placement after load, and
        # the cache and the host path would then disagree on which experts each computes.
        return Placement(tuple(host), state.num_experts)

