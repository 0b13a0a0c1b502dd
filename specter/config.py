"""Engine and generation configuration: frozen pydantic models, every field described and validated."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

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
                                "cell, journal, draft-ahead), 0 elsewhere (no second stream: the steps would run in series).")

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


def _power_of_two(value: int) -> int:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two (Triton's blocks and warps are)")
    return value


PowerOfTwo = Annotated[int, AfterValidator(_power_of_two)]


class RowTiles(_Frozen):
    """Tiles of the draft step's one-row kernels (specter/model/rowfused.py); `benchmarks/graphed_tpot.py --row-config`
    and `benchmarks/row_kernels_bench.py` sweep them. Figures: H200, Qwen1.5-MoE shape; ms per graphed draft step, us
    per kernel alone."""

    block_n: PowerOfTwo = Field(8, description="Output rows per program of norm_linear (the packed q/k/v product): the "
                                "tile sweep's best (journal, Tenth session, row10c).")
    block_k: PowerOfTwo = Field(512, description="Elements per K step of norm_linear and of the FFN input product "
                                "(1024: 2.00 ms against 1.91; journal, Tenth session, row10c).")
    block_n_moe: PowerOfTwo = Field(16, description="Intermediate columns per program of moe_gate_up (twice as many "
                                    "weight rows: gate and up), and the int8 finish's scale group (gate/up alone with "
                                    "int8 h: 5.83 us at 16 rows; journal, Eleventh session, int8g11).")
    block_k_moe: PowerOfTwo = Field(512, description="Elements per K step of moe_finish's int4 GEMV, a whole number of "
                                    "groups or a divisor of one: the tile sweep's best (journal, Tenth session, row10c).")
    block_k_gate_up: PowerOfTwo = Field(1024, description="Likewise for moe_gate_up (gate/up alone with int8 h: 7.19 us "
                                        "at 16 rows / 512 / 4 warps, 5.83 at 16 / 1024 / 8 warps; journal, Eleventh "
                                        "session, int8g11).")
    block_n_finish: PowerOfTwo = Field(4, description="Hidden rows per program of moe_finish (2 rows: 1.91 ms either "
                                       "way, 8: 1.99; journal, Tenth session, row10c).")
    words_gate_up: bool = Field(False, description="moe_gate_up's float path reads the int4 codes as 32-bit words of 8 "
                                "(off: bytes, even and odd k; gate/up 51.9 us as words, 14.3 as bytes; journal, Tenth "
                                "session, row10/row10b). The int8 path always reads words.")
    words_finish: bool = Field(True, description="moe_finish reads the int4 codes as 32-bit words (17.1 us; bytes 24.5; "
                               "journal, Tenth session, row10/row10b).")
    warps_moe: PowerOfTwo = Field(8, description="num_warps of moe_gate_up (with its K steps of 1024: draft step 1.61 -> "
                                  "1.56 ms; journal, Eleventh session, attn11).")
    warps_finish: PowerOfTwo = Field(4, description="num_warps of moe_finish (8 warps, or 2 rows per program: 1.99-2.12 ms "
                                     "against 1.85; journal, Tenth session, row10d).")
    block_k_shared: PowerOfTwo = Field(2048, description="Elements per K step of moe_finish's bf16 shared down product "
                                       "(with evict_first: 1.91 -> 1.85 ms; journal, Tenth session, row10d).")
    evict_first: bool = Field(True, description="Weight loads marked evict-first, each weight byte being read once per "
                              "step (with block_k_shared 2048: 1.91 -> 1.85 ms; journal, Tenth session, row10d).")
    topk_in_router: bool = Field(True, description="The router's top-k runs in the input product's launch (rowfused."
                                 "Select), not in every moe_gate_up program (1.84 -> 1.80-1.81 ms; journal, Tenth "
                                 "session, row10g/row10h).")
    num_warps: PowerOfTwo = Field(4, description="num_warps of the bf16 GEMVs: norm_linear, linear_residual, the input "
                                  "product (8 warps x 16 rows or 2 x 4: 1.99-2.12 ms against 1.85; journal, Tenth "
                                  "session, row10d).")
    num_stages: int = Field(3, ge=1, le=8, description="num_stages of every one-row kernel (4: 1.91 ms either way; "
                            "journal, Tenth session, row10c).")
    block_n_residual: PowerOfTwo = Field(2, description="Output rows per program of linear_residual (o_proj alone: 5.16 "
                                         "us at 8 rows / K steps of 512, 4.09 at 2 / 1024; journal, Eleventh session, "
                                         "kern11).")
    block_k_residual: PowerOfTwo = Field(1024, description="linear_residual's K step (see block_n_residual; journal, "
                                         "Eleventh session, kern11).")
    block_n_input: PowerOfTwo = Field(4, description="Gate/up column pairs (tail rows: twice as many) per program of the "
                                      "input product, norm_ffn_input and norm_router (the FFN input alone: 15.0 us at 8, "
                                      "14.3 at 4; journal, Eleventh session, kern11).")
    int8_gate_up: bool = Field(True, description="moe_gate_up quantises h to int8 per weight group and sums codes x "
                               "activations in int32 by dp4a; the float path spends ~8 instructions per code (gate/up "
                               "12.54 -> 7.19 us, draft step 1.76 -> 1.66 ms; journal, Eleventh session, int8g11).")
    int8_finish: bool = Field(True, description="moe_gate_up also stores its output in int8 and moe_finish sums the "
                              "routed down rows against it by dp4a, where rowfused.int8_finish_fits (1.56 -> 1.49 ms; "
                              "acceptance 0.967 against 0.941 with the float finish; journal, Eleventh and Twelfth "
                              "sessions).")
    dp4a: bool = Field(True, description="The int8 sums by the dp4a instruction on CUDA; off: plain integer operations, "
                       "as Triton's interpreter runs them (the same bits: tests/test_gpu_rowfused.py).")


class MoETiles(_Frozen):
    """Tiles of the Triton MoE kernels over packed experts (specter/quant/moe_triton.py: the draft's quantized MoE;
    specter/model/graphed.py's resident kernel reads block_n_gate_up, block_n_down, block_k, num_warps, num_stages).
    `benchmarks/moe_kernel_bench.py` sweeps them. Figures: H200, Qwen1.5-MoE experts, us per call."""

    block_n_gate_up: PowerOfTwo = Field(32, description="Intermediate columns per program of the gate/up GEMM of several "
                                        "tokens (the tile holds twice as many rows: gate and up); no tile of the sweep "
                                        "was more than 5 % faster (journal, Seventh session).")
    block_n_down: PowerOfTwo = Field(32, description="Hidden columns per program of the down GEMM of several tokens "
                                     "(same sweep; journal, Seventh session).")
    block_k: PowerOfTwo = Field(128, description="Input elements per K step of the GEMMs; a divisor of the group keeps "
                                "one scale per row per step (same sweep; journal, Seventh session).")
    num_warps: PowerOfTwo = Field(4, description="num_warps of every MoE launch (the GEMV sweep: 4 warps best at every "
                                  "block; journal, Eighth session).")
    num_stages: int = Field(3, ge=1, le=8, description="num_stages of every MoE launch (every sweep held it at 3; "
                            "journal, Seventh and Eighth sessions).")
    split_k_down: int = Field(2, ge=1, le=64, description="K parts of the down GEMM, at most one per K step; 1: no split "
                              "(T = 1: 60.3 us against 67.7; draft step 4.47 against 4.62 ms; journal, Seventh session).")
    single_token_gemv: bool = Field(True, description="One token runs GEMV kernels without the route kernel or 16-row "
                                    "tiles (33.9 us against 51.9 for the general kernel; journal, Eighth session).")
    block_n_gemv: PowerOfTwo = Field(16, description="Output rows per GEMV program (gate/up: twice, gate and up): the "
                                     "one-token sweep's best (journal, Ninth session).")
    block_k_gemv: PowerOfTwo = Field(512, description="Input elements per GEMV step; a step of several groups reads one "
                                     "scale per group (26.2 us against 33.5 at 128 with gate/up whole; journal, Ninth "
                                     "session).")
    split_k_gemv_gate_up: int = Field(4, ge=1, le=64, description="K parts of the one-token gate/up GEMV (> 1: float32 "
                                      "parts, then an activation launch; with block_k_gemv 512 the sweep's best of 42; "
                                      "journal, Ninth session).")



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
    router_and_gate: bool = Field(True, description="The non-exact forward (and the exact one with exact_rowwise) fuses "
                                  "the router's softmax + top-k and the shared expert's gate, one launch each (journal, "
                                  "Seventh session). Off: torch's ops, for A/B.")
    packed_qkv: bool = Field(True, description="The non-exact forward projects q, k and v with one product over the "
                             "packed weights (0.22 ms per draft step; journal, Ninth session). Off: three products, for A/B.")
    packed_ffn_input: bool = Field(True, description="The non-exact Qwen2-MoE-style layer runs its router, shared gate "
                                   "and shared gate/up as one packed product (0.12 ms per draft step; journal, Ninth "
                                   "session). Off: separate products, for A/B.")
    residual_addend: bool = Field(True, description="The non-exact forward adds the residual inside the attention's "
                                  "output product: one launch fewer, no measurable change (2.60 ms either way; journal, Ninth "
                                  "session). Off: a separate add, for A/B.")
    exact_rowwise: bool = Field(False, description="The exact forward (the target: prefill, decode and verify, eager "
                                "and static alike, so every pair of paths the exactness contract compares runs the same "
                                "kernels) also takes the fused launches that compute each row on its own: RMSNorm, RoPE, "
                                "the router's softmax + top-k, the shared expert's gate and each row's attention over "
                                "its visible positions (a launch and a merge), one launch each where torch issues 3 to "
                                "8, or one per row in the eager attention (about 30 fewer of the static step's 55 "
                                "launches per layer for the Qwen/Mixtral/OLMoE families; DeepSeek-V2 its three norms "
                                "only, its attention, RoPE and routing being its own; Phi-MoE its RoPE and attention). "
                                "CUDA, or Triton's interpreter. Off until measured on the H200; its tokens: "
                                "tests/test_exact_rowwise.py.")
    row_kernels: bool = Field(True, description="The draft step runs Qwen2-MoE-style layers through the one-row "
                              "kernels of specter/model/rowfused.py (draft step 2.30 -> 1.81 ms; journal, Tenth "
                              "session). Off: the general non-exact forward, for A/B and the kernel tests.")
    row: RowTiles = Field(default_factory=RowTiles, description="Tiles and paths of the one-row kernels: each default "
                          "the best a sweep or an A/B found (journal, Tenth to Twelfth sessions).")
    moe: MoETiles = Field(default_factory=MoETiles, description="Tiles of the draft's quantized MoE kernels (one token: "
                          "51.9 us in the general kernel, 26.2 in the GEMVs at the swept tiles; journal, Eighth and "
                          "Ninth sessions).")
    resident: MoETiles = Field(default_factory=lambda: MoETiles(block_n_gate_up=16, block_n_down=16),
                               description="Tiles of the resident bf16 experts' Triton kernel (specter/model/graphed.py): "
                               "narrow column blocks, so a one-row decode has enough programs to fill the GPU (chosen, "
                               "not swept; the graphed resident decode: journal, Resident decoding). The static target "
                               "and the segmented verify read the same tiles, so their logits agree bit for bit.")


class HostTuning(_Frozen):
    """The host expert path (specter/experts/host.py)."""

    parallel_experts: bool = Field(False, description="Compute a layer's host experts each on its own one-thread worker, "
                                   "up to cpu_threads at once, instead of one after another, each on a team of cpu_threads "
                                   "torch threads. A one-thread expert's result does not depend on what runs beside it, "
                                   "so the tokens stay a function of the config. Off until measured on the H200's host "
                                   "(benchmarks/host_expert.py's parallel mode; on the 2-core development Xeon, cold, 1.64 against "
                                   "1.91 ms per expert, and 1.8 against 8.2 while another process took a core); its tokens: "
                                   "tests/test_hybrid.py, tests/test_host_experts.py.")
    kernel: Literal["auto", "torch", "native"] = Field(
        "auto", description="The host path's expert kernel: 'torch' (the F.linear chain on zero-padded blocks of "
        "row_bucket rows), 'native' (specter/experts/native.py: AMX, else AVX512-BF16, else AVX2 with FMA, weights read once as "
        "they lie, each row on its own at any count; needs a C compiler), or 'auto': the faster of those available as "
        "the load's calibration times them, stored with the costs. On the H200's host (15 threads, cold) the host path with "
        "native against torch: Mixtral's expert 4.2 / 5.1 ms against 7.5 / 7.9 at 1 / 16 rows, Qwen1.5-MoE's 0.67 against "
        "1.1-1.2 (benchmarks/host_expert.py, docs/BENCHMARKS.md \"The native host kernel\"). Tokens: "
        "tests/test_native_kernel.py.")


class TuningConfig(_Frozen):
    """Measured knobs of the runtime, by the part they tune; every default is the measured best, but
    `host.parallel_experts` and `kernels.exact_rowwise`, off until they are measured on the GPU machine.

    Each field says where its default was measured: a test, a section of docs/BENCHMARKS.md, or "journal, SECTION", a
    section of the H200 measurement journal of 2026-11-29/30, kept in git history (`git show
    7950860:docs/journal.md`; the raw files it names, `git log --diff-filter=D -- PATH`)."""

    cache: CacheTuning = Field(default_factory=CacheTuning, description="The expert cache's rolling window and lead.")
    transfer: TransferTuning = Field(default_factory=TransferTuning, description="The transfer engine's pump.")
    verify: VerifyTuning = Field(default_factory=VerifyTuning, description="The offloaded verify.")
    kernels: KernelTuning = Field(default_factory=KernelTuning, description="The static steps and the draft's kernels.")
    host: HostTuning = Field(default_factory=HostTuning, description="The host expert path.")

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
        value = json.loads(text)
    except json.JSONDecodeError:
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
                                    "(default): the host's cores less one, at least 1, so that the event loop, which "
                                    "issues the device's work and the copies while the host computes, keeps a core "
                                    "(reasoned, not yet measured: specter.experts.host.default_threads). Fewer emulate "
                                    "a smaller host.")
    placement_profile: Path | None = Field(None, description="A routing trace (`generate --trace`, specter/trace.py) of "
                                           "this model whose per-layer expert use the placement's cost model weighs "
                                           "(`auto`: the least used go to the host first). None (default): uniform "
                                           "routing assumed. Checked at every load (a file that is not a trace of "
                                           "this model's shape is refused); placed from by any cpu_experts but 'off'.")
    placement_overlap: float | None = Field(None, ge=0.0, le=1.0, description="The `overlap` of the placement plug-in "
                                            "named by cpu_experts (`auto`'s cost model): the share of the shorter of a "
                                            "layer's two paths, host compute and copies, that hides under the longer; 1 "
                                            "prices a layer at the longer path, 0 at their sum. A higher value puts "
                                            "experts on the host even where one costs more there than its copy, to take "
                                            "bytes off a busy link. None (default): the plug-in's own (`auto`: 0). "
                                            "docs/BENCHMARKS.md, 'The hybrid with overlapped paths', measures 1 against "
                                            "it. A plug-in that takes no `overlap` is refused at load; ignored with "
                                            "cpu_experts 'off'.")
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
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 is greedy; otherwise logits are divided by it before sampling "
                               "(below 1e-5, specter.sampling.MIN_SAMPLING_TEMPERATURE: greedy's argmax, the limit).")
    top_k: int | None = Field(None, ge=1, description="Keep only the k most likely tokens when sampling.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling: keep the smallest set with this much probability.")
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
