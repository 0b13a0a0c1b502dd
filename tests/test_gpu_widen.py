"""Widening on CUDA (`WidenedCheckpoint(..., device="cuda")`, what the bench and the realism report do on a GPU) against
widening on the CPU: the same tensors bit for bit for every family (F = 3 too, where W/F is rounded), what the engine's
loaders make of them (dense weights, packed experts on the device), and the same greedy tokens from a widened
runtime and from the bench. The CPU-side checks (against the first implementation) are tests/test_widen.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from specter.bench import protocol, widen
from specter.build import CheckpointWeights
from specter.config import DraftConfig, EngineConfig, GenerationConfig
from specter.engine import Runtime
from specter.experts.pool import ExpertPool
from tests.test_bench_widen import bench
from tests.test_widen import BUILDERS, check_widened_on

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = [3, 17, 42, 5, 88, 12, 7, 60]


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-widen")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def same_widening(path: Path, factor: int, dtype: torch.dtype | None, device: str = "cuda") -> None:
    """Every tensor widened on `device` equals the CPU's widening bit for bit (and stays on `device`)."""
    on_cpu, on_device = widen.WidenedCheckpoint(path, factor, dtype), widen.WidenedCheckpoint(path, factor, dtype, device)
    for name in on_cpu.names():
        expected, got = on_cpu.tensor(name), on_device.tensor(name)
        assert got.device.type == torch.device(device).type and (got.dtype, got.shape) == (expected.dtype, expected.shape), name
        assert torch.equal(got.cpu(), expected), f"'{name}' widened x{factor} on {device} differs from the CPU's widening"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("factor", [2, 3, 4])
@pytest.mark.parametrize("family", list(BUILDERS))
def test_widening_on_cuda_is_the_cpus_bit_for_bit(family, factor, dtype, narrow):
    same_widening(narrow[family], factor, dtype)
    assert check_widened_on("cuda", narrow[family], factor, dtype) > 0  # and the first implementation's


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])  # fused 3-D experts; per-expert; MLA
def test_the_engines_loaders_take_the_cuda_widening(family, narrow):
    """CheckpointWeights over each: the same dense tensors on the device, the same packed experts, which the CUDA
    widening hands over on the device (the pool copies each into pinned memory; the quantizer reads it there)."""
    dtype, cuda = torch.bfloat16, torch.device("cuda")
    on_cpu = CheckpointWeights(widen.WidenedCheckpoint(narrow[family], 3, dtype))
    on_cuda = CheckpointWeights(widen.WidenedCheckpoint(narrow[family], 3, dtype, "cuda"))
    dense_cpu, dense_cuda = on_cpu.dense(dtype, cuda, False), on_cuda.dense(dtype, cuda, False)
    assert dense_cpu.keys() == dense_cuda.keys() and all(torch.equal(dense_cpu[n], dense_cuda[n]) for n in dense_cpu)
    count = 0
    for (layer, expert, flat), (layer2, expert2, flat2) in zip(on_cpu.experts(dtype, False), on_cuda.experts(dtype, False), strict=True):
        assert (layer, expert) == (layer2, expert2) and flat.device.type == "cpu" and flat2.is_cuda
        assert torch.equal(flat, flat2.cpu()), (layer, expert)
        count += 1
    assert count == len(on_cpu.spec.moe_layers) * on_cpu.spec.num_experts


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_the_checks_catch_a_cuda_widening_without_the_scale(family, narrow, monkeypatch):
    """The meta-test: a widening that forgets the 1/F on CUDA only fails both comparisons."""
    scaled = widen._scaled
    monkeypatch.setattr(widen, "_scaled", lambda tensor, factor: tensor if tensor.is_cuda else scaled(tensor, factor))
    with pytest.raises(AssertionError, match="differs from the CPU's widening"):
        same_widening(narrow[family], 2, torch.bfloat16)
    with pytest.raises(AssertionError, match="differs from the first CPU widening"):
        check_widened_on("cuda", narrow[family], 2, torch.bfloat16)


def greedy_tokens(path: Path, widen_on: str, config: EngineConfig, writes: list[str]) -> list[int]:
    """Greedy tokens of the runtime built from the checkpoint at `path` widened x2 in bf16 on `widen_on`."""
    async def go():
        async with await Runtime.build(CheckpointWeights(widen.WidenedCheckpoint(path, 2, torch.bfloat16, widen_on)), config) as runtime:
            return (await runtime.complete_ids(PROMPT, GenerationConfig(max_new_tokens=16))).tokens

    writes.clear()
    return asyncio.run(go())


@pytest.mark.parametrize("residents", [None, 4])  # every expert resident; offloaded: the pinned pool and the draft's quantizer
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "phimoe", "deepseek_v2"])
def test_a_widened_runtime_on_cuda_gives_the_cpu_widenings_tokens(family, residents, narrow, monkeypatch):
    writes: list[str] = []
    write = ExpertPool.write

    def spy(self, layer, expert, flat):
        writes.append(flat.device.type)
        return write(self, layer, expert, flat)

    monkeypatch.setattr(ExpertPool, "write", spy)
    config = EngineConfig(device="cuda", max_context=96, residents=residents, draft=DraftConfig(k=4))
    tokens = {}
    for widen_on in ("cpu", "cuda"):
        tokens[widen_on] = greedy_tokens(narrow[family], widen_on, config, writes)
        assert set(writes) == (set() if residents is None else {widen_on})  # the pool took the experts from where they were widened
    assert len(tokens["cuda"]) == 16 and tokens["cuda"] == tokens["cpu"]


def test_the_bench_widens_on_cuda_with_the_cpu_widenings_tokens(tmp_path, monkeypatch):
    """`--widen 2` with the default device (auto: CUDA) widens there; the same bench widening on the CPU (the way it
    was) gives the same baseline tokens, resident and offloaded, and every cell holds to them."""
    devices = []

    class Recording(widen.WidenedCheckpoint):
        def __init__(self, path, factor, dtype=None, device="cpu"):
            super().__init__(path, factor, dtype, device)
            devices.append(self.device.type)

    class OnTheCPU(Recording):
        def __init__(self, path, factor, dtype=None, device="cpu"):
            super().__init__(path, factor, dtype, "cpu")

    args = ("--model", "tiny", "--widen", "2", "--systems", "resident,ondemand,specter-fixed")
    monkeypatch.setattr(protocol, "WidenedCheckpoint", Recording)
    on_cuda, cuda_bench = bench(tmp_path / "cuda", monkeypatch, *args)
    assert devices and set(devices) == {"cuda"}
    devices.clear()
    monkeypatch.setattr(protocol, "WidenedCheckpoint", OnTheCPU)
    on_cpu, cpu_bench = bench(tmp_path / "cpu", monkeypatch, *args)
    assert devices and set(devices) == {"cpu"}
    assert all(row["tokens_equal"] for row in on_cuda["summary"] + on_cpu["summary"]), on_cuda["summary"]
    assert cuda_bench.baseline and cuda_bench.baseline == cpu_bench.baseline
    assert cuda_bench.offloaded_baseline and cuda_bench.offloaded_baseline == cpu_bench.offloaded_baseline
