"""Engine and generation configuration: frozen pydantic models, every field described and validated."""

from __future__ import annotations

import contextvars
import math
import numbers
import operator
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from specter.errors import ConfigError
from specter.paths import json_value

MIN_CONTEXT = 8
"""The shortest context the engine runs (EngineConfig.max_context's floor: a prompt token and a verify block)."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte count: an integer, or a string such as "24GiB", "512MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count such as 24GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if not 1 <= value < math.inf:  # 0.5 would truncate to 0 bytes; inf and NaN are no size
            raise ValueError(f"a byte count must be a whole number of bytes from 1, got {value!r}")
        return int(value)
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a size; use bytes or a number with a unit (KiB, MiB, GiB, KB, MB, GB), e.g. 24GiB")
    number = match.group(1)
    try:  # a whole number stays exact (a float would round 2**53 + 1); a fraction goes through float
        size = int(number) * _UNITS[unit] if number.isdigit() else int(float(number) * _UNITS[unit])
    except OverflowError:
        raise ValueError(f"{value!r} is too large to be a size") from None
    if size <= 0:
        raise ValueError(f"a byte count must be positive, got {value!r}")
    if not unit and size < _UNITS["mib"]:
        # A bare number is bytes; written by hand below a MiB it is a unit left out (`--budget 24`), not a budget.
        raise ValueError(f"{value!r} is {size} bytes; give a unit, e.g. {number}MiB or {number}GiB (a number without "
                         "one is bytes)")
    return size


LINK_PRESETS: dict[str, float] = {
    "gen5": 55.0,
    "gen4": 25.0,
    "gen3": 12.0,
    # A Gen4 x16 GPU in a dual-channel DDR4-3200 desktop: pinned H2D measures about 20-22 GB/s, below an
    # idle Gen4 link's 25 because the DMA shares the memory controller with the CPU. We take 20.
    "ddr4-desktop": 20.0,
}
"""Link emulation presets, in GB/s (1e9 bytes per second) of sustained pinned H2D bandwidth."""


def split_list(text: str, what: str = "value") -> list[str]:
    """A comma-separated option's values (each a `what`), stripped; none at all (`,`) is []; an empty one among others
    (`6,,4`, a trailing comma) is a typo, not a skip (a value may have been lost there): ConfigError."""
    parts = [part.strip() for part in text.split(",")]
    if any(parts) and not all(parts):
        raise ConfigError(f"an empty {what} in {text!r} (a doubled, leading or trailing comma); list the {what}s "
                          "separated by single commas")
    return [part for part in parts if part]


def parse_link(spec: str | float | None) -> float | None:
    """GB/s for a link spec: a preset name (gen5, gen4, gen3, ddr4-desktop), a number, or None (no emulation)."""
    if spec is None:
        return None
    if isinstance(spec, str) and spec.strip().lower() in LINK_PRESETS:
        return LINK_PRESETS[spec.strip().lower()]
    try:
        gbps = float(spec)
    except ValueError:
        gbps = -1.0
    if not MIN_LINK_GBPS <= gbps < math.inf:
        presets = ", ".join(f"{name} ({gbps:g} GB/s)" for name, gbps in LINK_PRESETS.items())
        raise ConfigError(f"link {spec!r} is not a link preset or a GB/s figure from {MIN_LINK_GBPS:g}; use one of "
                          f"{presets}, or e.g. 32")
    return gbps


MIN_LINK_GBPS = 1e-3
"""The slowest link emulated, 1 MB/s: a megabyte expert then takes a second. Slower ones only hang a run (at 1e-9 a
copy sleeps for years, past Ctrl-C) or overflow the link model's clock."""


ByteCount = Annotated[int, BeforeValidator(parse_bytes)]

QuantName = Literal["int4", "int8", "int3", "int2", "gptq4"]
SamplingRule = Literal["coupled", "rejection"]


_CONSTRUCTING: contextvars.ContextVar[int] = contextvars.ContextVar("specter_config_constructing", default=0)
"""How many configuration constructors are running in this context (`_Frozen.__init__`)."""


class _Frozen(BaseModel):
    """A configuration whose constructor raises ConfigError, one line per bad field, value and rule (pydantic's own
    ValidationError, several lines with a link to its docs, is no SpecterError: the API's callers and the tools catch
    those). A nested configuration given as a mapping is validated by its parent, whose error names its path."""

    # allow_inf_nan: NaN was refused as out of range ("less than or equal to 1"), inf as too large; both are no setting
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    def __init__(self, *positional: Any, **values: Any) -> None:
        if positional:  # pydantic's own message is a TypeError about `__init__`'s arguments
            raise ConfigError(f"{type(self).__name__} takes its fields by name, e.g. {_EXAMPLES.get(type(self).__name__, type(self).__name__ + '(...)')}; "
                              f"got {len(positional)} positional value(s)")
        # pydantic runs a model's own __init__ for a nested one given as a mapping too: only the outermost turns the
        # error into a ConfigError, so the nested one's ValidationError reaches it with its path.
        depth = _CONSTRUCTING.set(_CONSTRUCTING.get() + 1)
        try:
            super().__init__(**values)
        except ValidationError as error:
            if _CONSTRUCTING.get() > 1:
                raise
            raise ConfigError(describe_validation_error(type(self).__name__, error)) from None
        finally:
            _CONSTRUCTING.reset(depth)

    def __setattr__(self, name: str, value: Any) -> None:
        # A configuration is shared by what was built from it (a runtime reads it once), so it is never changed in
        # place; pydantic's own error here is a multi-line ValidationError that names no way out.
        kind = type(self).__name__
        if name not in type(self).model_fields:  # a typo (`config.resident = 4`): no field to build one with either
            raise ConfigError(f"{kind} has no field {name!r}; its fields: {', '.join(type(self).model_fields)}")
        if kind in ("EngineConfig", "GenerationConfig"):
            how = (f"build one with the value instead, e.g. {_EXAMPLES[kind]}, or from another: "
                   f"{kind}(**{{**old.model_dump(), '{name}': value}})")
        else:  # a section, built through its EngineConfig
            how = f"give it when the EngineConfig is built, e.g. {_EXAMPLES['EngineConfig']} (on the command line: its options, --tune SECTION.FIELD=VALUE)"
        raise ConfigError(f"{kind} is immutable: {name} cannot be set on it; {how}")

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, values: object) -> object:
        # pydantic's lax mode reads True as 1: EngineConfig(residents=True) loaded with one slot a layer
        if isinstance(values, dict):
            for name, value in values.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _number_not_bool(field.annotation):
                    raise ValueError(f"{name} = {value}: must be a number, not bool {value!r}")
        return values

    def __delattr__(self, name: str) -> None:
        raise ConfigError(f"{type(self).__name__} is immutable: {name} cannot be deleted from it; build one without it")

    @classmethod
    def build(cls, **values: object) -> "_Frozen":
        """The constructor (kept for callers that name the conversion): ConfigError naming each bad field."""
        return cls(**values)


