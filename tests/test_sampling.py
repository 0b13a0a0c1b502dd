"""Logits processing against transformers' warpers, batch invariance, and the seeded Gumbel noise."""

from __future__ import annotations

import math

import pytest
import torch

from specter.errors import ConfigError
from specter.sampling import (
    SamplingParams,
    _ln,
    gumbel_noise,
    probs,
    process_logits,
    random_bits,
    sample,
    uniform_noise,
)

PROCESSING_CASES = [
    (0.7, None, None),
    (1.0, 5, None),
    (1.3, None, 0.9),
    (0.5, 3, 0.5),
    (2.0, 40, 0.95),
    (1.0, 1, None),
    (0.9, 1000, 0.3),  # top_k above V behaves as "keep all"
    (1.1, None, 1.0),  # top_p 1.0 is off
    (0.8, 7, 0.01),  # top_p so small only the best token survives
]


def _transformers_warped(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    # The same choice of warpers transformers' generate() makes from a GenerationConfig.
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), PROCESSING_CASES)
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(32, 97, generator=generator) * 3.0
    ours = process_logits(logits, temperature, top_k, top_p)
    theirs = _transformers_warped(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours, theirs)


def test_top_k_keeps_ties_with_the_kth_value_like_transformers():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    ours = process_logits(logits, 1.0, 2, None)
    assert torch.isfinite(ours).tolist() == [[True, False, True, True, False]]
    assert torch.equal(ours, _transformers_warped(logits, 1.0, 2, None))


