"""The compared systems, all configurations of one engine (benchmarks/README.md, "Systems"), and the runtime hooks they need.

`BenchRuntime` is the engine's `Runtime` plus what a benchmark needs and serving does not: switching the
policies, the expert-slot count and the emulated link between runs without reloading the weights, the
next-layer gate predictor (`gate-prefetch`) and the replay of recorded routes (`exact-prefetch`). It overrides no part of
the round: its books (`BenchBooks`) are an observer and the plan source, a replayed schedule a lookahead policy.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import torch

from specter import plugins
from specter.bench.hf_baseline import SYSTEM as HF_SYSTEM
from specter.config import DraftConfig, EngineConfig
from specter.errors import BudgetError, ConfigError
from specter.experts.transfer import LinkEmulation, parse_link
from specter.build import (OFF, apply_placement, chosen_kernel, drafts_rounds, model_host_kernels, new_cache, placement_policy,
                           placement_state, wants_own_profile)
from specter.experts.costs import Calibration, HostKernel, calibrate
from specter.experts.host import default_threads
from specter.engine import OwnProfile, Runtime
from specter.log import get_logger
from specter.memory import MemoryPlan, plan_memory, split_slots
from specter.placement import OVERLAP, Placement, PlacementState, decision_record, fill_slots, layer_counts
from specter.replay import fewest_loads
from specter.metrics import Estimates, RequestStats
from specter.model.spec import ModelSpec
from specter.observers import RoundObserver, RoundReport
from specter.policy import LookaheadState, Plan, RoundOutcome, UseHistory
from specter.verify import OffloadedExperts
from specter.victims import UseClock

log = get_logger(__name__)

Tensor = torch.Tensor
Routes = list[dict[int, list[int]]]
"""One request's verify routes: per round, compact MoE layer -> experts the target used."""


@dataclasses.dataclass(frozen=True)
class System:
    """One compared system: engine policies plus the bench hooks it switches on."""

    name: str
    description: str
    eviction: str = "lru"
    prefetch: str = "none"
    prefetch_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lookahead: str = "fixed"
    k: int | None = 0
    """Draft depth for the fixed lookahead; None: the bench's --k."""
    resident: bool = False
    gate_prefetch: bool = False
    exact_prefetch: bool = False
    """Prefetches, before each round, the experts its verify will use (recorded in an untimed pass), Belady eviction."""
    separate_draft: bool = False
    """Pays for a separate copy of the non-expert weights and its own KV out of the expert slots."""
    scout: bool = False
    """Plain rounds run one draft step first and prefetch the experts it routes to (DraftConfig.scout)."""
    overlap: int | None = 0
    """Draft-ahead steps beside each verify (DraftConfig.overlap); 0: off; None: the engine's default (16 on CUDA
    with CUDA graphs, off on the CPU)."""
    replay_schedule: bool = False
    """An exact-prefetch system that replays the depth of every round of the `specter` run just before it (same cell)."""
    cpu_experts: str = "off"
    """Its placement (EngineConfig.cpu_experts), made from the cell's starting cache; its tokens are held to the same
    placement's k = 0 run from the same start (`ModelBench._placement_baseline`), since a host-path expert rounds
    as the host does."""
    placement_overlap: float | None = None
    """`auto`'s overlap for this system (1: a layer priced at the longer of its host and copy paths, 0: their sum);
    None: the bench's --placement-overlap, else auto's own."""

    @property
    def speculative(self) -> bool:
        """Needs the draft (and its memory): it drafts, or it scouts."""
        return self.lookahead != "fixed" or self.k != 0 or self.scout