def _number_not_bool(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float and not a bool (Optional and Annotated looked through)."""
    kinds, stack = set(), [annotation]
    while stack:
        kind = stack.pop()
        arguments = typing.get_args(kind)
        if arguments and typing.get_origin(kind) is not Literal:
            stack.extend(arguments)
        else:
            kinds.add(kind)
    return bool(kinds & {int, float}) and bool not in kinds


_EXAMPLES = {
    "EngineConfig": "EngineConfig(residents=4, tuning={'kernels': {'static_mla': False}})",
    "GenerationConfig": "GenerationConfig(max_new_tokens=64, temperature=0.7)",
}
"""How each configuration is built, for the errors of one used another way (a section is built through its parent)."""


def describe_validation_error(model: str, error: ValidationError) -> str:
    """Each invalid field with the value given and what is allowed, or a rule between fields in its own words: one
    line for one problem (the CLI prints it after `error: `)."""
    problems = []
    for item in error.errors():
        reason = item["msg"].removeprefix("Value error, ")
        if item["loc"]:
            problems.append(f"{model}.{'.'.join(str(part) for part in item['loc'])} = {item.get('input')!r:.200}: {reason}")
        else:  # a rule across fields: its input is the whole model, which says nothing the rule does not
            problems.append(f"{model}: {reason}")
    if len(problems) == 1:
        return f"invalid configuration: {problems[0]}"
    return "invalid configuration:\n  " + "\n  ".join(problems)


DEFAULT_K = 4
"""Draft depth of the `fixed` lookahead when `DraftConfig.k` is not given (k_max when that is smaller)."""

DEFAULT_OVERLAP = 16
"""Draft-ahead steps of `DraftConfig.overlap=None` on CUDA with CUDA graphs (clamped to k + 1 per round by the runtime)."""


class DraftConfig(_Frozen):
    """How the quantized draft is built and how far it looks ahead."""

    quant: QuantName = Field("int4", description="Weight format of the draft's routed experts (gptq4 = int4 with GPTQ calibration).")
    group_size: int = Field(128, description="Quantization group size along the input dimension: -1 for one group per "
                            "row, else at least 8. A size that does not divide both the model's hidden and intermediate "
                            "sizes falls back to one group per row for that model (specter.draft.layer_group), which the "
                            "memory plan counts too.")
    k: int = Field(DEFAULT_K, ge=0, le=32, description="Draft depth for the `fixed` lookahead policy; 0 disables speculation. "
                   "Default 4, or k_max when that is smaller; a k above k_max is an error (it would be cut to k_max).")
    k_max: int = Field(15, ge=0, le=32, description="Largest draft depth any lookahead policy may choose. The static "
                       "verify runs EngineConfig.row_bucket rows per pass and a round verifies k + 1 (the token before "
                       "the drafts, then the drafts), so 15 is the deepest round that fits one pass at the default "
                       "row_bucket of 16; a deeper k_max, or a smaller row_bucket, takes more passes for the deepest "
                       "rounds.")
    sampling: SamplingRule = Field("coupled", description="Acceptance rule when sampling: coupled (token-identical) or rejection.")
    scout: bool = Field(False, description="Offloaded plain rounds (k = 0) first run one draft step for its routes only: the "
                                           "experts it routes the round's token to are prefetched before and during the verify.")
    overlap: int | None = Field(None, ge=0, le=32, description="Draft ahead during the verify: a speculative "
                                "round drafts one more step (a guess at the target's own next token) and, while the verify "
                                "runs, up to this many draft steps from that guess on a second stream; if the verify accepts "
                                "every draft and its token equals the guess, the next round starts with those steps done. "
                                "0 turns it off; None (default): 16 on CUDA with CUDA graphs (there the steps run beside "
                                "the verify, and the draft-ahead was faster in every cell of its A/B on the GPU); 0 on "
                                "the CPU (no second stream: the steps would run in series with the verify) and on CUDA "
                                "with EngineConfig.cuda_graphs=False.")

    def overlap_steps(self, device_type: str, cuda_graphs: bool) -> int:
        """The draft-ahead depth on a device of this type (resolves overlap=None)."""
        if self.overlap is not None:
            return self.overlap
        return DEFAULT_OVERLAP if device_type == "cuda" and cuda_graphs else 0

    @model_validator(mode="before")
    @classmethod
    def _default_k_within_k_max(cls, values: object) -> object:
        # Only the default follows k_max; a k the user gave is checked against it below, never cut silently.
        if isinstance(values, dict) and "k" not in values and isinstance(values.get("k_max"), int):
            return values | {"k": max(0, min(DEFAULT_K, values["k_max"]))}
        return values

    @model_validator(mode="after")
    def _k_within_k_max(self) -> "DraftConfig":
        if self.k > self.k_max:
            raise ValueError(f"k = {self.k} is above k_max = {self.k_max}, so the fixed lookahead would draft only {self.k_max}; "
                             f"lower k to {self.k_max} or less, or raise k_max to {self.k}")
        return self

    @model_validator(mode="after")
    def _scout_needs_a_draft(self) -> "DraftConfig":
        if self.scout and self.k_max < 1:
            raise ValueError("scout needs a draft: set k_max >= 1 (the scout is a one-step draft) or turn scout off")
        return self

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int) -> int:
        if value != -1 and value < 8:
            raise ValueError("group_size must be -1 (per row) or at least 8")
        return value


class CacheTuning(_Frozen):
    """The expert cache's rolling window and lead (specter/experts/window.py, lead.py)."""

    roll_hot_window: int | None = Field(2, ge=0, le=256, description="Most slots a layer's waiting misses hold at once "
                                        "in the verify's rolling window, so the hot experts the policy keeps stay for "
                                        "the next round. 0 acts as 1: a layer that holds no slot still lets one miss "
                                        "through (specter/experts/window.py), or its verify could not go on. None: no "
                                        "limit, every hot expert gives way. 2 (default): keeping the hot experts "
                                        "for the next round moved fewer decode bytes per token than None in the A/B, "
                                        "at few and at many residents.")
    lead_relay: bool = Field(True, description="A layer's lead may borrow one slot from the layer before for a "
                             "predicted miss, so its copy waits only for that layer's compute, not for a slot of its own "
                             "to free. On: it cut the slots' idle time and TPOT where slots are scarce, and was neutral "
                             "with more of them.")


class TransferTuning(_Frozen):
    """The transfer engine's pump (specter/experts/transfer.py)."""

    max_chunks_in_flight: int = Field(4, ge=1, le=64, description="Chunks on the copy stream (urgent ones count) before "
                                      "the pump issues another prefetch chunk, 1 to 64. More keep the link from idling "
                                      "between chunks; fewer let an urgent miss pass a shorter queue. 4: a busier copy "
                                      "stream and a lower TPOT than 2 in the A/B.")
    issue_marks: bool = Field(False, description="Record a timed event per chunk as it is issued, so the copy-busy "
                              "measurement splits the copy stream's idle time by cause (`bench --copy-gaps`). Off: "
                              "the events take a little of the copy stream's busy time, so they are for diagnosis only.")


class VerifyTuning(_Frozen):
    """The offloaded verify (specter/verify.py)."""

    lead_misses: int = Field(2, ge=0, le=256, description="Predicted misses each MoE layer of a segmented verify starts "
                             "while its routing travels to the host, 0 to 256; 0: no lead. 2: the copy stream works "
                             "through the routing's hand-over instead of idling, and TPOT was lower than without a lead; a deep lead "
                             "(tens of experts) copies experts the verify may not use, and was slower.")
    routing_poll_s: float = Field(3e-3, ge=0.0, le=0.1, description="Seconds (0 to 0.1) the verify polls for its "
                                  "router's choice before parking on a waiter thread (CUDA, misses ordered on the "
                                  "device): a choice that comes within the poll skips the thread hop, which would add a "
                                  "fraction of a millisecond per MoE layer.")


def _power_of_two(value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two (Triton's blocks and warps are)")
    return value


PowerOfTwo = Annotated[int, AfterValidator(_power_of_two)]


class RowTiles(_Frozen):
    """Tiles of the draft step's one-row kernels (specter/model/rowfused.py); `benchmarks/graphed_tpot.py --row-config`
    and `benchmarks/row_kernels_bench.py` sweep them. Each default is the best of those sweeps, or of an A/B of the
    graphed draft step, on the GPU machine at the Qwen1.5-MoE shape (docs/BENCHMARKS.md, "The draft step's row
    kernels, each alone")."""

    block_n: PowerOfTwo = Field(8, description="Output rows per program of norm_linear (the packed q/k/v product): the "
                                "tile sweep's best.")
    block_k: PowerOfTwo = Field(512, description="Elements per K step of norm_linear and of the FFN input product: the "
                                "tile sweep's best (K steps of 1024 made the draft step slower).")
    block_n_moe: PowerOfTwo = Field(16, description="Intermediate columns per program of moe_gate_up (twice as many "
                                    "weight rows: gate and up), and the int8 finish's scale group: the sweep's best for "
                                    "gate/up with int8 h.")
    block_k_moe: PowerOfTwo = Field(512, description="Elements per K step of moe_finish's int4 GEMV, a whole number of "
                                    "groups or a divisor of one: the tile sweep's best.")
    block_k_gate_up: PowerOfTwo = Field(1024, description="Likewise for moe_gate_up: with int8 h, K steps of 1024 at 8 "
                                        "warps (warps_moe) ran gate/up faster than 512 at 4.")
    block_n_finish: PowerOfTwo = Field(4, description="Hidden rows per program of moe_finish: the sweep's best (2 rows "
                                       "tied with it, 8 made the draft step slower).")
    words_gate_up: bool = Field(False, description="moe_gate_up's float path reads the int4 codes as 32-bit words of 8 "
                                "(off: bytes, even and odd k). Off: as words, gate/up alone took several times as long "
                                "as with bytes. The int8 path always reads words.")
    words_finish: bool = Field(True, description="moe_finish reads the int4 codes as 32-bit words (off: bytes). On: "
                               "words ran the finish faster than bytes.")
    warps_moe: PowerOfTwo = Field(8, description="num_warps of moe_gate_up: with its K steps of 1024 "
                                  "(block_k_gate_up), 8 gave a shorter draft step than 4.")
    warps_finish: PowerOfTwo = Field(4, description="num_warps of moe_finish: 8 warps, or 2 rows per program, made the "
                                     "draft step slower.")
    block_k_shared: PowerOfTwo = Field(2048, description="Elements per K step of moe_finish's bf16 shared down product: "
                                       "with evict_first, 2048 gave a shorter draft step.")
    evict_first: bool = Field(True, description="Weight loads marked evict-first: each weight byte is read once per "
                              "step, so keeping it in L2 would only displace what is read again. On: with "
                              "block_k_shared 2048, a shorter draft step.")
    topk_in_router: bool = Field(True, description="The router's top-k runs in the input product's launch (rowfused."
                                 "Select), once, not in every moe_gate_up program before its first weight load. On: a "
                                 "shorter draft step.")
    num_warps: PowerOfTwo = Field(4, description="num_warps of the bf16 GEMVs: norm_linear, linear_residual, the input "
                                  "product. 4: 8 warps (at 16 rows) or 2 (at 4) made the draft step slower.")
    num_stages: int = Field(3, ge=1, le=8, description="num_stages of every one-row kernel, 1 to 8: 4 stages were no "
                            "faster than 3.")
    block_n_residual: PowerOfTwo = Field(2, description="Output rows per program of linear_residual: with K steps of "
                                         "1024 (block_k_residual), 2 rows ran o_proj alone faster than 8 rows at 512.")
    block_k_residual: PowerOfTwo = Field(1024, description="linear_residual's K step, swept together with "
                                         "block_n_residual (see there).")
    block_n_input: PowerOfTwo = Field(4, description="Gate/up column pairs (tail rows: twice as many) per program of the "
                                      "input product, norm_ffn_input and norm_router: 4 ran the FFN input alone faster "
                                      "than 8.")
    int8_gate_up: bool = Field(True, description="moe_gate_up quantises h to int8 per weight group and sums codes x "
                               "activations in int32 by dp4a, four per instruction; the float path spends ~8 "
                               "instructions per code and is issue-bound. On: a faster gate/up and draft step.")
    int8_finish: bool = Field(True, description="moe_gate_up also stores its output in int8 and moe_finish sums the "
                              "routed down rows against it by dp4a, where rowfused.int8_finish_fits. On: a shorter draft "
                              "step, with the draft's acceptance no lower than with the float finish.")
    dp4a: bool = Field(True, description="The int8 sums by the dp4a instruction on CUDA; off: plain integer operations, "
                       "as Triton's interpreter runs them (the same bits: tests/test_gpu_rowfused.py).")


class MoETiles(_Frozen):
    """Tiles of the Triton MoE kernels over packed experts (specter/quant/moe_triton.py: the draft's quantized MoE;
    specter/model/graphed.py's resident kernel reads block_n_gate_up, block_n_down, block_k, num_warps, num_stages).
    `benchmarks/moe_kernel_bench.py` sweeps them; each default is its sweeps' best on the GPU machine at the
    Qwen1.5-MoE experts' shape (docs/BENCHMARKS.md, "The draft's fused MoE kernel")."""

    block_n_gate_up: PowerOfTwo = Field(32, description="Intermediate columns per program of the gate/up GEMM of several "
                                        "tokens (the tile holds twice as many rows: gate and up); no tile of the sweep "
                                        "was faster by more than its noise.")
    block_n_down: PowerOfTwo = Field(32, description="Hidden columns per program of the down GEMM of several tokens "
                                     "(the same sweep as block_n_gate_up).")
    block_k: PowerOfTwo = Field(128, description="Input elements per K step of the GEMMs; a divisor of the group keeps "
                                "one scale per row per step (the same sweep).")
    num_warps: PowerOfTwo = Field(4, description="num_warps of every MoE launch: 4 warps were the best at every block "
                                  "of the GEMV sweep.")
    num_stages: int = Field(3, ge=1, le=8, description="num_stages of every MoE launch, 1 to 8: every sweep held it at "
                            "3.")
    split_k_down: int = Field(2, ge=1, le=64, description="K parts of the down GEMM, 1 to 64, at most one per K step; 1: "
                              "no split. 2: more programs for the short down GEMM of few tokens, faster than 1 at every "
                              "token count of a decode, the draft step included.")
    single_token_gemv: bool = Field(True, description="One token runs GEMV kernels without the route kernel or 16-row "
                                    "tiles, which at one token are mostly padding. On: the GEMVs were faster than the "
                                    "general kernel.")
    block_n_gemv: PowerOfTwo = Field(16, description="Output rows per GEMV program (gate/up: twice, gate and up): the "
                                     "one-token sweep's best.")
    block_k_gemv: PowerOfTwo = Field(512, description="Input elements per GEMV step; a step of several groups reads one "
                                     "scale per group. 512: faster than 128, with gate/up whole.")
    split_k_gemv_gate_up: int = Field(4, ge=1, le=64, description="K parts of the one-token gate/up GEMV, 1 to 64 (> 1: "
                                      "float32 parts, then an activation launch): with block_k_gemv 512, the best of "
                                      "the sweep.")



class KernelTuning(_Frozen):
    """The static steps and the draft's fused kernels (specter/model). Fixed when the CUDA graphs are captured."""

    static_mla: bool = Field(True, description="Run DeepSeek-V2's multi-head latent attention through the static "
                             "(CUDA-graph) step; off: DeepSeek runs the eager forward everywhere (target, verify, "
                             "draft). On: on the GPU its graphed step equals the eager paths, token for token "
                             "(tests/test_gpu_graphed_mla.py).")
    positions_per_split: int = Field(128, ge=1, description="Cache positions per run of the draft's decode attention "
                                     "(at least 1): shorter runs give a long cache more programs at once; runs of 512 "
                                     "made the draft step at a 2048-position cache slower.")
    max_splits: int = Field(64, ge=1, le=1024, description="Most runs one decode attention is cut into, 1 to 1024 "
                            "(programs per row and cache head): a cache longer than max_splits x positions_per_split "
                            "takes longer runs instead of more partials to merge.")
    merge_in_launch: bool = Field(True, description="The draft's decode attention merges its runs in its own launch. "
                                  "On: one launch fewer per layer, a shorter draft step. Off: a second launch, for A/B "
                                  "and the kernel tests.")
    decode_attention: bool = Field(True, description="The non-exact one-row step attends over the visible positions "
                                   "only, so its attention grows with the context, not the cache's capacity. On: a "
                                   "shorter draft step at a long cache. Off: torch's masked attention, for A/B "
                                   "and the kernel tests.")
    rope_writes_cache: bool = Field(True, description="The draft's static step rotates q and k and writes the KV cache "
                                    "in one launch. On: a shorter draft step. Off: RoPE and two index_copy_, for A/B "
                                    "and the kernel tests.")
    router_and_gate: bool = Field(True, description="The non-exact forward (and the exact one with exact_rowwise) fuses "
                                  "the router's softmax + top-k and the shared expert's gate, one launch each where "
                                  "torch issues several. Off: torch's ops, for A/B.")
    packed_qkv: bool = Field(True, description="The non-exact forward projects q, k and v with one product over the "
                             "packed weights, one launch instead of three. On: a shorter draft step. Off: three "
                             "products, for A/B.")
    packed_ffn_input: bool = Field(True, description="The non-exact Qwen2-MoE-style layer runs its router, shared gate "
                                   "and shared gate/up as one packed product. On: a shorter draft step. Off: separate "
                                   "products, for A/B.")
    residual_addend: bool = Field(True, description="The non-exact forward adds the residual inside the attention's "
                                  "output product: one launch fewer, though the draft step's time did not measurably "
                                  "change. Off: a separate add, for A/B.")
    exact_rowwise: bool = Field(False, description="The exact forward (the target: prefill, decode and verify, eager "
                                "and static alike, so every pair of paths the exactness contract compares runs the same "
                                "kernels) also takes the fused launches that compute each row on its own: RMSNorm, RoPE, "
                                "the router's softmax + top-k, the shared expert's gate and each row's attention over "
                                "its visible positions (a launch and a merge), one launch each where torch issues 3 to "
                                "8, or one per row in the eager attention (about 30 fewer of the static step's 55 "
                                "launches per layer for the Qwen/Mixtral/OLMoE families; DeepSeek-V2 its three norms "
                                "only, its attention, RoPE and routing being its own; Phi-MoE its RoPE and attention). "
                                "CUDA, or Triton's interpreter. Off until an A/B on the GPU shows it pays; its tokens: "
                                "tests/test_exact_rowwise.py.")
    row_kernels: bool = Field(True, description="The draft step runs Qwen2-MoE-style layers through the one-row "
                              "kernels of specter/model/rowfused.py, seven launches a layer where the general forward "
                              "takes about 18. On: a shorter draft step. Off: the general non-exact forward, for A/B "
                              "and the kernel tests.")
    row: RowTiles = Field(default_factory=RowTiles, description="Tiles and paths of the one-row kernels: each default "
                          "the best a sweep or an A/B found.")
    moe: MoETiles = Field(default_factory=MoETiles, description="Tiles of the draft's quantized MoE kernels: the general "
                          "kernel for several tokens, the GEMVs for one (single_token_gemv).")
    resident: MoETiles = Field(default_factory=lambda: MoETiles(block_n_gate_up=16, block_n_down=16),
                               description="Tiles of the resident bf16 experts' Triton kernel (specter/model/graphed.py): "
                               "narrow column blocks, so a one-row decode has enough programs to fill the GPU (chosen "
                               "for that, not swept; docs/BENCHMARKS.md, \"Resident decoding against its HBM floor\"). "
                               "The static target and the segmented verify read the same tiles, so their logits agree "
                               "bit for bit.")


class WaitTuning(_Frozen):
    """How a task's wait on a GPU event uses the loop thread (specter/kernel.py, `Kernel.wait`)."""

    spin_s: float = Field(0.0, ge=0.0, le=0.01, description="Seconds (0 to 0.01) a wait polls the event on the loop "
                          "thread before parking on its stream's waiter thread. 0: park at once, so the loop thread "
                          "stays free for other tasks; the waits known to be short (the verify's) spin for their own "
                          "budget whatever this says.")
    idle_s: float = Field(0.0005, ge=0.0, le=0.01, description="Most seconds (0 to 0.01) one wait spends on deferred "
                          "host work (`Kernel.defer`) while its event is pending, so that a ready task is never held up "
                          "for longer; 0.5 ms keeps the delay below a draft step's time.")


class HostTuning(_Frozen):
    """The host expert path (specter/experts/host.py)."""

    parallel_experts: bool = Field(False, description="Compute a layer's host experts each on its own one-thread worker, "
                                   "up to cpu_threads at once, instead of one after another, each on a team of cpu_threads "
                                   "torch threads. A one-thread expert's result does not depend on what runs beside it, "
                                   "so the tokens stay a function of the config. Off until an A/B on the GPU machine's "
                                   "host shows it pays (benchmarks/host_expert.py's parallel mode measures it); its "
                                   "tokens: tests/test_hybrid.py, tests/test_host_experts.py.")
    kernel: Literal["auto", "torch", "native"] = Field(
        "auto", description="The host path's expert kernel: 'torch' (the F.linear chain on zero-padded blocks of "
        "row_bucket rows), 'native' (specter/experts/native.py: AMX, else AVX512-BF16, else AVX2 with FMA, weights read once as "
        "they lie, each row on its own at any count; needs a C compiler), or 'auto': the faster of those available as "
        "the load's calibration times them, stored with the costs, since which is faster depends on the CPU and the "
        "expert's shape (benchmarks/host_expert.py; docs/BENCHMARKS.md, \"The native host kernel\"). Tokens: "
        "tests/test_native_kernel.py.")


class TuningConfig(_Frozen):
    """Knobs of the runtime, by the part they tune. Every default is the best a sweep or an A/B found on the GPU
    machine, but `host.parallel_experts` and `kernels.exact_rowwise`, off until an A/B there shows they pay.

    Each field says what it tunes and why its default is what it is. docs/BENCHMARKS.md holds the current figures;
    `--tune SECTION.FIELD=VALUE` (bench, generate, serve, info) and `benchmarks/ab_bench.py` measure a field against
    another value, and the section docstrings name the scripts that sweep the kernels' tiles."""

    cache: CacheTuning = Field(default_factory=CacheTuning, description="The expert cache's rolling window and lead.")
    transfer: TransferTuning = Field(default_factory=TransferTuning, description="The transfer engine's pump.")
    verify: VerifyTuning = Field(default_factory=VerifyTuning, description="The offloaded verify.")
    kernels: KernelTuning = Field(default_factory=KernelTuning, description="The static steps and the draft's kernels.")
    host: HostTuning = Field(default_factory=HostTuning, description="The host expert path.")
    wait: WaitTuning = Field(default_factory=WaitTuning, description="How waits on GPU events use the loop thread.")

    def with_overrides(self, overrides: Sequence[str]) -> "TuningConfig":
        """This tuning with each `PATH=VALUE` applied, PATH a field's dotted name (`cache.lead_relay`, or in a nested
        section `kernels.row.block_k`) and VALUE JSON (true, 3, null; a bare word is a string): what A/B runs set. A
        bad name or value raises ConfigError naming it."""
        values = self.model_dump()
        for override in overrides:
            holder, name, value = _override_target(values, override)
            holder[name] = value
        return type(self).build(**values)


def _override_target(values: dict, override: str) -> tuple[dict, str, object]:
    """(the dict that holds the field `override` names, the field's name, its new value) in a dumped TuningConfig;
    ConfigError saying what is wrong and which names the section it reached has."""
    target, sep, text = override.partition("=")
    parts = target.strip().split(".")
    if not sep or len(parts) < 2:
        raise ConfigError(f"tuning override {override!r}: expected SECTION.FIELD=VALUE (a nested field by its dotted "
                          f"path), e.g. cache.lead_relay=false or kernels.row.block_k=1024")
    holder: dict = values
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if not isinstance(holder, dict):
            raise ConfigError(f"tuning override {override!r}: {where} is a field, not a section")
        if part not in holder:
            raise ConfigError(f"tuning override {override!r}: {where or 'the tuning'} has no {part!r}; expected "
                              f"SECTION.FIELD=VALUE with one of {', '.join(_names(holder, where))}")
        if depth < len(parts) - 1:
            holder = holder[part]
    if isinstance(holder[parts[-1]], dict):
        raise ConfigError(f"tuning override {override!r}: {target.strip()} is a section; set one of its fields: "
                          f"{', '.join(_names(holder[parts[-1]], target.strip()))}")
    try:
        value = json_value(text)
    except ValueError:  # not JSON: the text itself, which the field's type then judges
        value = text.strip()
    return holder, parts[-1], value


def _names(section: dict, where: str) -> list[str]:
    """The dotted names directly under `section` (at `where`): its fields, and its sections as `NAME.FIELD`."""
    prefix = f"{where}." if where else ""
    return [f"{prefix}{name}.FIELD" if isinstance(value, dict) else f"{prefix}{name}" for name, value in section.items()]


class EngineConfig(_Frozen):
    """Everything fixed for the life of an engine: device, memory, numerics, draft and plug-ins."""

    device: str = Field("auto", description="Torch device: 'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Compute dtype; 'auto' takes the checkpoint's dtype (float32 on the CPU for half checkpoints is not forced)."
    )
    budget: ByteCount | None = Field(
        None, description="GPU memory budget in bytes or with a unit ('24GiB', '512MiB'); expert slots get what is left. None: all experts resident."
    )
    residents: int | None = Field(None, description="Expert cache slots per MoE layer; an alternative to `budget`. At least "
                                  "the model's top-k (one token's active experts), at most its experts per layer (checked at load).")
    exact: bool = Field(True, description="Batch-invariant numerics, so speculative output is token-identical to plain decoding.")
    row_bucket: int = Field(16, ge=1, le=256, description="Rows per block, 1 to 256. In exact mode every matrix product "
                            "runs on zero-padded blocks of this many rows, so a row's numerics do not depend on how "
                            "many rows run beside it; the static (CUDA-graph) decode and verify step runs this many "
                            "rows per pass, so a verify of k + 1 rows takes ceil((k + 1) / row_bucket) passes (16 holds "
                            "DraftConfig.k_max's default of 15 in one); the host path's torch kernel computes an expert "
                            "on blocks of this many rows.")
    max_context: int | None = Field(None, ge=MIN_CONTEXT, description="Longest prompt plus generation, in tokens; sizes the static KV cache "
                                    "and the attention workspace. None (default): min(2048, the model's max_position_embeddings). "
                                    "Above max_position_embeddings is an error; so is a context whose KV does not fit in memory.")
    threads: int | None = Field(None, ge=1, le=1024, description="Torch intra-op CPU threads (1 to 1024), set once when the engine loads "
                                "(torch.set_num_threads is process-wide: it applies to all torch work in the process). "
                                "None (default): 1 on CUDA (the host only enqueues work); on the CPU half the cores, "
                                "1 to 4. Torch's own default, one thread per core, spins its workers against any other "
                                "busy process, and on a shared machine with few cores that made decoding many times "
                                "slower than one thread (benchmarks/threads_tpot.py measures it).")
    cpu_experts: str = Field("off", min_length=1, description="Name of the `specter.placement` plug-in that decides, once "
                             "at load, which routed experts the host CPU computes for the engine's life (never copied to "
                             "the device): 'off' (none), 'all' (every expert not resident on the device: nothing is copied "
                             "after load, the llama.cpp --n-cpu-moe style), or any installed placement plug-in.")
    cpu_threads: int | None = Field(None, ge=1, le=1024, description="Torch intra-op threads of the host expert path's "
                                    "worker thread (its own OpenMP team: the loop thread keeps `threads`). None "
                                    "(default): the host's cores less one, at least 1, so that the event loop, which "
                                    "issues the device's work and the copies while the host computes, keeps a core "
                                    "(a reasoned default, not an A/B's: specter.experts.host.default_threads). Fewer emulate "
                                    "a smaller host.")
    placement_profile: Path | None = Field(None, description="A routing trace (`generate --trace`, specter/trace.py) of "
                                           "this model whose per-layer expert use the placement's cost model weighs "
                                           "(`auto`: the least used go to the host first). None (default): uniform "
                                           "routing assumed. Checked at every load (a file that is not a trace of "
                                           "this model's shape is refused); placed from by any cpu_experts but 'off'.")
    self_profile_tokens: int = Field(256, ge=0, le=1_000_000, description="Where the placement plug-in named by "
                                     "cpu_experts cannot price a speculating engine's misses without a routing trace's "
                                     "rounds (`auto`: its draft prefetches most of them) and no placement_profile is "
                                     "given, the engine decodes this many tokens of the model's own sampled text at load "
                                     "(speculating, placement off), records their routing trace and places from it "
                                     "(`Runtime.own_routing_profile`): about this many times the engine's copy-only "
                                     "TPOT added to the load (a Mixtral-8x7B at 48 GiB over Gen4: 256 x 0.21 s, about 54 s), for "
                                     "a placement that needs no trace of the user's. A trace of your own workload (placement_profile) is the "
                                     "better profile where its text differs from the model's own. 0: record none "
                                     "(`auto` then places such an engine 'off'). Ignored with cpu_experts 'off', a "
                                     "placement_profile, an engine that does not speculate, and where the link or the "
                                     "host is not measured (the CPU without `link`).")
    placement_overlap: float | None = Field(None, ge=0.0, le=1.0, description="The `overlap` of the placement plug-in "
                                            "named by cpu_experts (`auto`'s cost model): the share of the shorter of a "
                                            "layer's two paths, host compute and copies, that hides under the longer, 0 "
                                            "to 1: a layer is priced at the longer path plus (1 - overlap) x the "
                                            "shorter. At 0 (their sum) the two costs add, so under uniform use a layer "
                                            "puts all its non-residents on the host or none; toward 1 the model "
                                            "balances the two paths and splits a layer between them, which moves "
                                            "experts onto the host where a host expert costs more than its copy, and "
                                            "back onto the device path where it costs less. None (default): the "
                                            "plug-in's own (`auto`: 0). docs/BENCHMARKS.md (\"`auto`'s overlap, 0 "
                                            "against 1, in one process\") compares 1 with it. A plug-in that takes no "
                                            "`overlap` is refused at load; ignored with cpu_experts 'off'.")
    recalibrate: bool = Field(False, description="Measure the placement's costs (one host expert's time, the link's "
                              "rate) anew at load instead of taking the ones measured before on this machine for the "
                              "same expert shape, dtype, block and host threads (SPECTER_CACHE/placement-costs.json), and "
                              "store them. Off (default): the first load measures, later ones reuse, so that `auto` "
                              "places, and the text comes out, the same from load to load.")
    draft: DraftConfig = Field(default_factory=DraftConfig, description="Draft model settings.")
    eviction: str = Field("plan-protect", min_length=1, description="Name of the `specter.eviction` plug-in.")
    prefetch: str = Field("topm-keep", min_length=1, description="Name of the `specter.prefetch` plug-in.")
    lookahead: str = Field("fixed", min_length=1, description="Name of the `specter.lookahead` plug-in.")
    backend: str = Field("auto", min_length=1, description="Name of the `specter.backends` plug-in; 'auto' follows the device.")
    link: str | None = Field(None, description="Link emulation for host-to-device copies: gen5, gen4, gen3, ddr4-desktop or GB/s.")
    progress: bool = Field(False, description="Show progress bars while loading (checkpoints over 1 GiB show them on a terminal anyway).")
    cuda_graphs: bool = Field(
        True, description="On CUDA, replay the resident decode/verify step and the draft step as CUDA graphs. False "
        "also changes two defaults that follow it: static_verify=None then verifies eagerly, and "
        "DraftConfig.overlap=None then drafts no steps ahead (0).",
    )
    static_verify: bool | None = Field(
        None,
        description="Verify with offloaded experts through the segmented static step (specter/model/segmented.py): "
        "the resident graph's numerics, one CUDA graph per MoE layer's pre-expert part and per expert slot, routed "
        "experts hot first from the cache. True also runs the resident target through the static step on the CPU, "
        "so both agree. None (default): on CUDA with cuda_graphs (faster than the eager verify in the A/B on the GPU), "
        "off otherwise (the CPU, or cuda_graphs False).",
    )
    tuning: TuningConfig = Field(default_factory=TuningConfig, description="Measured knobs of the cache, transfer "
                                 "engine, verify, kernels and host path; the defaults are the measured best, but two "
                                 "left off until measured (TuningConfig).")

    def verify_is_static(self, device_type: str) -> bool:
        """Whether the verify runs the static step on a device of this type (resolves static_verify=None)."""
        if self.static_verify is not None:
            return self.static_verify
        return device_type == "cuda" and self.cuda_graphs

    @field_validator("link")
    @classmethod
    def _link(cls, value: str | None) -> str | None:
        parse_link(value)  # a typo is refused here, before hours of loading, not when the transfer engine is built
        return value

    @field_validator("placement_profile", mode="before")
    @classmethod
    def _placement_profile_given(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path('') is the current directory: "'.' is not a file"
            raise ValueError("empty path; give a routing trace file (`specter generate --trace PATH` records one), or "
                             "leave it out")
        return value

    @field_validator("placement_profile")
    @classmethod
    def _placement_profile(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():  # refused before loading, like a link typo
            raise ValueError(f"{str(value)!r} is not a file; record a routing trace with `specter generate --trace PATH`")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
            raise ValueError("device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> "EngineConfig":
        if self.budget is not None and self.residents is not None:
            raise ValueError("give either budget or residents, not both")
        return self


def is_token_id(item: object) -> bool:
    """An integer as a token id: an int, or an integer scalar of numpy or torch (`list(array)` gives those); not a
    bool, and not a float, however whole."""
    if isinstance(item, bool) or str(getattr(item, "dtype", "")).endswith("bool"):
        return False
    try:
        operator.index(item)
    except TypeError:
        return False
    return True


class GenerationConfig(_Frozen):
    """Per-request decoding settings (the names follow transformers' generate)."""

    max_new_tokens: int = Field(64, ge=1, description="How many tokens to generate at most.")
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 is greedy; otherwise logits are divided by it before sampling "
                               "(below 1e-5, specter.sampling.MIN_SAMPLING_TEMPERATURE: greedy's argmax, the limit).")
    top_k: int | None = Field(None, ge=1, description="Keep only the k most likely tokens when sampling.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling: keep the smallest set with this much probability.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the per-position sampling noise; same seed, same tokens "
                      "(below 2**63: the static step holds it in an int64). 0 by default, so unseeded requests alike "
                      "sample alike: give each its own seed for different samples.")
    stop_token_ids: tuple[int, ...] = Field((), description="Generation stops after emitting any of these ids.")
    stop_strings: tuple[str, ...] = Field((), description="Generation stops once the text contains any of these.")

    @field_validator("max_new_tokens", "temperature", "top_k", "top_p", "seed", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1, "3" as 3 and 3.0 as 3: seed=True, max_new_tokens="3" or top_k=2.0 is a
        # caller's slip, not a number to guess (numpy's bool_ is no numbers.Number; its integers are Integral), as a
        # token id of 1.0 is refused (stop_token_ids, prompts)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Number)):
            raise ValueError(f"must be a number, not {type(value).__name__} {value!r}")
        if value is not None and info.field_name in ("max_new_tokens", "top_k", "seed") and not isinstance(value, numbers.Integral):
            raise ValueError(f"must be an integer, not {type(value).__name__} {value!r}")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_are_ints(cls, value: Any) -> Any:
        if isinstance(value, (str, bytes)):
            raise ValueError(f"must be a list of token ids, not {type(value).__name__} {value!r}")
        try:
            items = list(value)
        except TypeError:
            return value  # pydantic names what it is
        bad = next((index for index, item in enumerate(items)
                    if not is_token_id(item) or operator.index(item) < 0), None)  # type: ignore[call-overload]
        if bad is not None:
            raise ValueError(f"token ids are integers from 0; element {bad} is {items[bad]!r}")
        return tuple(operator.index(item) for item in items)  # type: ignore[call-overload]  # (an iterator is spent)

    @field_validator("stop_strings")
    @classmethod
    def _stop_strings_are_text(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for index, stop in enumerate(value):
            if not stop:  # found at once, before any text: no place to stop (the detokenizer skips it, unsaid)
                raise ValueError(f"stop string {index} is empty, and an empty string is found before any text; give "
                                 "the text to stop at, or leave it out")
            try:
                stop.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"stop string {index} is not valid Unicode: character {error.start} is "
                                 f"U+{ord(stop[error.start]):04X}, a lone surrogate; give stop strings as UTF-8 text") from None
        return value