def test_top_p_keeps_smallest_set_reaching_top_p():
    log_probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(process_logits(log_probs, 1.0, None, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(process_logits(log_probs, 1.0, None, 0.79)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(process_logits(log_probs, 1.0, None, 0.9)).tolist() == [[True, True, True, False]]


def test_greedy_processing_keeps_only_the_first_argmax():
    logits = torch.tensor([[0.0, 2.0, 5.0, 5.0], [9.0, 1.0, 9.0, 0.0]])
    processed = process_logits(logits, 0.0, 2, 0.5)
    assert torch.isfinite(processed).tolist() == [[False, False, True, False], [True, False, False, False]]
    assert probs(logits, SamplingParams()).tolist() == [[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [*PROCESSING_CASES, (0.0, None, None)])
def test_process_logits_is_batch_invariant(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(24, 3001, generator=generator) * 4.0
    logits[3] = torch.round(logits[3])  # many exact ties in one row
    together = process_logits(logits, temperature, top_k, top_p)
    alone = torch.cat([process_logits(row[None], temperature, top_k, top_p) for row in logits])
    assert torch.equal(together, alone)


@pytest.mark.parametrize(
    "params", [SamplingParams(0.0), SamplingParams(0.8, 50, 0.9, 3), SamplingParams(1.4, None, None, 9)]
)
def test_sample_is_batch_invariant(params):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 5003, generator=generator)
    positions = torch.arange(100, 109)
    together = sample(logits, positions, params)
    alone = torch.cat([sample(logits[i : i + 1], positions[i : i + 1], params) for i in range(9)])
    assert together.dtype == torch.int64
    assert torch.equal(together, alone)


def test_greedy_sample_breaks_ties_towards_lowest_index():
    logits = torch.tensor([[1.0, 4.0, 4.0, 4.0], [7.0, 7.0, 0.0, 0.0]])
    assert sample(logits, torch.arange(2), SamplingParams(0.0)).tolist() == [1, 0]


@pytest.mark.parametrize("temperature", [1e-6, 1e-37, 1e-39, 1e-46, 5e-324])
def test_a_tiny_positive_temperature_samples_greedys_tokens_without_overflow(temperature):
    """Dividing by 1e-39 overflowed two logits to inf (a tie noise cannot break) and 1e-46, zero in float32, made
    NaN; below MIN_SAMPLING_TEMPERATURE the limit, greedy's argmax, is taken instead."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 301, generator=generator) * 8.0
    logits[2, :2] = torch.tensor([2.0, 1.0])  # the helper's case: two large logits close together
    logits[2, 2:] = -1.0
    processed = process_logits(logits, temperature, None, 0.9)
    assert not torch.isnan(processed).any() and not (processed == math.inf).any()
    tokens = sample(logits, torch.arange(16), SamplingParams(temperature, None, 0.9, 7))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_temperatures_at_the_threshold_still_sample():
    """At MIN_SAMPLING_TEMPERATURE itself the logits are divided as at any temperature: the threshold is a floor."""
    from specter.sampling import MIN_SAMPLING_TEMPERATURE

    logits = torch.tensor([[0.0, 1e-6, 2e-6]])
    assert torch.equal(process_logits(logits, MIN_SAMPLING_TEMPERATURE), logits / MIN_SAMPLING_TEMPERATURE)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=math.nan),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(seed=1.5),
    ],
)
def test_invalid_sampling_params_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_process_logits_rejects_invalid_values():
    with pytest.raises(ConfigError, match="top_p"):
        process_logits(torch.zeros(1, 4), 1.0, None, 2.0)


def test_noise_depends_only_on_seed_position_and_token():
    positions = torch.tensor([0, 5, 17, 2**33 + 7, 1000])
    full = gumbel_noise(42, positions, 777)
    for subset in ([1, 3], [4], [0, 2, 4]):
        assert torch.equal(gumbel_noise(42, positions[subset], 777), full[subset])
    assert torch.equal(gumbel_noise(42, positions, 100), full[:, :100])  # the vocabulary size does not matter
    assert torch.equal(gumbel_noise(torch.tensor(42), positions, 777), full)  # a tensor seed, as in a graph
    small = [0, 1, 2, 4]  # positions that fit int32
    assert torch.equal(gumbel_noise(42, positions[small].to(torch.int32), 777), full[small])


def test_noise_changes_with_seed_and_position():
    positions = torch.arange(4)
    reference = random_bits(7, positions, 512)
    assert (random_bits(8, positions, 512) != reference).float().mean() > 0.99
    assert (random_bits(7 + 2**32, positions, 512) != reference).float().mean() > 0.99  # high seed bits count
    assert (random_bits(-7, positions, 512) != reference).float().mean() > 0.99
    assert (random_bits(7, positions + 1, 512)[:-1] != reference[1:]).float().mean() < 0.01  # shift = same rows
    assert (reference[1:] != reference[:-1]).float().mean() > 0.99


def test_uniform_noise_is_strictly_inside_unit_interval_and_uniform():
    uniforms = uniform_noise(123, torch.arange(50), 4000).flatten()
    assert uniforms.dtype == torch.float32
    assert 0.0 < uniforms.min().item() and uniforms.max().item() < 1.0
    ordered = uniforms.double().sort().values
    n = ordered.numel()
    ecdf_high = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks_distance = torch.maximum(ecdf_high - ordered, ordered - (ecdf_high - 1.0 / n)).max().item()
    assert ks_distance < 1.95 / math.sqrt(n)  # Kolmogorov-Smirnov critical value at alpha = 1e-3


def test_uniform_noise_is_uncorrelated_across_tokens_and_positions():
    centred = uniform_noise(9, torch.arange(200), 2000).double() - 0.5
    next_token = (centred[:, 1:] * centred[:, :-1]).mean().item() / centred.var().item()
    next_position = (centred[1:] * centred[:-1]).mean().item() / centred.var().item()
    assert abs(next_token) < 0.01 and abs(next_position) < 0.01


def test_gumbel_noise_moments():
    noise = gumbel_noise(2024, torch.arange(64), 8192).double()
    euler_gamma = 0.5772156649
    assert noise.mean().item() == pytest.approx(euler_gamma, abs=0.01)
    assert noise.var().item() == pytest.approx(math.pi**2 / 6, abs=0.02)


def test_exact_log_is_close_to_torch_log():
    generator = torch.Generator().manual_seed(0)
    edges = torch.tensor([2.0**-24, 1 - 2.0**-24, 1.0, 0.5])
    values = torch.cat([torch.rand(100_000, generator=generator) * 20.0, edges])
    values = values.clamp_min(2.0**-24)
    reference = values.double().log()
    error = (_ln(values).double() - reference).abs()
    assert (error <= 4e-7 * reference.abs().clamp_min(1.0)).all()
    assert _ln(torch.tensor([1 - 2.0**-24])).item() == pytest.approx(-(2.0**-24), rel=1e-6)  # accurate near 1


def test_gumbel_max_sample_follows_the_processed_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0, 0.2])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, seed=77)
    draws = 40_000
    tokens = sample(logits.expand(draws, -1), torch.arange(draws), params)
    expected = probs(logits[None], params)[0].double() * draws
    observed = torch.bincount(tokens, minlength=8).double()
    assert (observed[expected == 0] == 0).all()  # nothing outside top-k / top-p is ever drawn
    kept = expected > 0
    chi_square = (((observed - expected)[kept] ** 2) / expected[kept]).sum().item()
    assert chi_square < 20.515  # chi-square critical value, 5 degrees of freedom, alpha = 1e-3


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_noise_is_bit_identical_on_cuda_and_cpu():
    positions = torch.arange(3, 12)
    cpu = gumbel_noise(5, positions, 151_936)
    assert torch.equal(gumbel_noise(5, positions.cuda(), 151_936).cpu(), cpu)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("params", [SamplingParams(0.7, 50, 0.9, 1), SamplingParams(1.0, None, 0.95, 2)])
def test_processing_and_sampling_are_batch_invariant_on_cuda(params):
    logits = torch.randn(9, 151_936, device="cuda") * 3.0
    positions = torch.arange(40, 49, device="cuda")
    together = process_logits(logits, params.temperature, params.top_k, params.top_p)
    alone = torch.cat([process_logits(row[None], params.temperature, params.top_k, params.top_p) for row in logits])
    assert torch.equal(together, alone)
    tokens = torch.cat([sample(logits[i : i + 1], positions[i : i + 1], params) for i in range(9)])
    assert torch.equal(sample(logits, positions, params), tokens)


def test_each_token_decoded_without_a_draft_is_the_seeded_sample_of_its_position(tiny):
    """The engine's plain rounds (k = 0) against a reference outside its acceptance path: token i of the output is
    `sample` of the target's logits after prompt + tokens[:i] (one forward over the whole sequence), with the noise of
    its own absolute position len(prompt) + i."""
    import asyncio

    from specter.build import load_resident
    from specter.config import DraftConfig, EngineConfig, GenerationConfig
    from specter.decode import run_sync
    from specter.engine import Runtime

    prompt = [5, 17, 300, 42]
    for temperature, top_k, seed in ((1.0, None, 11), (0.8, 20, 4)):
        generation = GenerationConfig(max_new_tokens=10, temperature=temperature, top_k=top_k, seed=seed)

        async def decode() -> list[int]:
            config = EngineConfig(device="cpu", max_context=64, draft=DraftConfig(k=0))
            async with await Runtime.load(tiny, config) as runtime:
                return (await runtime.complete_ids(prompt, generation)).tokens

        tokens = asyncio.run(decode())
        loaded = load_resident(tiny, EngineConfig(device="cpu", max_context=64))
        sequence = torch.tensor(prompt + tokens[:-1])
        hidden = run_sync(loaded.model.forward(sequence, 0, loaded.model.new_kv(), loaded.experts))
        logits = loaded.model.logits(hidden)[len(prompt) - 1 :]  # row j produces the token at len(prompt) + j
        positions = torch.arange(len(prompt), len(prompt) + len(tokens))
        params = SamplingParams(temperature, top_k, None, seed)
        assert tokens == sample(logits, positions, params).tolist(), (temperature, seed)
        assert tokens[1:] != sample(logits, positions + 1, params).tolist()[1:]  # the position matters