SYSTEMS: dict[str, System] = {
    system.name: system
    for system in (
        System("resident", "every expert on the device, target alone (k=0): the ceiling", resident=True),
        System("ondemand", "Mixtral-Offloading: k=0, per-layer LRU slots, load on miss, hits first"),
        System("gate-prefetch", "k=0; at each MoE layer the next layer's router on the current hidden rows prefetches "
                                "its top experts (AdapMoE-style)", gate_prefetch=True),
        System("specmoeoff", "SpecMoEOff as adapted by the Specter authors: k=3, frequency Top-M prefetch at 20 % and 60 % "
                             "of the draft, LRU; separate draft weights and KV taken out of the expert slots",
               prefetch="topm-frequency", prefetch_options={"fractions": (0.2, 0.6)}, k=3, separate_draft=True),
        # `specter` adapts k with the roofline governor, which drafts deeper where acceptance pays and falls back to
        # k = 0 where the draft costs more than it saves, as a fixed k cannot (benchmarks/README.md says more).
        System("specter", "this design: plan-protect eviction, link-paced frequency Top-M prefetch that never displaces an "
                          "expert the draft routed to (topm-keep), roofline lookahead (k adapted per round), the engine's "
                          "default draft-ahead (on CUDA: up to 16 steps beside each verify)",
               eviction="plan-protect", prefetch="topm-keep", lookahead="roofline", k=None, overlap=None),
        System("specter-serial", "specter without the draft-ahead (each round drafts, then verifies)", eviction="plan-protect", prefetch="topm-keep",
               lookahead="roofline", k=None),
        System("specter-scout", "specter whose plain rounds (k = 0) first run one draft step and prefetch the experts "
                                "it routes the token to", eviction="plan-protect", prefetch="topm-keep",
               lookahead="roofline", k=None, scout=True),
        System("specter-overlap", "specter that drafts ahead beside each verify (up to 16 steps from a guess at the "
                                  "target's next token, kept when the verify takes every draft)", eviction="plan-protect",
               prefetch="topm-keep", lookahead="roofline", k=None, overlap=16),
        System("specter-topm", "specter with plain frequency Top-M prefetch (topm-frequency), which may load a routed expert "
                               "in place of another routed one",
               eviction="plan-protect", prefetch="topm-frequency", lookahead="roofline", k=None, overlap=None),
        System("specter-fixed", "specter with a fixed draft depth (--k)",
               eviction="plan-protect", prefetch="topm-keep", k=None),
        System("specter-fixed-overlap", "specter-fixed that drafts ahead beside each verify: the draft-ahead measured at "
                                        "one depth, against specter-fixed", eviction="plan-protect", prefetch="topm-keep",
               k=None, overlap=16),
        # The exact-prefetch systems know every future route, but they are no floor: they can move more decode bytes
        # than specter-fixed at the same k (same tokens, same routes): with fewer slots than a verify
        # uses per layer, the cache runs a rolling window in which Belady sees an expert the round already consumed and
        # one it still needs as both next used "this round", and the plan names the round's lowest expert ids (first
        # `slots`), not the first needed. report.exact_prefetch_flags notes every cell where a system beats them; the
        # floor on bytes is computed instead, per request, from its own rounds (decode_floor_loads).
        System("exact-prefetch", "same budget and k as specter-fixed; before each round the exact experts its verify will "
                                 "use (recorded in an untimed pass) are prefetched in layer order, Belady eviction on the "
                                 "recorded future; no floor (see the comment above)",
               eviction="belady", k=None, exact_prefetch=True),
        System("cpu-experts", "llama.cpp --n-cpu-moe / KTransformers in this engine: k=0, the cell's starting residents "
                              "stay on the device, every other expert is computed on the host CPU, nothing is copied",
               cpu_experts="all"),
        # The hybrids place with `auto` (policies/placement.py): the cell's link and the host calibrated once, placed
        # from the cell's starting cache; both are held to that placement's own k = 0 run, as cpu-experts is.
        System("specter-hybrid", "specter with --cpu-experts auto: of the non-resident experts, the least used that a cost "
                                 "model calibrated at load (copy vs host time per expert) puts on the host CPU, fixed for "
                                 "the cell, priced from a --placement-profile trace, else from the runtime's own (a "
                                 "speculating engine's misses need a trace's rounds); the others copied and prefetched "
                                 "as specter does",
               eviction="plan-protect", prefetch="topm-keep", lookahead="roofline", k=None, overlap=None, cpu_experts="auto"),
        System("specter-hybrid-longer", "specter-hybrid whose cost model prices a layer at the longer of its host and "
                                        "copy paths (auto's overlap 1), not their sum: it balances the two paths, so a "
                                        "layer's experts split between them (--placement-overlap 1 beside the default, "
                                        "in one process)",
               eviction="plan-protect", prefetch="topm-keep", lookahead="roofline", k=None, overlap=None, cpu_experts="auto",
               placement_overlap=1.0),
        System("ondemand-hybrid", "ondemand (k=0, LRU, load on miss) with --cpu-experts auto: the host computes what the "
                                  "cost model puts there, the rest is loaded on demand", cpu_experts="auto"),
        System("scout-k0", "plain decoding (k = 0) whose every round scouts: the scout measured alone, against ondemand",
               eviction="plan-protect", prefetch="topm-keep", k=0, scout=True),
        System("exact-prefetch-k0", "exact-prefetch without speculation: target alone (k=0), exact experts prefetched "
                                    "before each token", eviction="belady", k=0, exact_prefetch=True),
        System("exact-prefetch-specter", "exact-prefetch at specter's own depths: each round's k and verify routes as the "
                                         "specter run of the same cell had them (same tokens, so the same rounds), exact "
                                         "prefetch, Belady eviction, the same draft-ahead as specter",
               eviction="belady", k=None, exact_prefetch=True, replay_schedule=True, overlap=None),
    )
}
DEFAULT_SYSTEMS = ("resident", "ondemand", "gate-prefetch", "specmoeoff", "specter", "specter-fixed", "exact-prefetch",
                   "exact-prefetch-k0", "exact-prefetch-specter")
