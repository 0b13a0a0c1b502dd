"""GPTQ calibration of the draft (`specter.calibrate`): where a layer's GPTQ runs, and that chunking changes nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specter.calibrate import RecordingExperts, gptq_layer
from specter.config import DraftConfig

HIDDEN, INTER, EXPERTS = 64, 32, 6
CONFIG = DraftConfig(quant="gptq4", group_size=16)


def layer_inputs(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Packed bf16 flats of a layer's experts (as a host pool holds them), 200 recorded rows and their top-2 choices;
    expert 5 is never routed (its Hessians are empty) and inputs 0-2 are always zero (dead)."""
    generator = torch.Generator().manual_seed(seed)
    flats = [torch.randn(3 * HIDDEN * INTER, generator=generator).to(torch.bfloat16) for _ in range(EXPERTS)]
    inputs = torch.randn(200, HIDDEN, generator=generator)
    inputs[:, :3] = 0
    choices = torch.stack([torch.randperm(EXPERTS, generator=generator)[:2] for _ in range(200)])
    choices[choices == 5] = 0
    return flats, inputs, choices


def same_layer(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.w13, b.w13), (a.w13_scales, b.w13_scales), (a.w2, b.w2), (a.w2_scales, b.w2_scales)))


def test_gptq_layer_on_the_cpu_is_chunk_invariant_and_stays_there() -> None:
    flats, inputs, choices = layer_inputs()
    whole = gptq_layer(flats, inputs, choices, HIDDEN, INTER, CONFIG)
    assert whole.w13.device.type == "cpu" and whole.w2_scales.device.type == "cpu"
    assert whole.w13.shape[0] == EXPERTS and whole.bits == 4
    for chunk in (1, 4):
        assert same_layer(gptq_layer(flats, inputs, choices, HIDDEN, INTER, CONFIG, chunk=chunk), whole), chunk


def test_a_layer_that_does_not_fit_on_the_gpu_runs_on_the_cpu(monkeypatch) -> None:
    """Calibration runs beside the loaded model: a GPU out of memory for one layer's GPTQ sends that layer to the CPU
    (same codes as a CPU run), it does not fail the load."""
    from specter import calibrate

    flats, inputs, choices = layer_inputs()
    expected = gptq_layer(flats, inputs, choices, HIDDEN, INTER, CONFIG)
    real, attempts = calibrate._gptq_layer, []

    def out_of_memory_once(*args):
        attempts.append(args[1].device.type)
        if len(attempts) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(*args)

    monkeypatch.setattr(calibrate, "_on_gpu", lambda tensor: True)  # (this machine has no GPU: the branch is taken)
    monkeypatch.setattr(calibrate, "_gptq_layer", out_of_memory_once)
    assert same_layer(gptq_layer(flats, inputs, choices, HIDDEN, INTER, CONFIG), expected)
    assert attempts == ["cpu", "cpu"]  # the GPU attempt, then the CPU one


def test_recording_keeps_copies_on_the_inputs_device() -> None:
    class Inner:
        async def run(self, layer, x, ids, weights, mlp):
            return x

    recorder = RecordingExperts(Inner())  # type: ignore[arg-type]
    x, ids = torch.randn(3, HIDDEN), torch.tensor([[0, 1], [2, 3], [1, 4]])
    asyncio.run(recorder.run(0, x, ids, torch.ones(3, 2), None))  # type: ignore[arg-type]
    x.zero_()  # the target reusing its buffer must not change what was recorded
    ids.zero_()
    inputs, choices = recorder.layer(0)
    assert inputs.abs().sum() > 0 and choices.sum() > 0 and inputs.device == x.device and inputs.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_layer_runs_on_the_gpu_of_its_activations() -> None:
    """Activations recorded on CUDA put the layer's GPTQ there (the flats come from the host pool) and give the CPU's
    codes, up to rows where float64 sums ordered differently flip a code (see test_quant's CUDA test).

    Expert 5 is never routed: its Hessian is the damping alone, so its codes are round-to-nearest of bf16 weights, whose
    quotients by the scale land on exact .5 ties, and the GPU inverse's off-diagonal residue (~1e-17, exactly 0 on the
    CPU) tips some of them the other way (H200, 2026-11-30: 6 of 384 gate/up rows differed, those the failure showed in
    that expert). So the routed experts' codes are held to the CPU's, and the whole layer's weights to within 1 %."""
    flats, inputs, choices = layer_inputs(seed=1)
    on_cpu = gptq_layer(flats, inputs, choices, HIDDEN, INTER, CONFIG)
    on_cuda = gptq_layer(flats, inputs.cuda(), choices.cuda(), HIDDEN, INTER, CONFIG)
    assert on_cuda.w13.device.type == "cuda" and on_cuda.w2_scales.device.type == "cuda"
    to_host = gptq_layer(flats, inputs.cuda(), choices.cuda(), HIDDEN, INTER, CONFIG, to="cpu")  # calibrate_draft's
    assert to_host.w13.device.type == "cpu" and torch.equal(to_host.w13, on_cuda.w13.cpu())
    routed = slice(0, EXPERTS - 1)
    for got, want in ((on_cuda.w13, on_cpu.w13), (on_cuda.w2, on_cpu.w2)):
        rows = (got[routed].cpu() != want[routed]).any(dim=-1)
        assert rows.float().mean() <= 0.01, f"{int(rows.sum())} of {rows.numel()} routed rows differ"
    for got, want in ((on_cuda.dequantize_w13(), on_cpu.dequantize_w13()), (on_cuda.dequantize_w2(), on_cpu.dequantize_w2())):
        gap = (got.cpu().double() - want.double()).norm() / want.double().norm()
        assert gap < 1e-2, gap


@pytest.mark.parametrize("max_context", [8, 12])
def test_a_gptq_draft_calibrates_in_the_smallest_contexts(max_context) -> None:
    """Calibration decodes its 16-token prompts into the engine's own KV: with max_context below 16 (8 is allowed)
    the load failed with a bare AssertionError. The draft speculates, and its tokens equal plain decoding's."""
    from specter import EngineConfig, SyncEngine

    config = EngineConfig(device="cpu", max_context=max_context, draft=DraftConfig(k=3, quant="gptq4"))
    with SyncEngine("tiny", config) as engine:
        speculated = engine.complete([1, 2, 3], max_new_tokens=4)
        assert engine.engine.runtime.draft is not None
    with SyncEngine("tiny", config.model_copy(update={"draft": DraftConfig(k=0, k_max=0)})) as plain:
        assert speculated.token_ids == plain.complete([1, 2, 3], max_new_tokens=4).token_ids
