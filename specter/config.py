"""Engine and generation configuration: frozen pydantic models, every field described and validated."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from specter.errors import ConfigError

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
        if value <= 0:
            raise ValueError(f"a byte count must be positive, got {value!r}")
        return int(value)
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a size; use bytes or a number with a unit (KiB, MiB, GiB, KB, MB, GB), e.g. 24GiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a byte count must be positive, got {value!r}")
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
    if not gbps > 0:
        presets = ", ".join(f"{name} ({gbps:g} GB/s)" for name, gbps in LINK_PRESETS.items())
        raise ConfigError(f"link {spec!r} is not a link preset or a positive GB/s figure; use one of {presets}, or e.g. 32")
    return gbps


ByteCount = Annotated[int, BeforeValidator(parse_bytes)]

QuantName = Literal["int4", "int8", "int3", "int2", "gptq4"]
SamplingRule = Literal["coupled", "rejection"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    @classmethod
    def build(cls, **values: object) -> "_Frozen":
        """Validate like the constructor, but raise ConfigError naming each bad field, value and rule."""
        try:
            return cls(**values)
        except ValidationError as error:
            raise ConfigError(describe_validation_error(cls.__name__, error)) from None


def describe_validation_error(model: str, error: ValidationError) -> str:
    """One line per invalid field: the field, the value given and what is allowed."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(model)"
        given = item.get("input")
        lines.append(f"{model}.{field} = {given!r}: {item['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


DEFAULT_K = 4
"""Draft depth of the `fixed` lookahead when `DraftConfig.k` is not given (k_max when that is smaller)."""

DEFAULT_OVERLAP = 16
"""Draft-ahead steps of `DraftConfig.overlap=None` on CUDA (clamped to k + 1 per round by the runtime)."""


class DraftConfig(_Frozen):
    """How the quantized draft is built and how far it looks ahead."""

    quant: QuantName = Field("int4", description="Weight format of the draft's routed experts (gptq4 = int4 with GPTQ calibration).")
    group_size: int = Field(128, description="Quantization group size along the input dimension; -1 for one group per row.")
    k: int = Field(DEFAULT_K, ge=0, le=32, description="Draft depth for the `fixed` lookahead policy; 0 disables speculation. "
                   "Default 4, or k_max when that is smaller; a k above k_max is an error (it would be cut to k_max).")
    k_max: int = Field(15, ge=0, le=32, description="Largest draft depth any lookahead policy may choose (15: with the "
                       "token before the drafts, 16 verify rows, one pass of the 16-row static verify; 16 would take a "
                       "second pass for one more token).")
    sampling: SamplingRule = Field("coupled", description="Acceptance rule when sampling: coupled (token-identical) or rejection.")
    scout: bool = Field(False, description="Offloaded plain rounds (k = 0) first run one draft step for its routes only: the "
                                           "experts it routes the round's token to are prefetched before and during the verify.")
    overlap: int | None = Field(None, ge=0, le=32, description="Draft ahead during the verify: a speculative "
                                "round drafts one more step (a guess at the target's own next token) and, while the verify "
                                "runs, up to this many draft steps from that guess on a second stream; if the verify accepts "
                                "every draft and its token equals the guess, the next round starts with those steps done. "
                                "0 turns it off; None (default): 16 on CUDA with CUDA graphs (measured faster there in every "
                                "cell, docs/journal.md), 0 elsewhere (no second stream: the steps would run in series).")

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
                                        "the next round; None: every hot expert gives way (decode MB/token -11.7 % at "
                                        "15 residents, -8.8 % at 8; journal, Fourteenth session).")
    lead_relay: bool = Field(True, description="A layer's lead may borrow one slot from the layer before for a "
                             "predicted miss, so its copy waits only for that layer's compute (slot idle 0.058 -> 0.029 "
                             "and TPOT 0.967x at 15 residents, neutral at 8; journal, Sixteenth session).")


class TransferTuning(_Frozen):
    """The transfer engine's pump (specter/experts/transfer.py)."""

    max_chunks_in_flight: int = Field(4, ge=1, le=64, description="Chunks on the copy stream (urgent ones count) before "
                                      "the pump issues another prefetch chunk (4 against 2: copy busy 0.884 -> 0.906, "
                                      "TPOT 0.985x / 0.981x; journal, Thirteenth session).")
    issue_marks: bool = Field(False, description="Record a timed event per chunk as it is issued, so the copy-busy "
                              "measurement splits the copy stream's idle time by cause (`bench --copy-gaps`); costs "
                              "0.01-0.02 of copy busy, so off (journal, Twelfth session).")