SCHEDULE_SOURCE = "specter"
"""The system whose rounds (depth and routes) `exact-prefetch-specter` replays; it must run earlier in the same cell."""


def get_system(name: str) -> System:
    if name not in SYSTEMS:
        raise ConfigError(f"no benchmark system named {name!r}; systems: {', '.join(SYSTEMS)}")
    return SYSTEMS[name]


CUSTOM_KEYS = {"like": "a built-in system to start from (default ondemand)", "eviction": "specter.eviction plug-in",
               "prefetch": "specter.prefetch plug-in", "lookahead": "specter.lookahead plug-in",
               "k": "draft depth (fixed lookahead; 0: no speculation)", "overlap": "draft-ahead steps beside a verify",
               "cpu-experts": "specter.placement plug-in (off, all, auto or another)"}
"""The keys of `--system NAME:KEY=VALUE,...`, and what each sets."""
_CUSTOM_GROUPS = {"eviction": "eviction", "prefetch": "prefetch", "lookahead": "lookahead", "cpu-experts": "placement"}


def custom_system(text: str) -> System:
    """A system of installed plug-ins, `NAME:KEY=VALUE,...` (`--system`): a policy author's own strategy beside the
    built-in ones, e.g. `mine:like=specter,eviction=my-eviction`. It starts from `like` (ondemand: k = 0, LRU, no
    prefetch) and takes its prefetch options only from it (a plug-in named here gets none). Each plug-in name is
    checked against what is installed, so a typo is refused before any model loads."""
    name, colon, body = text.partition(":")
    name = name.strip()
    if not colon or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--system {text!r}: expected NAME:KEY=VALUE,... (a name of letters, digits, '.', '_' or '-'), "
                          "e.g. mine:like=specter,eviction=my-eviction")
    if name in SYSTEMS or name == HF_SYSTEM:  # the HF baseline's rows are left out of the exactness verdict
        raise ConfigError(f"--system {name}: a built-in system has that name; choose another (built-in: "
                          f"{', '.join([*SYSTEMS, HF_SYSTEM])})")
    values: dict[str, str] = {}
    for item in (part.strip() for part in body.split(",")):
        key, equals, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not value or key not in CUSTOM_KEYS:
            raise ConfigError(f"--system {name}: {item!r} is not KEY=VALUE with a key of "
                              f"{', '.join(f'{k} ({what})' for k, what in CUSTOM_KEYS.items())}")
        if key in values:
            raise ConfigError(f"--system {name}: {key} given twice")
        values[key] = value
    like = values.pop("like", "ondemand")
    if like not in SYSTEMS or SYSTEMS[like].resident or SYSTEMS[like].exact_prefetch or SYSTEMS[like].gate_prefetch:
        plain = [n for n, s in SYSTEMS.items() if not (s.resident or s.exact_prefetch or s.gate_prefetch)]
        raise ConfigError(f"--system {name}: like={like} is not a built-in offloaded system it can start from; one of "
                          f"{', '.join(plain)}")
    base = SYSTEMS[like]
    changes: dict[str, Any] = {"name": name, "description": f"{text} (--system)"}
    for key, group in _CUSTOM_GROUPS.items():
        if key in values:
            found = plugins.installed(group)
            if values[key] not in found:
                raise ConfigError(f"--system {name}: no {group} plug-in named {values[key]!r} is installed; installed: "
                                  f"{', '.join(sorted(found))}")
            if not plugins.is_allowed(group, values[key]):
                raise ConfigError(f"--system {name}: the {group} plug-in {values[key]!r} is installed, but "
                                  f"{plugins.ALLOW_LIST_ENV} does not allow it; add it there, or name another")
            changes[key.replace("-", "_")] = values[key]
    if "prefetch" in values and values["prefetch"] != base.prefetch:
        changes["prefetch_options"] = {}  # `like`'s options belong to its own prefetch plug-in
    for key in ("k", "overlap"):
        if key in values:
            try:
                changes[key] = int(values[key])
            except ValueError:
                raise ConfigError(f"--system {name}: {key}={values[key]!r} is not a whole number") from None
            if changes[key] < 0:
                raise ConfigError(f"--system {name}: {key}={changes[key]} is below 0")
    return dataclasses.replace(base, **changes)


