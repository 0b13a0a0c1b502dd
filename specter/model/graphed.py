"""A sync-free decode step over a fixed number of rows, and its CUDA-graph replay (target and draft).

Shape legend as in transformer.py, plus R the step's fixed row count and P = R * A (row, expert) pairs.

Design principles of the static step:
1. Its inputs are device tensors only (tokens [R], positions [R]); no Python value depends on data, so
   the same kernels run in the same order every call and the step can be captured as a CUDA graph.
2. KV is written with `index_copy_` at the rows' positions; attention reads the WHOLE static cache
   [0, S) and masks keys after each row's position (and outside the sliding window).
3. Rows beyond the real ones repeat the last real row (same token, same position): their KV writes are
   bit-identical duplicates of a real write, so padding never touches any other position.
4. Every op computes each row on its own (matrix products, row-wise norms, per-row softmax, routed
   experts summed per row in ascending expert id), so for a fixed R a row's result depends only on its
   token, its position and the cache below it, never on the other rows. A k+1-row verify and a one-row
   decode that both run this R-row step are therefore bit-identical row for row.
5. Routed experts never read the routing table on the host: all-resident experts run either densely (every
   expert on all R rows, masked: the eager exact path's own arithmetic) or in a Triton kernel over the
   packed bf16 experts that reads each active expert once (CUDA).
6. DeepSeek-V2's multi-head latent attention (on by default, KernelTuning.static_mla) follows 2-4 over its
   LatentKVCache: the kv latent and rope key are written with `index_copy_`, and every row's absorbed-form
   query attends over the whole cache [0, S) under the same mask.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch

from specter.config import KernelTuning, MoETiles
from specter.errors import ConfigError
from specter.log import get_logger
from specter.model.kv import KVCache
from specter.model.resident import ResidentExperts
from specter.model.transformer import StaticMoE, Transformer, declared
from specter.quant import moe_triton
from specter.quant.moe_triton import triton_available
from specter.sampling import SamplingLike, sample

log = get_logger(__name__)
T = TypeVar("T")
Tensor = torch.Tensor
MoEKernel = Literal["auto", "dense", "triton"]

def capture_graph(fn: Callable[[], T], pool: Any, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture `fn` (already warmed up) as a CUDA graph on `stream`, in `pool`; returns (graph, fn's result).

    Unlike `torch.cuda.graph`, this neither synchronises the device nor collects garbage nor empties the
    allocator's cache before the capture: start-up captures one graph per segment and per expert slot,
    and in a large process each `gc.collect()` costs a noticeable fraction of a second. Thread-local
    capture mode: other threads (waiters, copies) may use CUDA meanwhile.

    The garbage collector is paused for the capture instead: a collection inside it may destroy an
    unreachable CUDA graph (of an earlier engine, say), and destroying a graph is not permitted while this
    thread captures: the capture is invalidated (the CUDA property tests hit it).
    """
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                result = fn()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    current.wait_stream(stream)
    return graph, result


def static_step_supported(model: Transformer | type[Transformer], static_mla: bool | None = None) -> bool:
    """Whether the model (or a Transformer class) declares a family the static step runs (FamilySpec.static).

    Standard attention: always. DeepSeek-V2's multi-head latent attention (attention "mla"): yes, unless
    `static_mla` (KernelTuning.static_mla; None: the model's own setting, on for a class) is off: then DeepSeek runs
    the eager forward everywhere (target, verify and draft).
    """
    family = declared(model)
    if family is None or not family.static:
        return False
    if family.attention == "mla":
        if static_mla is None:
            static_mla = True if isinstance(model, type) else model.kernels.static_mla
        return static_mla
    return True