class VerifyTuning(_Frozen):
    """The offloaded verify (specter/verify.py)."""

    lead_misses: int = Field(2, ge=0, le=256, description="Predicted misses each MoE layer of a segmented verify starts "
                             "while its routing travels to the host; 0: no lead (hand-over + issue idle 0.137 -> 0.058, "
                             "TPOT 0.926x at 15 residents; 64 was 1.044x slower; journal, Fifteenth and Sixteenth "
                             "sessions).")
    routing_poll_s: float = Field(3e-3, ge=0.0, le=0.1, description="Seconds the verify polls for its router's choice "
                                  "before parking on a waiter thread (CUDA, misses ordered on the device): a thread hop "
                                  "would add 0.1-0.3 ms per MoE layer (journal, The verify's misses ordered on the device).")


class KernelTuning(_Frozen):
    """The static steps and the draft's fused kernels (specter/model). Fixed when the CUDA graphs are captured."""

    static_mla: bool = Field(True, description="Run DeepSeek-V2's multi-head latent attention through the static "
                             "(CUDA-graph) step; off: DeepSeek runs the eager forward everywhere (target, verify, "
                             "draft). Measured on the H200 (tests/test_gpu_graphed_mla.py; journal, GPU test runs, "
                             "2026-11-30).")
    positions_per_split: int = Field(128, ge=1, description="Cache positions per run of the draft's decode attention "
                                     "(runs of 512 left a 2048-position cache at 4.17 ms per draft step against 3.36; "
                                     "journal, Eighth session).")
    max_splits: int = Field(64, ge=1, le=1024, description="Most runs one decode attention is cut into (programs per "
                            "row and cache head; journal, Eighth session).")
    merge_in_launch: bool = Field(True, description="The draft's decode attention merges its runs in its own launch "
                                  "(1.56 against 1.61 ms per draft step; journal, Eleventh session). Off: a second "
                                  "launch, for A/B and the kernel tests.")
    decode_attention: bool = Field(True, description="The non-exact one-row step attends over the visible positions "
                                   "only (draft step 4.16 -> 3.48 ms at a 2048-position cache; journal, Eighth "
                                   "session). Off: torch's masked attention, for A/B and the kernel tests.")
    rope_writes_cache: bool = Field(True, description="The draft's static step rotates q and k and writes the KV cache "
                                    "in one launch (draft step 3.14 -> 2.99 ms; journal, Ninth session). Off: RoPE and "
                                    "two index_copy_, for A/B and the kernel tests.")
    router_and_gate: bool = Field(True, description="The non-exact forward fuses the router's softmax + top-k and the "
                                  "shared expert's gate, one launch each (journal, Seventh session). Off: torch's ops, for A/B.")
    packed_qkv: bool = Field(True, description="The non-exact forward projects q, k and v with one product over the "
                             "packed weights (0.22 ms per draft step; journal, Ninth session). Off: three products, for A/B.")
    packed_ffn_input: bool = Field(True, description="The non-exact Qwen2-MoE-style layer runs its router, shared gate "
                                   "and shared gate/up as one packed product (0.12 ms per draft step; journal, Ninth "
                                   "session). Off: separate products, for A/B.")
    residual_addend: bool = Field(True, description="The non-exact forward adds the residual inside the attention's "
                                  "output product: one launch fewer, no measurable change (2.60 ms either way; journal, Ninth "
                                  "session). Off: a separate add, for A/B.")
    row_kernels: bool = Field(True, description="The draft step runs Qwen2-MoE-style layers through the one-row "
                              "kernels of specter/model/rowfused.py (draft step 2.30 -> 1.81 ms; journal, Tenth "
                              "session). Off: the general non-exact forward, for A/B and the kernel tests.")