# ---- budgets ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setting:
    """A memory setting: expert slots per MoE layer, or a GPU budget in bytes."""

    residents: int | None = None
    budget: int | None = None

    @property
    def label(self) -> str:
        if self.residents is not None:
            return f"residents={self.residents}"
        if self.budget >= 2**30 / 100:  # the label stored results carry (budget=24.00GiB)
            return f"budget={self.budget / 2**30:.2f}GiB"
        return f"budget={self.budget / 2**20:.2f}MiB" if self.budget >= 2**20 / 100 else f"budget={self.budget}B"


def separate_draft_bytes(full_spec: ModelSpec, dtype: torch.dtype, max_context: int) -> int:
    """What a separate draft model costs on the device: a copy of the non-expert weights plus its own KV."""
    plan = plan_memory(full_spec, dtype, EngineConfig(max_context=max_context), speculative=False)
    return plan.dense_bytes + plan.kv_bytes


def system_slots(system: System, setting: Setting, spec: ModelSpec, full_spec: ModelSpec, dtype: torch.dtype,
                 max_context: int, k_max: int, expert_graphs: bool = False, quant: str = "int4",
                 row_bucket: int = 16) -> tuple[tuple[int, ...], str]:
    """Expert slots of each MoE layer of `spec` the system gets under `setting`, and a note on how they were derived.

    Residents: the same count in every layer for every system, except that specmoeoff loses the slots its separate draft
    would take at full depth (so `--layers` truncation does not shrink the penalty). Budget: the engine's
    memory plan for the (possibly truncated) model, with or without the quantized draft (one slot more in some
    layers where the budget holds more than a whole count per layer: `MemoryPlan.layer_slots`).
    """
    layers = len(spec.moe_layers)
    per_slot = len(full_spec.moe_layers) * full_spec.expert_bytes(_element(dtype))
    extra = separate_draft_bytes(full_spec, dtype, max_context) if system.separate_draft else 0
    if setting.residents is not None:
        lost = math.ceil(extra / per_slot) if extra else 0
        slots = min(setting.residents - lost, spec.num_experts)
        note = f"{setting.residents} - {lost} slots for a separate draft ({extra / 2**30:.2f} GiB)" if lost else ""
        if slots < 1:
            raise BudgetError(f"{system.name}: its separate draft ({extra / 2**30:.2f} GiB) takes all {setting.residents} slots per layer")
        return (slots,) * layers, note
    assert setting.budget is not None, "a setting has residents or a budget"
    truncated_extra = separate_draft_bytes(spec, dtype, max_context) if system.separate_draft else 0
    config = EngineConfig(budget=setting.budget - truncated_extra if truncated_extra < setting.budget else 1,
                          max_context=max_context, draft=DraftConfig(k_max=k_max, quant=quant), row_bucket=row_bucket)
    plan = plan_memory(spec, dtype, config, speculative=system.speculative, expert_graphs=expert_graphs)
    return plan.layer_slots, (f"budget minus separate draft {truncated_extra / 2**30:.2f} GiB" if truncated_extra else "")


