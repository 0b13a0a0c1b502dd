"""GPTQ calibration of the draft: Hessians from activations of tokens the target itself produces.

The target decodes a few local prompts greedily; at every MoE layer a recording provider keeps the rows
each expert saw. Each expert's gate/up weights are then GPTQ-quantized against H_in = X^T X of its inputs,
and its down projection against H_mid of silu(gate x) * up x, computed from the full-precision weights.
The rows stay where the target computed them, and a layer's GPTQ runs on that device (float64 on the GPU
for a CUDA target, the CPU for a CPU one); the experts' weights are brought there, whatever pool holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specter.config import DraftConfig
from specter.draft import BITS, layer_group
from specter.log import get_logger
from specter.model.transformer import ExpertMLP, ExpertProvider
from specter.model.weights import unpack_expert
from specter.quant import ExpertHessians, QuantizedExperts, gptq_quantize_experts

log = get_logger(__name__)
Tensor = torch.Tensor

# Token ids of the default calibration prompts are drawn per vocabulary from this seed.
DEFAULT_PROMPTS = 8
DEFAULT_PROMPT_LEN = 16
DEFAULT_NEW_TOKENS = 32


class RecordingExperts:
    """Wraps an ExpertProvider and keeps, per MoE layer, every input row and the experts it chose."""

    def __init__(self, inner: ExpertProvider) -> None:
        self.inner = inner
        self.inputs: dict[int, list[Tensor]] = {}
        self.choices: dict[int, list[Tensor]] = {}

    async def run(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor, mlp: ExpertMLP) -> Tensor:
        # Copies on x's own device (no host sync): the target may reuse its buffers.
        self.inputs.setdefault(layer, []).append(x.detach().to(torch.float32, copy=True))
        self.choices.setdefault(layer, []).append(ids.detach().clone())
        return await self.inner.run(layer, x, ids, weights, mlp)

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        return torch.cat(self.inputs[layer]), torch.cat(self.choices[layer])


def default_prompts(vocab_size: int, count: int = DEFAULT_PROMPTS, length: int = DEFAULT_PROMPT_LEN) -> list[list[int]]:
    generator = torch.Generator().manual_seed(20261129)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def gptq_layer(flats: Sequence[Tensor], inputs: Tensor, choices: Tensor, hidden: int, inter: int, config: DraftConfig,
               chunk: int | None = None, to: torch.device | str | None = None) -> QuantizedExperts:
    """GPTQ-quantize one layer's experts (packed flats) from its recorded inputs [n, D] and choices [n, A], on the
    inputs' device (the flats are copied there); `chunk` experts at a time (`gptq_quantize_batch`). On a GPU without
    room for the layer's Hessians and working memory (calibration runs beside the loaded model and its expert cache),
    the layer runs on the CPU instead, with a warning. The codes end on `to` (default: the inputs' device)."""
    to = inputs.device if to is None else torch.device(to)
    if _on_gpu(inputs):
        try:
            return _gptq_layer(flats, inputs, choices, hidden, inter, config, chunk).to(to)
        except torch.cuda.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            log.warning("calibrate.gptq_on_cpu", reason=str(error).splitlines()[0][:200], hint="GPTQ of this layer "
                        "did not fit beside the loaded model on the GPU; it runs on the CPU (slower, same algorithm)")
        inputs, choices = inputs.cpu(), choices.cpu()
    return _gptq_layer(flats, inputs, choices, hidden, inter, config, chunk).to(to)


def _on_gpu(inputs: Tensor) -> bool:
    return inputs.device.type == "cuda"


def _gptq_layer(flats: Sequence[Tensor], inputs: Tensor, choices: Tensor, hidden: int, inter: int, config: DraftConfig,
                chunk: int | None) -> QuantizedExperts:
    device = inputs.device
    gate_up, down = zip(*(unpack_expert(flat.to(device).float(), hidden, inter) for flat in flats))
    gate_up, down = torch.stack(gate_up), torch.stack(down)  # [E, 2I, D], [E, D, I]
    choices = choices.to(device)
    hessians_in = ExpertHessians(len(flats), hidden, device)
    hessians_in.add(inputs, choices)
    hessians_mid = ExpertHessians(len(flats), inter, device)
    for expert in range(len(flats)):
        routed = (choices == expert).any(dim=1)
        rows = inputs[routed]
        h = F.linear(rows, gate_up[expert])
        hessians_mid.experts[expert].add(F.silu(h[:, :inter]) * h[:, inter:])
    group = layer_group(hidden, inter, config.group_size)
    h_in, h_mid = hessians_in.stacked(), hessians_mid.stacked()
    del hessians_in, hessians_mid  # the stacked copies are all GPTQ needs (on a GPU: 3 GB less at the Qwen shape)
    return gptq_quantize_experts(gate_up[:, :inter], gate_up[:, inter:], down, h_in, h_mid, BITS[config.quant], group,
                                 chunk=chunk)


async def calibrate(decode: Callable[[list[int]], object], recorder: RecordingExperts, prompts: Sequence[list[int]]) -> None:
    """Run `decode(prompt)` (an awaitable target-only greedy decode through `recorder`) for every prompt."""
    for prompt in prompts:
        await decode(prompt)  # type: ignore[misc]
    log.info("calibrate.done", prompts=len(prompts), layers=len(recorder.inputs))