def check_static_support(model: Transformer) -> None:
    if static_step_supported(model):
        return
    family = model.spec.family
    if _is_latent_attention(model):
        raise ConfigError(f"the static (CUDA-graph) decode step for model family '{family}' (multi-head latent attention) is "
                          f"switched off (EngineConfig.tuning.kernels.static_mla = False); turn it on to use the static "
                          f"step, or run the eager forward")
    raise ConfigError(f"the static (CUDA-graph) decode step supports families that declare standard attention or DeepSeek-V2's "
                      f"latent attention (a `family = FamilySpec(...)` in the Transformer class); model family '{family}' "
                      f"({type(model).__name__}) declares none; run it with the eager forward")


def _is_latent_attention(model: Transformer | type[Transformer]) -> bool:
    family = declared(model)
    return family is not None and family.attention == "mla"


# ---- routed experts without a host sync -------------------------------------------------------------
class ResidentMoE:
    """All-resident experts (a ResidentExperts) as a StaticMoE.

    kernel "dense" runs every expert on all R rows with the eager path's own `expert_mlp` and adds the
    rows that chose it, in ascending expert id: bit-identical to ResidentExperts.run when R equals the
    model's row bucket, and E times the expert work (tests, CPU, fallback). "triton" reads each active
    expert once (CUDA, or the interpreter), with the model's `kernels.resident` tiles. "auto" picks triton on CUDA
    when it imports.
    """

    def __init__(self, model: Transformer, experts: ResidentExperts, kernel: MoEKernel = "auto") -> None:
        self.model, self.experts, self.tiles = model, experts, model.kernels.resident
        self.kernel = resolve_kernel(kernel, model.device)

    def __call__(self, layer: int, h: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        packed = self.experts.packed[layer]  # [E, expert_numel]
        if self.kernel == "triton":
            spec = self.model.spec
            return resident_moe_triton(h, ids, weights, packed, spec.hidden_size, spec.expert_intermediate, self.tiles)
        return self._dense(h, ids, weights, packed)

    def _dense(self, h: Tensor, ids: Tensor, weights: Tensor, packed: Tensor) -> Tensor:
        out = torch.zeros_like(h)  # [R, D]
        for expert in range(packed.shape[0]):
            chosen = ids == expert  # [R, A]; top-A ids are distinct, so at most one slot per row
            weight = torch.where(chosen, weights, torch.zeros_like(weights)).sum(dim=-1, keepdim=True)  # [R, 1], exact
            contribution = self.model.expert_mlp(h, packed[expert]) * weight
            out = torch.where(chosen.any(dim=-1, keepdim=True), out + contribution, out)  # rows that did not choose it: untouched
        return out


def resolve_kernel(kernel: MoEKernel, device: torch.device) -> MoEKernel:
    if kernel not in ("auto", "dense", "triton"):
        raise ConfigError(f"resident MoE kernel {kernel!r} is unknown; use 'auto', 'dense' or 'triton'")
    if kernel == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "dense"
    if kernel == "triton" and not triton_available():
        raise ConfigError("resident MoE kernel 'triton' needs the triton package; install it or use kernel='dense'")
    return kernel


# ---- the static step ----------------------------------------------------------------------------------
class StaticStep:
    """One forward over exactly R rows whose inputs are device tensors only (see the module principles)."""

    def __init__(self, model: Transformer, moe: StaticMoE, rows: int) -> None:
        check_static_support(model)
        assert rows >= 1, f"a static step needs at least one row, got {rows}"
        self.model, self.moe, self.rows = model, moe, rows
        self.key_positions = torch.arange(model.max_context, device=model.device)  # [S]
        spec = model.spec  # decode_attention's counters, one set per layer (kernels.merge_in_launch)
        self.attention_counters = torch.zeros(spec.num_layers, rows * spec.num_kv_heads, dtype=torch.int32,
                                              device=model.device)  # fmt: skip

    def logits(self, tokens: Tensor, positions: Tensor, kv: KVCache) -> Tensor:
        """Float32 logits [R, V] of tokens [R] at positions [R] (int64), writing their KV."""
        return self.model.logits(self.hidden(tokens, positions, kv))

    def hidden(self, tokens: Tensor, positions: Tensor, kv: KVCache) -> Tensor:
        """Final hidden states [R, D] (before the final norm), writing each row's KV at its position."""
        assert tokens.shape == (self.rows,) and positions.shape == (self.rows,), (
            f"a {self.rows}-row step takes tokens and positions of shape [{self.rows}], got {tuple(tokens.shape)}, {tuple(positions.shape)}")
        assert kv.capacity == self.key_positions.numel(), f"KV capacity {kv.capacity} != model context {self.key_positions.numel()}"
        hidden_states = self.model.w["model.embed_tokens.weight"][tokens]  # [R, D]
        blocked = ~self.allowed(positions)[None, :, None, :]  # [1, R, 1, S]
        for layer in range(self.model.spec.num_layers):
            hidden_states = self.attention(layer, hidden_states, positions, blocked, kv)
            hidden_states = self.feed_forward(layer, hidden_states)
        return hidden_states

    def allowed(self, positions: Tensor) -> Tensor:
        """[R, S]: key position <= the row's position (and inside the sliding window, if any)."""
        keys, queries = self.key_positions[None, :], positions[:, None]
        allowed = keys <= queries
        window = self.model.spec.sliding_window
        if window is not None and window > 0:
            allowed &= keys > queries - window
        return allowed

    def attention(self, layer: int, x: Tensor, positions: Tensor, blocked: Tensor, kv: KVCache) -> Tensor:
        """The family's own static attention (Transformer.static_attention: standard or DeepSeek-V2's MLA)."""
        return self.model.static_attention(layer, x, positions, blocked, kv, self.attention_counters[layer])

    def feed_forward(self, layer: int, x: Tensor) -> Tensor:
        """The family's static feed-forward (Transformer.static_feed_forward) with this step's routed experts."""
        return self.model.static_feed_forward(layer, x, self.moe)


# ---- graph capture and replay -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceSampling:
    """SamplingLike whose seed is a 0-d device tensor, so one captured graph serves every seed."""

    temperature: float
    top_k: int | None
    top_p: float | None
    seed: Tensor


SamplingKey = tuple[float, int | None, float | None]
GREEDY: SamplingKey = (0.0, None, None)


def sampling_key(params: SamplingLike | None) -> SamplingKey:
    """What a graph bakes in: temperature, top-k, top-p (greedy ignores the other two)."""
    if params is None or params.temperature == 0.0:
        return GREEDY
    return (float(params.temperature), params.top_k or None, params.top_p)


def pad_indices(rows: int, device: torch.device) -> list[Tensor]:
    """For n = 1..R real rows: the row each of the R static rows reads (padding repeats the last real row)."""
    return [torch.arange(rows, device=device).clamp(max=n - 1) for n in range(1, rows + 1)]


def load_padded(tokens: Tensor, start: int, pad_index: list[Tensor], tokens_out: Tensor, positions_out: Tensor, capacity: int) -> int:
    """Fill a static step's token and position buffers from n <= R device tokens; returns n. No sync.

    Padding rows repeat the last real row (same token, same position), so they only rewrite a real KV entry.
    """
    count, rows = tokens.shape[0], tokens_out.shape[0]
    assert 1 <= count <= rows, f"{count} tokens do not fit a {rows}-row step"
    assert 0 <= start and start + count <= capacity, f"positions {start}..{start + count - 1} exceed the KV capacity {capacity}"
    index = pad_index[count - 1]
    torch.index_select(tokens.to(torch.long), 0, index, out=tokens_out)
    torch.add(index, start, out=positions_out)
    return count


class GraphedStep:
    """A StaticStep bound to one KV cache, with static input buffers; a CUDA graph per sampling setting.

    `load` (or `advance`) fills the buffers with device ops only; `run` replays the graph (captured on
    first use: warm-up on a side stream, then capture into one memory pool) and returns static outputs,
    valid until the next run. On the CPU, or with use_graph=False, `run` calls the step directly.
    `preserve` names tensors the step accumulates into (route counters): warm-up restores them.
    """

    def __init__(self, step: StaticStep, kv: KVCache, *, use_graph: bool | None = None, preserve: Sequence[Tensor] = ()) -> None:
        device = step.model.device
        self.step, self.kv, self.rows = step, kv, step.rows
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.preserve = tuple(preserve)
        self.tokens = torch.zeros(self.rows, dtype=torch.long, device=device)  # [R] static input
        self.positions = torch.zeros(self.rows, dtype=torch.long, device=device)  # [R] static input
        self.seed = torch.zeros((), dtype=torch.long, device=device)  # static input for sampling
        self.next_position = 0  # host mirror of the last real row's position + 1 (bounds checks only)
        self._pad_index = pad_indices(self.rows, device)
        self._outputs: dict[SamplingKey, tuple[Tensor, Tensor]] = {}
        self._graphs: dict[SamplingKey, Any] = {}
        self._pool: Any = None

    def load(self, tokens: Tensor, start: int) -> None:
        """n <= R device tokens at positions start..start+n-1; rows n..R-1 repeat the last one. No sync."""
        self.next_position = start + load_padded(tokens, start, self._pad_index, self.tokens, self.positions, self.kv.capacity)

    def advance(self, token: Tensor) -> None:
        """One-row decoding: the next step reads `token` [1] (device) at the next position. No sync."""
        assert self.rows == 1, "advance feeds a one-row step; load() a block for R > 1 rows"
        assert self.next_position < self.kv.capacity, f"position {self.next_position} exceeds the KV capacity {self.kv.capacity}"
        self.tokens.copy_(token)
        self.positions.add_(1)
        self.next_position += 1

    def run(self, params: SamplingLike | None = None) -> tuple[Tensor, Tensor]:
        """Logits [R, V] float32 and the tokens sampled from them for positions + 1 [R] (static buffers)."""
        key = sampling_key(params)
        if key != GREEDY:
            self.seed.fill_(params.seed)  # type: ignore[union-attr]
        if not self.use_graph:
            return self._compute(key)
        # One graph, captured at start-up, for every request: sampled requests replay it for the logits and
        # sample eagerly from them (the same ops as in a graph), so a new temperature or top-p never captures
        # (allocates) in the middle of decoding.
        if GREEDY not in self._graphs:
            self.capture(GREEDY)
        self._graphs[GREEDY].replay()
        logits, greedy_tokens = self._outputs[GREEDY]
        if key == GREEDY:
            return logits, greedy_tokens
        return logits, sample(logits, self.positions + 1, DeviceSampling(*key, seed=self.seed))

    def prepare(self, params: SamplingLike | None = None) -> None:
        """Capture the graph for `params` now (start-up). Capturing early keeps allocation out of decoding
        (docs/ARCHITECTURE.md, "Memory"). Nothing to do without graphs.

        The warm-up writes KV at the first uncommitted position (scratch by the KV's contract), so this is
        safe after a prefill too; with a full KV the capture waits for first use instead.
        """
        if self.use_graph and self.kv.length < self.kv.capacity:
            self.load(torch.zeros(1, dtype=torch.long, device=self.tokens.device), self.kv.length)
            self.capture(sampling_key(params))

    def capture(self, key: SamplingKey = GREEDY) -> None:
        """Warm up on a side stream (allocations, Triton compilation), then capture the step as a graph.

        The warm-up really runs the step on the loaded buffers: the KV writes it makes are the ones the
        next replay makes anyway, and the preserved accumulators are restored afterwards.
        """
        saved = [t.clone() for t in self.preserve]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._compute(key)
        torch.cuda.current_stream().wait_stream(side)
        for tensor, copy in zip(self.preserve, saved):
            tensor.copy_(copy)
        self._pool = self._pool if self._pool is not None else torch.cuda.graph_pool_handle()
        self._graphs[key], self._outputs[key] = capture_graph(lambda: self._compute(key), self._pool, side)
        log.debug("graph.captured", rows=self.rows, sampling=key)

    def _compute(self, key: SamplingKey) -> tuple[Tensor, Tensor]:
        logits = self.step.logits(self.tokens, self.positions, self.kv)  # [R, V]
        params = DeviceSampling(*key, seed=self.seed)
        return logits, sample(logits, self.positions + 1, params)


class GraphedTarget:
    """The all-resident target's decode and verify forward as replays of one R-row step (R = row bucket).

    Plain decoding (1 row) and a verify of k+1 rows both run the same R-row graph, so their rows are
    bit-identical (module principle 4): the engine's exactness contract holds between them.
    """

    def __init__(self, model: Transformer, experts: ResidentExperts, kv: KVCache, *, rows: int | None = None,
                 kernel: MoEKernel = "auto", use_graph: bool | None = None) -> None:
        rows = rows or model.bucket
        self.step = GraphedStep(StaticStep(model, ResidentMoE(model, experts, kernel), rows), kv, use_graph=use_graph)

    @property
    def rows(self) -> int:
        return self.step.rows

    def prepare(self) -> None:
        """Capture the graph now (start-up); see GraphedStep.prepare."""
        self.step.prepare()

    def logits(self, tokens: Tensor, start: int) -> Tensor:
        """Float32 logits [n, V] of n device tokens at positions start.., in R-row chunks, writing their KV."""
        assert tokens.shape[0] >= 1, "nothing to run: pass at least one token"
        parts = []
        for first in range(0, tokens.shape[0], self.rows):
            chunk = tokens[first : first + self.rows]
            self.step.load(chunk, start + first)
            logits, _ = self.step.run()
            parts.append(logits[: chunk.shape[0]].clone())  # the static output is overwritten by the next replay
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# ---- Triton kernel over packed bf16 experts ------------------------------------------------------------
def resident_moe_triton(x: Tensor, expert_ids: Tensor, weights: Tensor, packed: Tensor, hidden: int, intermediate: int,
                        tiles: MoETiles | None = None) -> Tensor:
    """[T, D] MoE output over packed experts [E, 2I*D + D*I] in x's dtype; four launches, no host sync. `tiles`:
    KernelTuning.resident (its default when None).

    Reuses the draft kernel's route (moe_triton.py): pairs sorted by expert id, each expert's weight tile
    read once per 16-row chunk. Results are rounded to x's dtype where the eager path rounds (each GEMM
    output, silu, the products, each per-token add in ascending expert id), so only the GEMMs' float32
    accumulation order differs from ResidentExperts.run.
    """
    assert packed.dtype == x.dtype and packed.shape[1] == 3 * hidden * intermediate, "packed experts must match x's dtype and shape"
    assert x.is_cuda or moe_triton.interpreting(), "the Triton resident MoE needs CUDA tensors (or TRITON_INTERPRET=1 for CPU ones)"
    pairs = expert_ids.numel()
    assert pairs <= moe_triton.MAX_PAIRS, f"{pairs} (token, expert) pairs exceed the route kernel's {moe_triton.MAX_PAIRS}"
    tiles = tiles or KernelTuning().resident
    kernels = _resident_kernels()
    x = x.contiguous()
    routes = moe_triton._route(moe_triton._kernels(), expert_ids, weights)
    hidden_act = torch.empty(pairs, intermediate, device=x.device, dtype=x.dtype)  # [P, I]
    _launch_resident_gemm(kernels.gemm, x, packed, routes, hidden_act, intermediate, hidden, gate_up=True, tiles=tiles)
    pair_out = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)  # [P, D], weighted
    _launch_resident_gemm(kernels.gemm, hidden_act, packed, routes, pair_out, intermediate, hidden, gate_up=False, tiles=tiles)
    out = torch.empty(x.shape[0], hidden, device=x.device, dtype=x.dtype)
    block_d = 256
    kernels.combine[(x.shape[0], moe_triton.triton_cdiv(hidden, block_d))](
        pair_out, routes.token_slots, out, hidden, ACTIVE=routes.active, BLOCK_D=block_d)
    return out