def _element(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- the bench's books, exact-prefetch's eviction and depths ---------------------------------------------------

class BenchBooks(RoundObserver):
    """What a benchmark keeps per request beside the engine's stats: the round index, the verify routes and depths a
    run records, the routes and depths exact-prefetch replays, and its predictor's recall (gate or exact-prefetch).

    Plugged into the runtime as an observer and as its plan source: before each draft exact-prefetch prefetches exactly
    the routes recorded for the round (`plan_before_draft`).
    """

    def __init__(self, layer_slots: Callable[[], Sequence[int]]) -> None:
        self.layer_slots = layer_slots
        self.round_index = 0
        self.replayed_routes: Routes | None = None
        self.recorded_routes: Routes | None = None
        self.recorded_depths: list[int] | None = None
        self.replayed_depths: list[int] | None = None
        self.next_uses: list[dict[int, list[int]]] = []
        self.gate_predicted: dict[int, set[int]] = {}
        self.predictor_hits = 0
        self.predictor_total = 0

    def forget(self) -> None:
        """A new system: nothing recorded, nothing to replay."""
        self.replayed_routes, self.recorded_routes = None, None
        self.recorded_depths, self.replayed_depths = None, None

    def replay_routes(self, routes: Routes, layers: int) -> None:
        self.replayed_routes = routes
        self.next_uses = [dict() for _ in range(layers)]
        for index, used in enumerate(routes):
            for layer, experts in used.items():
                for expert in experts:
                    self.next_uses[layer].setdefault(expert, []).append(index)

    def next_use(self, layer: int, expert: int) -> float:
        """The first round from now on in which the target uses `expert` of `layer` (inf: never)."""
        rounds = self.next_uses[layer].get(expert, []) if self.next_uses else []
        position = bisect.bisect_left(rounds, self.round_index)
        return rounds[position] if position < len(rounds) else math.inf

    def score(self, predicted: Set[int], used: Sequence[int]) -> None:
        self.predictor_hits += len(set(predicted).intersection(used))
        self.predictor_total += len(used)

    # -- as the runtime's plan source and observer --------------------------------------------------------
    def plan_before_draft(self, k: int) -> Plan | None:
        if self.replayed_routes is None or self.round_index >= len(self.replayed_routes):
            return None
        slots = self.layer_slots()
        return Plan(experts={layer: experts[:slots[layer]] for layer, experts in self.replayed_routes[self.round_index].items()})

    def request_started(self, stats: RequestStats) -> None:
        self.round_index = 0
        self.gate_predicted = {}

    def prefilled(self, stats: RequestStats) -> None:
        self.predictor_hits = self.predictor_total = 0  # score the rounds only, as window recall does
        if self.recorded_routes is not None:
            self.recorded_routes.clear()
        if self.recorded_depths is not None:
            self.recorded_depths.clear()

    def round_done(self, report: RoundReport) -> None:
        if report.verify is not None:
            index = {layer: i for i, layer in enumerate(report.moe_layers)}
            used = {index[layer]: sorted(experts) for layer, experts in report.verify.used.items()}
            if self.recorded_routes is not None:
                self.recorded_routes.append(used)
            if self.replayed_routes is not None and self.round_index < len(self.replayed_routes):
                predicted = self.replayed_routes[self.round_index]
                for layer, experts in used.items():
                    self.score(set(predicted.get(layer, ())), experts)
        if self.recorded_depths is not None:
            self.recorded_depths.append(report.k)
        self.round_index += 1


class BeladyEviction:
    """Belady's rule on the recorded future: evict the resident used again farthest ahead (never: first)."""

    name = "belady"

    def __init__(self, books: BenchBooks) -> None:
        self.books = books

    def victims(self, layer: int, residents: Sequence[int], protected: Set[int], count: int, history: UseHistory,
                plan: Plan | None) -> list[int]:
        candidates = [expert for expert in residents if expert not in protected]
        return sorted(candidates, key=lambda expert: (-self.books.next_use(layer, expert), expert))[:count]


class ReplayedDepths:
    """A lookahead policy that, while the books replay a schedule, runs round r at the depth the recorded run chose
    (0 past its end); the wrapped policy still sees every call, as in the recorded run. Otherwise it is the policy."""

    def __init__(self, policy: Any, books: BenchBooks) -> None:
        self.policy, self.books = policy, books

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def next_k(self, state: LookaheadState) -> int:
        k = self.policy.next_k(state=state)
        depths, index = self.books.replayed_depths, self.books.round_index
        if depths is None:
            return k
        return depths[index] if index < len(depths) else 0  # the runtime clamps it as it clamped the recorded run's

    def observe(self, outcome: RoundOutcome) -> None:
        self.policy.observe(outcome=outcome)


# ---- the runtime ----------------------------------------------------------------------------------------

class BenchRuntime(Runtime):
    """A Runtime whose system (policies, hooks), slot count and link can change between requests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.books = BenchBooks(lambda: self.cache.layer_slots)
        super().__init__(*args, observers=[self.books], plan_source=self.books, **kwargs)
        self.system: System | None = None
        self.depth = 0  # the configured system's depth (its own k, else the bench's --k)
        self.link_gbps: float | None = None
        """The link `set_link` emulates (None: the real one)."""
        self.calibrations: dict[int, Calibration] = {}
        """Host thread count -> the host's and the real link's costs, measured at the first placement with that count
        (`use_placement`): an expert's host time depends on the threads that compute it."""
        self.own_profile: OwnProfile | None = None
        """The engine's own routing trace (`Runtime.own_routing_profile`), recorded at the first placement that needs
        one (no --placement-profile, a speculating system) under that cell's system, link and slots, and priced for
        every later one: as a deployed engine records it once at load."""
        self.host_kernel_choices: list[HostKernel] | None = None
        """The host kernels the calibrations choose from (`_host_kernels`)."""
        self.host_threads: int | None = None
        """The torch threads of the placement's host path (and of the calibration it was placed from); None: 'off'."""
        self.placement_decision: dict | None = None
        """What the cell's placement was decided from and what the cost model predicts of it (`decision_record`, with
        the policy's own overlap and prefetch discount); None: 'off'."""
        moe = self.spec.moe_layers
        self._next_moe_layer = dict(zip(moe, moe[1:]))

    # -- switching systems ------------------------------------------------------------------------------
    def configure(self, system: System, k: int) -> None:
        """Policies, estimates, use history and hooks of `system`; `k` is the fixed depth where it has none."""
        depth = self.depth = system.k if system.k is not None else k
        if system.speculative and self.draft is None:
            raise ConfigError(f"system {system.name} needs a draft, but this runtime was built without one")
        self.system = system
        self.eviction = BeladyEviction(self.books) if system.exact_prefetch else plugins.load_policy("eviction", system.eviction)
        self.prefetch = plugins.load_policy("prefetch", "none" if system.exact_prefetch else system.prefetch, **dict(system.prefetch_options))
        options = {"k": depth} if system.lookahead == "fixed" else {}
        self.lookahead = ReplayedDepths(plugins.load_policy("lookahead", system.lookahead, **options), self.books)
        self.scout = system.scout
        self.ahead.depth = system.overlap if system.overlap is not None else self.config.draft.overlap_steps(
            self.model.device.type, self.config.cuda_graphs)
        self.k_max = self.config.draft.k_max if self.draft is not None else 0
        self.estimates = Estimates(self.k_max)
        self.uses = UseClock(len(self.spec.moe_layers))
        self.books.forget()
        if isinstance(self.experts, OffloadedExperts):
            self.experts.on_routed = self._gate_prefetch if system.gate_prefetch else None

    async def use_slots(self, slots: Sequence[int]) -> None:
        """Rebuild the expert cache with `slots` in each MoE layer over the same host pool (no reload, no re-pinning).

        Below the engine's minimum (top-k slots) the cache still works as a rolling window; the paper's
        Phi-3.5-MoE setting of 1 resident per layer needs that.
        """
        old = self.cache
        assert old is not None, "use_slots needs an offloaded runtime"
        slots = tuple(slots)
        if slots == old.layer_slots:
            return
        await old.aclose()
        transfer, pool = old.transfer, old.pool
        if isinstance(self.experts, OffloadedExperts):
            self.experts.close()  # its host path goes with it (`use_placement` makes the next one)
        self.cache = self.experts = old = None  # free the old slots before allocating the new ones
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        tuning = self.config.tuning
        self.cache = new_cache(self.config, slots, self.backend, self.kernel, transfer, pool, self.victims)
        self.experts = OffloadedExperts(self.cache, self.kernel, self.moe_index, tuning=tuning.verify)
        fewest, extra = split_slots(slots)  # the plan's bytes: its slot count (a warm-up's cache may not be one plan's spread)
        self.memory = dataclasses.replace(self.memory, slots_per_layer=fewest, extra_slots=extra)
        if self.segmented is not None:  # the old slots' expert graphs are stale: capture the new ones now, untimed
            self.segmented.reset_experts()
            self.segmented.prepare_experts([self.cache.slot_weights(slot) for slot in range(self.cache.weights.shape[0])])
        if self.system is not None:
            self.experts.on_routed = self._gate_prefetch if self.system.gate_prefetch else None

    async def use_placement(self, name: str, initial: Sequence[Sequence[int]] | None = None,
                            threads: int | None = None, overlap: float | None = None) -> Placement | None:
        """Place the experts as the `specter.placement` plug-in `name` does from a cache that holds `initial` (per layer;
        None: what it holds now), between requests: the bench's cells start from different caches, and each cell's
        placement is fixed for all of its requests. `threads`: the host path's torch threads, for the calibration the
        policy decides from and for the path itself (None: the engine's `cpu_threads`). `overlap`: the plug-in's, as
        EngineConfig.placement_overlap gives it (the builder's `placement_policy` loads it). 'off': no host path.
        Returns the placement (None for 'off')."""
        assert isinstance(self.experts, OffloadedExperts) and self.cache is not None, "use_placement needs an offloaded runtime"
        self.experts.close()
        self.experts.host = None
        self.cache.place([frozenset()] * self.cache.num_layers)
        self.host_threads = self.placement_decision = None
        if name == OFF:
            return None
        self.host_threads = threads or self.config.cpu_threads or default_threads()
        state = await self._placement_state(initial, self.host_threads)
        policy = placement_policy(self.config.model_copy(update={"cpu_experts": name, "placement_overlap": overlap}))
        if wants_own_profile(policy, state, self.config):  # as the engine's load would, once for every cell
            if self.own_profile is None:
                assert self.system is not None, "the own profile decodes as the cell's system does"
                self.own_profile = await self.own_routing_profile()
                self.configure(self.system, self.depth)  # estimates, use history and books afresh, as the cell starts
            state, profile = self.own_profile.apply(state), "own"
        else:
            profile = "given" if self.config.placement_profile is not None else None
        placement = policy.place(state=state)
        self.placement_decision = decision_record(state, placement, getattr(policy, "prefetch_discount", 0.0),
                                                  getattr(policy, "overlap", OVERLAP)) | {"profile": profile}
        if placement.active:
            self.experts.host = await apply_placement(placement, self.cache, self.config, self.model.device,
                                                     chosen_kernel(self._host_kernels(), state), policy, state)
        return placement

    def own_profile_depth(self) -> int:
        """The cell's system's: its fixed depth, else k_max (`Runtime.own_profile_depth`)."""
        if self.system is not None and self.system.lookahead == "fixed":
            return min(self.depth, self.k_max)
        return self.k_max

    async def _placement_state(self, initial: Sequence[Sequence[int]] | None, threads: int) -> PlacementState:
        """What a placement policy sees at a cell's start: the cache holding `initial`, the cell's link (emulated, else
        the real one probed once), the host calibrated once per thread count (never the transfer engine's running
        estimate) and whether the cell's system speculates, so that a placement depends on the cell and system only
        (the placement baseline is shared by the cell's systems that get the same placement)."""
        state = dataclasses.replace(placement_state(self.cache, self.config, self.spec), link_bytes_per_s=None,
                                    host_threads=threads)
        if self.system is not None:  # the cell's system speculates, not the config the runtime was built with
            state = dataclasses.replace(state, eviction=self.system.eviction, prefetch=self.system.prefetch,
                                        speculates=self.draft is not None and drafts_rounds(self.system.lookahead, self.depth))
        if initial is not None:
            state = dataclasses.replace(state, initial_residents=tuple(tuple(layer) for layer in initial))
        if threads not in self.calibrations:
            self.calibrations[threads] = await calibrate(self.kernel, self.cache.pool, self._host_kernels(), state,
                                                         self.spec.hidden_size, self.model.device, self.config.placement_profile,
                                                         self.config.tuning.host.parallel_experts)
        link = self.link_gbps * 1e9 if self.link_gbps is not None else None
        return self.calibrations[threads].apply(dataclasses.replace(state, link_bytes_per_s=link))

    def _host_kernels(self) -> list[HostKernel]:
        """The host kernels the calibration chooses from (built once: the native one compiles on first use)."""
        if self.host_kernel_choices is None:
            self.host_kernel_choices = model_host_kernels(self.model, self.config, self.cache.pool.dtype)
        return self.host_kernel_choices

    def set_link(self, link: str | None) -> None:
        """Emulate `link` (preset or GB/s; None or 'native': the real link) for the copies from now on."""
        gbps = None if link in (None, "native") else parse_link(link)
        self.link_gbps = gbps
        if self.cache is None:
            return
        if self.backend.name == "cpu":
            from backends.cpu import LinkModel

            self.backend.link = LinkModel(gbps) if gbps is not None else None
        else:
            self.cache.transfer.link = LinkEmulation(gbps) if gbps is not None else None
        self.cache.transfer.forget_bandwidth()  # re-measure: the link just changed

    async def aclose(self) -> None:
        transfer = self.cache.transfer if self.cache is not None else None
        await super().aclose()
        if transfer is not None:
            await transfer.aclose()  # stop its pump task before the event loop closes

    @property
    def predictor_recall(self) -> float | None:
        """Share of the target's used experts the system's own predictor (gate or exact-prefetch) had named."""
        return self.books.predictor_hits / self.books.predictor_total if self.books.predictor_total else None

    # -- exact-prefetch --------------------------------------------------------------------------------------
    def record_routes(self) -> Routes:
        """From the next request on, keep each round's verify routes in the returned list."""
        self.books.recorded_routes = []
        return self.books.recorded_routes

    def record_schedule(self) -> tuple[list[int], Routes]:
        """From the next request on, keep each round's depth and verify routes in the returned lists."""
        self.books.recorded_depths = []
        return self.books.recorded_depths, self.record_routes()

    def replay_schedule(self, depths: list[int], routes: Routes) -> None:
        """Run round r at depth `depths[r]` and prefetch exactly `routes[r]` before it."""
        self.books.replayed_depths = depths
        self.replay_routes(routes)

    def replay_routes(self, routes: Routes) -> None:
        """Prefetch exactly `routes[r]` before round r (same tokens and k, so the same routes)."""
        self.books.replay_routes(routes, len(self.spec.moe_layers))

    # -- gate-prefetch ------------------------------------------------------------------------------------
    def _gate_prefetch(self, layer: int, hidden: Tensor, used: list[int]) -> None:
        """The verify's on_routed hook: score the last prediction for `layer`, then predict the next MoE layer."""
        if layer in self.books.gate_predicted:
            self.books.score(self.books.gate_predicted.pop(layer), used)
        following = self._next_moe_layer.get(layer)
        if following is None or self.cache is None:
            return
        logits = self.model.route_logits(following, hidden)  # [T, E]
        chosen = torch.topk(logits.float(), self.spec.top_k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=self.spec.num_experts)
        # Host sync (a GEMV after the router we just awaited): the prediction must reach the cache now.
        order, votes = torch.argsort(counts, descending=True, stable=True).tolist(), counts.tolist()
        ranked = [expert for expert in order if votes[expert] > 0]
        predicted = ranked[: self.cache.layer_slots[self.moe_index[following]]]
        self.books.gate_predicted[following] = set(predicted)
        self.cache.prefetch(self.moe_index[following], predicted)


def decode_floor_loads(routes: Routes, slots: Sequence[int]) -> int:
    """A lower bound on the expert loads of a request's decode rounds (`routes`, recorded after the prompt) for any
    system with `slots` in each MoE layer: per layer, fewest_loads less the slots' experts the prompt may have left
    resident (the state after the prompt is free to be the best one)."""
    return sum(max(0, fewest_loads([round_.get(layer, ()) for round_ in routes], count) - count) for layer, count in enumerate(slots))


def initial_state(snapshot_layers: Sequence[Sequence[int]], slots: int | Sequence[int], num_experts: int,
                  rates: Sequence[Sequence[float]] | None = None) -> tuple[tuple[int, ...], ...]:
    """A snapshot cut to `slots` per layer (one count for all, or one each), keeping the most recently used (the tail
    of the LRU order), and a layer the warm-up left short of its slots filled as `kept_on_device`
    (policies/placement.py) fills it (`fill_slots`: the most used others by `rates`, per layer and expert, the
    placement profile's use counts; else the lowest other ids), the fill first in LRU order (least recent), so a
    placement keeps on the device what it would have kept.

    Every cell starts with full slots. A placement that never copies (`cpu-experts`) keeps its starting residents for
    the whole cell, so a slot left empty at the start would stay empty: after a warm-up that used few of a layer's
    experts, `cpu-experts` would compute on the host, every token, experts that a filled cache holds."""
    cells = []
    counts = layer_counts(slots, len(snapshot_layers))
    for index, (layer, count) in enumerate(zip(snapshot_layers, counts, strict=True)):
        used = rates[index] if rates is not None and index < len(rates) and len(rates[index]) == num_experts else None
        kept, fill = fill_slots(layer, count, num_experts, used)
        cells.append(tuple(fill + kept))
    return tuple(cells)


def memory_summary(memory: MemoryPlan) -> dict[str, int]:
    return {name: getattr(memory, name) for name in ("dense_bytes", "draft_bytes", "kv_bytes", "expert_bytes", "slots_per_layer",
                                                     "extra_slots")}
