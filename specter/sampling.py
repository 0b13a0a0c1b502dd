"""Logits processing (temperature, top-k, top-p) and seeded Gumbel-max sampling whose noise depends only
on (seed, position, token), so the draft, the verify pass and the baseline draw the same sample."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from specter.errors import ConfigError

# Shape legend: T rows (one per position being produced), V vocabulary.

_MASK32 = 0xFFFFFFFF
_SQRT_HALF = math.sqrt(0.5)
_LN2 = math.log(2.0)
# atanh(s) / s = 1 + s^2/3 + s^4/5 + ...; |s| <= 0.172 here, so six terms are below float32 precision.
_ATANH_SERIES = (1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0)


class SamplingLike(Protocol):
    """Anything with the four sampling fields (SamplingParams, the config's GenerationConfig)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int


MIN_SAMPLING_TEMPERATURE = 1e-5
"""Temperatures in (0, this) sample as their limit, greedy's argmax: dividing float32 logits by them would overflow
to inf (1e-39 turns two logits into inf, a tie Gumbel noise cannot break) or, below float32's smallest number, divide
by zero into NaN. At 1e-5 a logit gap of 1e-4 is already a factor e^10 in probability, so nothing is lost."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens; temperature 0 is greedy (top-k/top-p then do nothing)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_sampling_values(self.temperature, self.top_k, self.top_p)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed={self.seed!r} is not an integer; pass an int such as 0 or 1234")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling_values(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ConfigError for a temperature, top-k or top-p that transformers would also refuse."""
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ConfigError(f"temperature={temperature!r} is invalid; use 0 for greedy or a positive finite number")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ConfigError(f"top_k={top_k!r} is invalid; use a positive integer, or None (or 0) to disable it")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ConfigError(f"top_p={top_p!r} is invalid; use a number in (0, 1], or None to disable it")


# ---------------------------------------------------------------------------------------------------
# Logits processing


def process_logits(logits: Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Float32 logits [..., V] after temperature, top-k, top-p (transformers' warpers, in that order).

    Tokens outside the kept set are -inf. Temperature 0 (greedy) keeps only the argmax (lowest index on
    ties) at 0.0, and so does a positive one below MIN_SAMPLING_TEMPERATURE, greedy's limit. Each row is processed on its own, so results are bit-identical whatever else is in the
    batch (the verify pass relies on this to match the one-row baseline).
    """
    check_sampling_values(temperature, top_k, top_p)
    scores = logits.float()
    if temperature < MIN_SAMPLING_TEMPERATURE:
        return _keep_argmax_only(scores)
    if temperature != 1.0:  # transformers skips the warper at 1.0 too; dividing by 1.0 is exact anyway
        scores = scores / temperature
    if top_k:  # None and 0 both mean "off", as in transformers' GenerationConfig
        scores = _keep_top_k(scores, top_k)
    if top_p is not None and top_p < 1.0:
        scores = _keep_top_p(scores, top_p)
    return scores


def _keep_argmax_only(scores: Tensor) -> Tensor:
    best = scores.argmax(dim=-1, keepdim=True)  # torch returns the first maximum: lowest index wins ties
    kept = torch.full_like(scores, -math.inf)
    return kept.scatter(-1, best, 0.0)


def _keep_top_k(scores: Tensor, top_k: int) -> Tensor:
    kth_best = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
    # Ties with the k-th value stay, exactly as TopKLogitsWarper does.
    return scores.masked_fill(scores < kth_best, -math.inf)


def _keep_top_p(scores: Tensor, top_p: float) -> Tensor:
    # TopPLogitsWarper's rule: sort ascending and drop the tail whose total mass is <= 1 - top_p.
    sorted_scores, order = torch.sort(scores, dim=-1, stable=True)
    cumulative = _inclusive_prefix_sum(sorted_scores.softmax(dim=-1))
    drop_sorted = cumulative <= 1.0 - top_p
    drop_sorted[..., -1] = False  # the most likely token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def _inclusive_prefix_sum(values: Tensor) -> Tensor:
    """Cumulative sum along the last dim by log-step doubling (Hillis-Steele).

    Not torch.cumsum: on CUDA a one-row cumsum takes a different algorithm (CUB) from a many-row one, so
    its rounding depends on the batch. Here every element is the same sequence of adds in any batch.
    """
    total = values
    width = values.shape[-1]
    shift = 1
    while shift < width:
        shifted_sum = total[..., shift:] + total[..., :-shift]
        total = torch.cat([total[..., :shift], shifted_sum], dim=-1)
        shift *= 2
    return total


# ---------------------------------------------------------------------------------------------------
# Counter-based noise: integer hashing in 32-bit lanes of int64, exact on every device.


def _mul32(x: Tensor | int, constant: int) -> Tensor | int:
    """x * constant mod 2**32 for 0 <= x < 2**32, in 16-bit halves so no int64 product can overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: Tensor | int) -> Tensor | int:
    """lowbias32 (C. Wellons): a bijective 32-bit mixer with near-ideal avalanche; ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _position_keys(seed: int | Tensor, positions: Tensor) -> Tensor:
    """One 32-bit key per position [T]; a bijection of the position for a fixed seed (positions < 2**32)."""
    seed_low = _mix32((seed & _MASK32) ^ 0x243F6A88)
    seed_high = _mix32(((seed >> 32) & _MASK32) ^ 0x85A308D3)
    key = _mix32((positions & _MASK32) ^ seed_low)
    key = _mix32(key ^ ((positions >> 32) & _MASK32))
    return _mix32(key ^ seed_high)


def random_bits(seed: int | Tensor, positions: Tensor, vocab: int) -> Tensor:
    """Int64 [T, V] of 32 random bits for each (position, token); independent of V, batch and device."""
    positions = positions.to(torch.int64)
    keys = _position_keys(seed, positions)  # [T]
    token_hashes = _mix32(torch.arange(vocab, device=positions.device, dtype=torch.int64) ^ 0x13198A2E)  # [V]
    return _mix32(keys[:, None] ^ token_hashes[None, :])


def uniform_noise(seed: int | Tensor, positions: Tensor, vocab: int) -> Tensor:
    """Float32 [T, V] uniform in (0, 1), never 0 or 1: (2m + 1) / 2**24 for 23 random bits m."""
    # 23 bits, not 24, so that (2m + 1) fits the float32 significand and 1 - 2**-24 is the largest value.
    mantissa = random_bits(seed, positions, vocab) >> 9
    return (mantissa * 2 + 1).to(torch.float32) * 2.0**-24


def gumbel_noise(seed: int | Tensor, positions: Tensor, vocab: int) -> Tensor:
    """Float32 [T, V] standard Gumbel noise -log(-log(u)) for the tokens produced at `positions`.

    Depends only on (seed, position, token index): the same bits on every device and in every batch.
    Sync-free and CUDA-graph capturable (seed may be a 0-d int64 tensor so a graph serves any request).
    """
    return -_ln(-_ln(uniform_noise(seed, positions, vocab)))


def _ln(x: Tensor) -> Tensor:
    """Natural log of positive normal float32 values, built from IEEE-exact elementwise ops only.

    torch.log runs different code for the same element (vectorised body vs scalar tail, MKL, CUDA libm)
    depending on tensor size and device, which would make the noise batch- and device-dependent; frexp,
    where, +, * and tensor/tensor division are correctly rounded everywhere. Error about 2 ulp.
    """
    fraction, exponent = torch.frexp(x)  # x = fraction * 2**exponent, fraction in [0.5, 1)
    below = fraction < _SQRT_HALF
    fraction = torch.where(below, fraction * 2.0, fraction)  # now in [sqrt(1/2), sqrt(2))
    exponent = (exponent - below.to(exponent.dtype)).to(torch.float32)
    offset = fraction - 1.0  # exact (Sterbenz), so log(x) stays accurate for x near 1
    s = offset / (offset + 2.0)  # ln(1 + r) = 2 atanh(r / (2 + r))
    s_squared = s * s
    series = torch.full_like(s, _ATANH_SERIES[0])
    for coefficient in _ATANH_SERIES[1:]:
        series = series * s_squared + coefficient
    return exponent * _LN2 + (s * 2.0) * series


# ---------------------------------------------------------------------------------------------------
# Sampling


def sample(logits: Tensor, positions: Tensor, params: SamplingLike) -> Tensor:
    """Int64 [T] tokens for logits [T, V]; row t produces the token at absolute sequence index positions[t].

    Greedy (temperature 0): argmax, lowest index on ties. Otherwise the Gumbel-max trick on the processed
    logits with noise seeded by (params.seed, position). Sync-free: returns a device tensor.
    """
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p)
    noise = gumbel_noise(params.seed, positions, logits.shape[-1])
    return (scores + noise).argmax(dim=-1)


def probs(logits: Tensor, params: SamplingLike) -> Tensor:
    """Float32 [T, V] probabilities after processing (one-hot at the argmax when greedy)."""
    return process_logits(logits, params.temperature, params.top_k, params.top_p).softmax(dim=-1)