def _launch_resident_gemm(gemm: Any, a: Tensor, packed: Tensor, routes: Any, out: Tensor, intermediate: int, hidden: int,
                          gate_up: bool, tiles: MoETiles) -> None:
    """Gate/up: a = x [T, D] against w13 [2I, D] at offset 0; down: a = h [P, I] against w2 [D, I] after w13."""
    n_out, k_dim = (intermediate, hidden) if gate_up else (hidden, intermediate)
    block_n = tiles.block_n_gate_up if gate_up else tiles.block_n_down
    grid = (routes.pairs, moe_triton.triton_cdiv(n_out, block_n))
    gemm[grid](
        a, a.stride(0), packed, packed.stride(0), 0 if gate_up else 2 * intermediate * hidden,
        out, out.stride(0), routes.token, routes.expert, routes.weight, routes.run_offset,
        routes.pairs, n_out, k_dim, intermediate,
        GATE_UP=gate_up, BLOCK_M=moe_triton.BLOCK_M, BLOCK_N=block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


tl: Any = None  # triton.language, bound by _resident_kernels(); the kernel bodies resolve it as a global


@dataclasses.dataclass(frozen=True)
class _ResidentKernels:
    gemm: Any
    combine: Any
    routed_sum: Any


@functools.cache
def _resident_kernels() -> _ResidentKernels:
    """Jitted on first use, so importing this module does not need triton."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return _ResidentKernels(triton.jit(resident_gemm_kernel), triton.jit(resident_combine_kernel), triton.jit(routed_sum_kernel))


def resident_gemm_kernel(a_ptr, stride_a, w_ptr, stride_we, w_offset, out_ptr, stride_out,
                         token_ptr, expert_ptr, weight_ptr, run_offset_ptr, num_pairs, n_out, k_dim, intermediate,
                         GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Grouped GEMM of one expert chunk against BLOCK_N output columns, plain-dtype weights (a deliberate long kernel).

    Weight rows are contiguous with k_dim elements each. GATE_UP: out = h [P, I] = silu(gate) * up, rows
    of a by token; else out = [P, D] scaled by the routing weight, rows of a by slot. Accumulation is
    float32; every value the eager path holds in the activation dtype is rounded to out's dtype here too.
    """
    slot = tl.program_id(0)
    if tl.load(run_offset_ptr + slot) % BLOCK_M != 0:
        return  # the program leading this chunk of the expert's run computes this pair
    expert = tl.load(expert_ptr + slot).to(tl.int64)
    rows = slot + tl.arange(0, BLOCK_M)
    row_ok = rows < num_pairs
    row_ok = row_ok & (tl.load(expert_ptr + rows, mask=row_ok, other=-1) == expert)
    if GATE_UP:
        a_rows = tl.load(token_ptr + rows, mask=row_ok, other=0)
    else:
        a_rows = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    if GATE_UP:  # interleave gate row c and up row I + c so one tile (and one dot) serves both
        half = tl.arange(0, 2)
        w_rows = tl.reshape(cols[:, None] + intermediate * half[None, :], (2 * BLOCK_N,))
        w_ok = tl.reshape(col_ok[:, None] & (half[None, :] < 2), (2 * BLOCK_N,))
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        w_rows = cols
        w_ok = col_ok
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we + w_offset + w_rows.to(tl.int64) * k_dim  # [W]
    a_base = a_ptr + a_rows[:, None].to(tl.int64) * stride_a  # [M, 1]
    k_step = tl.arange(0, BLOCK_K)
    for k0 in range(0, k_dim, BLOCK_K):
        k_idx = k0 + k_step
        k_ok = k_idx < k_dim
        a = tl.load(a_base + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base[:, None] + k_idx[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    act_dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        gate = gate.to(act_dtype).to(tl.float32)  # eager: F.linear returns the activation dtype
        up = up.to(act_dtype).to(tl.float32)
        result = (gate * tl.sigmoid(gate)).to(act_dtype).to(tl.float32) * up  # eager: silu, then the product
    else:
        route_weight = tl.load(weight_ptr + rows, mask=row_ok, other=0.0)
        result = acc.to(act_dtype).to(tl.float32) * route_weight[:, None]  # eager: F.linear, then * weight
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, result.to(act_dtype), mask=row_ok[:, None] & col_ok[None, :])


def resident_combine_kernel(pair_out_ptr, token_slots_ptr, out_ptr, hidden, ACTIVE: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = token t's weighted pair rows added in ascending expert id, rounding after each add (as index_add_ does)."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < hidden
    slot = tl.load(token_slots_ptr + token * ACTIVE).to(tl.int64)
    total = tl.load(pair_out_ptr + slot * hidden + cols, mask=col_ok, other=0.0)
    for j in tl.static_range(1, ACTIVE):
        slot = tl.load(token_slots_ptr + token * ACTIVE + j).to(tl.int64)
        part = tl.load(pair_out_ptr + slot * hidden + cols, mask=col_ok, other=0.0)
        total = (total.to(tl.float32) + part.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * hidden + cols, total, mask=col_ok)


def launch_routed_sum(staged: Tensor, ids: Tensor, out: Tensor) -> None:
    """segmented.routed_sum in one launch: a program per (row, 256 columns)."""
    assert staged.is_cuda or moe_triton.interpreting(), "the Triton routed sum needs CUDA tensors (or TRITON_INTERPRET=1)"
    assert staged.is_contiguous() and ids.is_contiguous() and out.is_contiguous(), "routed_sum needs contiguous buffers"
    rows, active = ids.shape
    hidden = out.shape[1]
    block_d = 256
    _resident_kernels().routed_sum[(rows, moe_triton.triton_cdiv(hidden, block_d))](
        staged, ids, out, rows, hidden, ACTIVE=active, ACTIVE_POW2=1 << max(0, (active - 1).bit_length()), BLOCK_D=block_d,
        BF16=out.dtype == torch.bfloat16)


def routed_sum_kernel(staged_ptr, ids_ptr, out_ptr, rows, hidden, ACTIVE: tl.constexpr, ACTIVE_POW2: tl.constexpr,
                      BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    """out[row] = 0 + the row's staged expert outputs in ascending expert id, each add rounded to out's dtype.

    The running total is kept in float32 holding a value of out's dtype. bfloat16 rounds to nearest even by
    hand (as torch does): Triton's interpreter truncates float32 -> bfloat16, which would hide a mismatch.
    """
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < hidden
    slots = tl.arange(0, ACTIVE_POW2)
    never = 1 << 62
    ids = tl.load(ids_ptr + row * ACTIVE + slots, mask=slots < ACTIVE, other=never).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    previous = tl.min(ids, axis=0) - 1
    for _ in tl.static_range(ACTIVE):
        expert = tl.min(tl.where(ids > previous, ids, never), axis=0)  # the next id up
        found = expert != never  # not so only where a row repeats an id (the zeroed buffers a capture warms up on)
        safe = tl.where(found, expert, 0)
        value = tl.load(staged_ptr + (safe * rows + row) * hidden + cols, mask=col_ok, other=0.0)  # used only if found
        exact = total + value.to(tl.float32)
        if BF16:
            bits = exact.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            rounded = tl.where(exact != exact, exact, bits.to(tl.float32, bitcast=True))
        else:
            rounded = exact.to(dtype).to(tl.float32)
        total = tl.where(found, rounded, total)
        previous = tl.where(found, expert, previous)
    tl.store(out_ptr + row * hidden + cols, total.to(dtype), mask=col_ok)