class TuningConfig(_Frozen):
    """Measured knobs of the runtime, by the part they tune; every default is the measured best (docs/journal.md)."""

    cache: CacheTuning = Field(default_factory=CacheTuning, description="The expert cache's rolling window and lead.")
    transfer: TransferTuning = Field(default_factory=TransferTuning, description="The transfer engine's pump.")
    verify: VerifyTuning = Field(default_factory=VerifyTuning, description="The offloaded verify.")
    kernels: KernelTuning = Field(default_factory=KernelTuning, description="The static steps and the draft's kernels.")

    def with_overrides(self, overrides: Sequence[str]) -> "TuningConfig":
        """This tuning with each `SECTION.FIELD=VALUE` applied (VALUE as JSON: true, 3, null; a bare word is a
        string), e.g. `cache.lead_relay=false`: what A/B runs set. A bad name or value raises ConfigError naming it."""
        values = self.model_dump()
        for override in overrides:
            target, sep, text = override.partition("=")
            section, _, name = target.strip().partition(".")
            if not sep or section not in values or name not in values[section]:
                fields = ", ".join(f"{s}.{n}" for s, group in values.items() for n in group)
                raise ConfigError(f"tuning override {override!r}: expected SECTION.FIELD=VALUE with one of {fields}")
            try:
                values[section][name] = json.loads(text)
            except json.JSONDecodeError:
                values[section][name] = text.strip()
        return type(self).build(**values)


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
    row_bucket: int = Field(16, ge=1, le=256, description="Row bucket for exact mode: every matrix product runs on blocks of this many rows.")
    max_context: int | None = Field(None, ge=8, description="Longest prompt plus generation, in tokens; sizes the static KV cache "
                                    "and the attention workspace. None (default): min(2048, the model's max_position_embeddings). "
                                    "Above max_position_embeddings is an error; so is a context whose KV does not fit in memory.")
    threads: int | None = Field(None, ge=1, description="Torch intra-op CPU threads, set once when the engine loads "
                                "(torch.set_num_threads is process-wide: it applies to all torch work in the process). "
                                "None (default): 1 on CUDA (the host only enqueues work); on the CPU half the cores, "
                                "1 to 4. Torch's own default, one thread per core, spins its workers against any other "
                                "busy process: on 2 shared cores, tiny's TPOT was 1.1 s with 2 threads against 54 ms "
                                "with 1 (benchmarks/threads_tpot.py).")
    cpu_experts: str = Field("off", min_length=1, description="Name of the `specter.placement` plug-in that decides, once "
                             "at load, which routed experts the host CPU computes for the engine's life (never copied to "
                             "the device): 'off' (none), 'all' (every expert not resident on the device: nothing is copied "
                             "after load, the llama.cpp --n-cpu-moe style), or any installed placement plug-in.")
    cpu_threads: int | None = Field(None, ge=1, le=1024, description="Torch intra-op threads of the host expert path's "
                                    "worker thread (its own OpenMP team: the loop thread keeps `threads`). None "
                                    "(default): the host's cores. Fewer emulate a smaller host.")
    placement_profile: Path | None = Field(None, description="A routing trace (`generate --trace`, specter/trace.py) of "
                                           "this model whose per-layer expert use the placement's cost model weighs "
                                           "(`auto`: the least used go to the host first). None (default): uniform "
                                           "routing assumed. Read once at load; ignored with cpu_experts 'off'.")
    draft: DraftConfig = Field(default_factory=DraftConfig, description="Draft model settings.")
    eviction: str = Field("plan-protect", min_length=1, description="Name of the `specter.eviction` plug-in.")
    prefetch: str = Field("topm-keep", min_length=1, description="Name of the `specter.prefetch` plug-in.")
    lookahead: str = Field("fixed", min_length=1, description="Name of the `specter.lookahead` plug-in.")
    backend: str = Field("auto", min_length=1, description="Name of the `specter.backends` plug-in; 'auto' follows the device.")
    link: str | None = Field(None, description="Link emulation for host-to-device copies: gen5, gen4, gen3, ddr4-desktop or GB/s.")
    progress: bool = Field(False, description="Show progress bars while loading (checkpoints over 1 GiB show them on a terminal anyway).")
    cuda_graphs: bool = Field(
        True, description="On CUDA, replay the resident decode/verify step and the draft step as CUDA graphs.",
    )
    static_verify: bool | None = Field(
        None,
        description="Verify with offloaded experts through the segmented static step (specter/model/segmented.py): "
        "the resident graph's numerics, one CUDA graph per MoE layer's pre-expert part and per expert slot, routed "
        "experts hot first from the cache. True also runs the resident target through the static step on the CPU, "
        "so both agree. None (default): on where CUDA graphs run (measured faster on the H200), off on the CPU.",
    )
    tuning: TuningConfig = Field(default_factory=TuningConfig, description="Measured knobs of the cache, transfer "
                                 "engine, verify and kernels; the defaults are the measured best.")

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


class GenerationConfig(_Frozen):
    """Per-request decoding settings (the names follow transformers' generate)."""

    max_new_tokens: int = Field(64, ge=1, description="How many tokens to generate at most.")
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy; otherwise logits are divided by it before sampling.")
    top_k: int | None = Field(None, ge=1, description="Keep only the k most likely tokens when sampling.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set with this much probability.")
    seed: int = Field(0, ge=0, lt=2**63, description="Seed of the per-position sampling noise; same seed, same tokens "
                      "(below 2**63: the static step holds it in an int64).")
    stop_token_ids: tuple[int, ...] = Field((), description="Generation stops after emitting any of these ids.")
    stop_strings: tuple[str, ...] = Field((), description="Generation stops once the text contains any of these.")

    @field_validator("stop_strings")
    @classmethod
    def _stop_strings_are_text(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for index, stop in enumerate(value):
            try:
                stop.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"stop string {index} is not valid Unicode: character {error.start} is "
                                 f"U+{ord(stop[error.start]):04X}, a lone surrogate; give stop strings as UTF-8 text") from None
        return value
