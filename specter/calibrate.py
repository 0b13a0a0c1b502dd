"""GPTQ calibration of the draft: Hessians from activations of tokens the target itself produces.

The target decodes a few local prompts greedily; at every MoE layer a recording provider keeps the rows
each expert saw. Each expert's gate/up weights are then GPTQ-quantized against H_in = X^T X of its inputs,
and its down projection against H_mid of silu(gate x) * up x, computed from the full-precision weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specter.config import DraftConfig
from specter.draft import BITS, draft_group
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
        self.inputs.setdefault(layer, []).append(x.detach().float().cpu())
        self.choices.setdefault(layer, []).append(ids.detach().cpu())
        return await self.inner.run(layer, x, ids, weights, mlp)

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        return torch.cat(self.inputs[layer]), torch.cat(self.choices[layer])


def default_prompts(vocab_size: int, count: int = DEFAULT_PROMPTS, length: int = DEFAULT_PROMPT_LEN) -> list[list[int]]:
    generator = torch.Generator().manual_seed(20261129)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def gptq_layer(flats: Sequence[Tensor], inputs: Tensor, choices: Tensor, hidden: int, inter: int, config: DraftConfig) -> QuantizedExperts:
    """GPTQ-quantize one layer's experts (packed flats) from its recorded inputs [n, D] and choices [n, A]."""
    gate_up, down = zip(*(unpack_expert(flat.float().cpu(), hidden, inter) for flat in flats))
    gate_up, down = torch.stack(gate_up), torch.stack(down)  # [E, 2I, D], [E, D, I]
    hessians_in = ExpertHessians(len(flats), hidden)
    hessians_in.add(inputs, choices)
    hessians_mid = ExpertHessians(len(flats), inter)
    for expert in range(len(flats)):
        routed = (choices == expert).any(dim=1)
        rows = inputs[routed]
        h = F.linear(rows, gate_up[expert])
        hessians_mid.experts[expert].add(F.silu(h[:, :inter]) * h[:, inter:])
    group = draft_group(hidden, config.group_size)
    if draft_group(inter, config.group_size) != group:
        group = -1
    return gptq_quantize_experts(gate_up[:, :inter], gate_up[:, inter:], down, hessians_in.stacked(), hessians_mid.stacked(),
                                 BITS[config.quant], group)


async def calibrate(decode: Callable[[list[int]], object], recorder: RecordingExperts, prompts: Sequence[list[int]]) -> None:
    """Run `decode(prompt)` (an awaitable target-only greedy decode through `recorder`) for every prompt."""
    for prompt in prompts:
        await decode(prompt)  # type: ignore[misc]
    log.info("calibrate.done", prompts=len(prompts), layers=len(recorder.inputs))
