"""Plain decoding with the target alone, one token at a time: the baseline every mode is held to.

One greedy loop (`_greedy`) with two steps: the eager forward (`greedy_decode`) and the resident graphed R-row
step (`decode_resident_graphed`, which the GPU tests hold to the eager one). The engine's speculative round
(specter.engine.Runtime.round) is the third way to decode, and the one that serves requests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from specter.errors import PromptError
from specter.model.graphed import GraphedTarget, MoEKernel
from specter.model.kv import KVCache
from specter.model.resident import ResidentExperts
from specter.model.transformer import ExpertProvider, Transformer

T = TypeVar("T")
Step = Callable[[torch.Tensor, int, KVCache], Awaitable[torch.Tensor]]


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int, vocab_size: int, max_context: int,
                 positions: int | None = None) -> None:
    """Refuse a prompt before any work: empty, ids outside the vocabulary, or longer than the context.
    `positions`: the model's max_position_embeddings, so the advice says whether max_context can grow."""
    if len(prompt_ids) == 0:
        raise PromptError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
    check_context_length(len(prompt_ids), max_new_tokens, max_context, positions)


def check_context_length(prompt_tokens: int, max_new_tokens: int, max_context: int, positions: int | None = None) -> None:
    """Refuse a request whose prompt plus max_new_tokens does not fit the context, with the numbers and the way out."""
    if prompt_tokens + max_new_tokens <= max_context:
        return
    if positions is not None and max_context >= positions:
        advice = f"shorten the prompt or lower max_new_tokens (the model's max_position_embeddings is {positions})"
    else:
        limit = f" (at most the model's max_position_embeddings, {positions})" if positions is not None else ""
        advice = f"shorten the prompt, lower max_new_tokens or raise max_context (--max-context){limit}"
    raise PromptError(f"prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} exceeds the maximum context "
                      f"of {max_context} tokens; {advice}")


async def prefill(model: Transformer, kv: KVCache, experts: ExpertProvider, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Run the prompt; returns the logits of its last position [V] and commits its KV."""
    tokens = torch.tensor(list(prompt_ids), dtype=torch.long, device=model.device)
    hidden = await model.forward(tokens, 0, kv, experts)
    kv.crop(len(prompt_ids))
    return model.logits(hidden[-1:])[0]


async def greedy_decode(model: Transformer, experts: ExpertProvider, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_token_ids: Sequence[int] = (), kv: KVCache | None = None) -> list[int]:
    """Greedy decoding one token per eager forward; returns the new token ids. Uses (and resets) `kv` if given."""

    async def step(token: torch.Tensor, position: int, kv: KVCache) -> torch.Tensor:
        return model.logits(await model.forward(token, position, kv, experts))  # [1, V]

    return await _greedy(model, experts, prompt_ids, max_new_tokens, stop_token_ids, kv, step)


async def decode_resident_graphed(model: Transformer, experts: ResidentExperts, prompt_ids: Sequence[int], max_new_tokens: int,
                                  *, kernel: MoEKernel = "auto", use_graph: bool | None = None) -> list[int]:
    """Greedy decoding with all experts resident: eager exact prefill, then one graphed R-row step per token
    (GraphedTarget). Tokens stay on the device between steps; the only host sync is the final read."""
    kv = model.new_kv()
    target = GraphedTarget(model, experts, kv, kernel=kernel, use_graph=use_graph)

    async def step(token: torch.Tensor, position: int, kv: KVCache) -> torch.Tensor:
        return target.logits(token, position)  # [1, V]

    return await _greedy(model, experts, prompt_ids, max_new_tokens, (), kv, step)


async def _greedy(model: Transformer, experts: ExpertProvider, prompt_ids: Sequence[int], max_new_tokens: int,
                  stop_token_ids: Sequence[int], kv: KVCache | None, step: Step) -> list[int]:
    """The one greedy loop: eager exact prefill, then `step(token [1], position, kv) -> logits [1, V]` per new token.
    Tokens stay on the device; with stop tokens each one crosses to the host to be checked."""
    check_prompt(prompt_ids, max_new_tokens, model.spec.vocab_size, model.max_context)
    kv = kv if kv is not None else model.new_kv()
    kv.reset()
    token = (await prefill(model, kv, experts, prompt_ids)).argmax(dim=-1, keepdim=True)  # [1]
    tokens = [token]
    stop = set(stop_token_ids)
    while len(tokens) < max_new_tokens and not (stop and int(token) in stop):  # await point with stop tokens: the id
        token = (await step(token, kv.length, kv)).argmax(dim=-1)  # [1]
        kv.crop(kv.length + 1)
        tokens.append(token)
    return torch.cat(tokens).tolist()  # await point: the new tokens cross to the host


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code (tests, scripts)."""
    return asyncio.run(coro)
