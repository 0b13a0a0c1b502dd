"""StaticStep's R-row forward cut at every MoE layer's routed experts, so an offloaded verify can await routing.

Shape legend as in transformer.py and graphed.py: R the step's fixed row count, A active experts per row.

The step is a chain of segments over static buffers. Segment j (j = 0..M-1, M MoE layers) finishes the
previous MoE layer (residual + routed [+ shared]), runs the dense layers before MoE layer j and that
layer's attention, post-attention norm, router and shared expert. The caller then reads the router ids
on the host and computes every expert some row chose (`expert_output`, one expert at a time, in any
order, each into its place in a staging buffer indexed by expert id); the next segment begins by summing
each row's chosen experts in ascending expert id (`routed_sum`: one Triton kernel on CUDA, inside that
segment's graph). The last segment finishes the last MoE layer, runs the trailing dense layers, the final
norm and the LM head.

Why it is exact: every segment calls StaticStep's own pieces on the same inputs in the same order, and
`expert_output` + `routed_sum` do, per expert, what ResidentMoE does for it ("dense": the eager
`expert_mlp` on all R rows; "triton": the resident Triton kernel on all R rows with that expert alone),
skipping experts no row chose, which leave ResidentMoE's sum untouched. Logits are therefore bit-identical
to StaticStep + ResidentMoE with the same kernel (GraphedTarget), row for row (graphed.py principle 4).

Each segment only reads and writes the static buffers (and the KV cache), so on CUDA it is captured as one
CUDA graph; the routed-expert compute between segments runs one small graph per expert-cache slot (the
expert id a device scalar), since which experts run, and from which slots, changes every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from backends.base import Backend
from specter.log import get_logger
from specter.model.graphed import (
    MoEKernel,
    StaticStep,
    capture_graph,
    load_padded,
    pad_indices,
    resident_moe_triton,
    resolve_kernel,
)
from specter.model.kv import KVCache
from specter.model.transformer import Transformer

log = get_logger(__name__)
Tensor = torch.Tensor

def _no_static_moe(layer: int, h: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    raise AssertionError("a SegmentedStep computes routed experts through expert_output and routed_sum, never in a segment")


class SegmentedStep:
    """An R-row static step bound to one KV cache, run segment by segment (see the module docstring).

    Per chunk of <= R tokens: `load`, then for each MoE layer j: `run_segment(j)`, read `ids` (the one
    host read), `expert_output` for every expert some row chose (the next segment sums them); finally
    `run_segment(len(moe_layers))` and read `logits`. Buffers are valid until the next `load`.
    """

    def __init__(self, model: Transformer, kv: KVCache, *, rows: int | None = None, kernel: MoEKernel = "auto",
                 use_graph: bool | None = None, backend: Backend | None = None) -> None:
        self.static = StaticStep(model, _no_static_moe, rows or model.bucket)
        self.model, self.kv, self.rows = model, kv, self.static.rows
        self.tiles = model.kernels.resident  # ResidentMoE's tiles: the same numerics as the resident static step
        self.kernel = resolve_kernel(kernel, model.device)
        self.use_graph = model.device.type == "cuda" if use_graph is None else use_graph
        self.moe_layers = sorted(model.spec.moe_layers)
        # The device's backend (the builder passes the cache's; a step built by hand gets it from its first
        # verify): `_set_expert_id` writes the low 4 bytes of the int64 _expert_id through its set_int32
        # (little-endian; ids are >= 0 and < 2**31, and the high half stays 0).
        self.backend: Backend | None = backend
        self._segment_layers = self._split_layers()
        self._allocate_buffers()
        self._graphs: list[Any] = []
        self._expert_graphs: dict[int, Any] = {}  # weight buffer address -> its graph
        self._expert_outputs: list[Tensor] = []  # each expert graph's [R, D] output, kept alive with it
        self._expert_pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        self._capture_stream = torch.cuda.Stream(model.device) if self.use_graph else None  # one for every capture

    # ---- static buffers ---------------------------------------------------------------------------
    def _allocate_buffers(self) -> None:
        """Everything a segment reads or writes, allocated once (no allocation while decoding: docs/ARCHITECTURE.md, "Memory")."""
        model, spec, rows = self.model, self.model.spec, self.rows
        device, dtype = model.device, model.dtype
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # [R] input
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # [R] input
        self.blocked = torch.zeros(1, rows, 1, model.max_context, dtype=torch.bool, device=device)  # [1, R, 1, S]
        self.residual = torch.zeros(rows, spec.hidden_size, dtype=dtype, device=device)  # [R, D] after the MoE layer's attention
        self.normed = torch.zeros_like(self.residual)  # [R, D] the routed experts' input
        self.ids = torch.zeros(rows, spec.top_k, dtype=torch.long, device=device)  # [R, A] what the host reads
        self.weights = torch.zeros(rows, spec.top_k, dtype=dtype, device=device)  # [R, A]
        self.shared = torch.zeros_like(self.residual) if spec.shared_intermediate else None  # [R, D]
        self.routed = torch.zeros_like(self.residual)  # [R, D] written by routed_sum
        self._staged = torch.zeros(spec.num_experts, rows, spec.hidden_size, dtype=dtype, device=device)  # [E, R, D] by expert id
        self.logits = torch.zeros(rows, spec.vocab_size, dtype=torch.float32, device=device)  # [R, V] output
        self._pad_index = pad_indices(rows, device)
        self._no_weight = torch.zeros_like(self.weights)
        self._single_expert = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [R, 1] ids for the triton path
        self._expert_id = torch.zeros(1, dtype=torch.long, device=device)  # [1] the expert graphs' input
        self._expert_id32 = self._expert_id.view(torch.int32)  # [2] its two halves, little-endian: `_set_expert_id` writes [0]

    def _split_layers(self) -> list[list[int]]:
        """Layers each segment runs in full (dense) before its MoE layer's pre-MoE part; the last: trailing layers."""
        segments: list[list[int]] = [[] for _ in range(len(self.moe_layers) + 1)]
        moe = set(self.moe_layers)
        index = 0
        for layer in range(self.model.spec.num_layers):
            if layer in moe:
                index += 1
            else:
                segments[index].append(layer)
        return segments

    # ---- inputs -----------------------------------------------------------------------------------
    def load(self, tokens: Tensor, start: int) -> int:
        """n <= R device tokens at positions start..start+n-1 (rows n..R-1 repeat the last one); returns n. No sync."""
        return load_padded(tokens, start, self._pad_index, self.tokens, self.positions, self.kv.capacity)

    # ---- segments ---------------------------------------------------------------------------------
    def run_segment(self, index: int) -> None:
        """Segment `index` (0..M): a graph replay on CUDA (captured on first use), a direct call otherwise."""
        if not self.use_graph:
            self._compute_segment(index)
            return
        if not self._graphs:
            self.capture()
        self._graphs[index].replay()

    def _compute_segment(self, index: int) -> None:
        step, model = self.static, self.model
        if index == 0:
            assert self.kv.capacity == step.key_positions.numel(), f"KV capacity {self.kv.capacity} != model context {step.key_positions.numel()}"
            x = model.w["model.embed_tokens.weight"][self.tokens]  # [R, D]
            self.blocked.copy_(~step.allowed(self.positions)[None, :, None, :])
        else:
            x = self._finish_moe_layer()
        for layer in self._segment_layers[index]:
            x = step.attention(layer, x, self.positions, self.blocked, self.kv)
            x = step.feed_forward(layer, x)  # a dense layer: the family's static MLP, never its MoE
        if index == len(self.moe_layers):
            self.logits.copy_(model.logits(x))
        else:
            self._before_experts(self.moe_layers[index], x)

    def _before_experts(self, layer: int, x: Tensor) -> None:
        """MoE layer `layer` up to its routed experts as the static step runs it: its attention, then the family's MoE
        input (Transformer.static_moe_input: norm, routing, shared expert), kept in the static buffers."""
        x = self.static.attention(layer, x, self.positions, self.blocked, self.kv)
        # the shared expert runs here, in the segment, so it computes while the host awaits the routing
        h, ids, weights, shared = self.model.static_moe_input(layer, x)
        for buffer, value in ((self.residual, x), (self.normed, h), (self.ids, ids), (self.weights, weights)):
            buffer.copy_(value)
        if self.shared is not None and shared is not None:
            self.shared.copy_(shared)

    def _finish_moe_layer(self) -> Tensor:
        """The static step's MoE output (Transformer.static_moe_output); routed sums the experts `expert_output` staged
        (inside the next segment, so on CUDA its graph replay does it: no launch of its own)."""
        routed_sum(self._staged, self.ids, self.routed, triton=self.kernel == "triton")
        return self.model.static_moe_output(self.residual, self.routed, self.shared)

    # ---- routed experts, between segments -----------------------------------------------------------
    def expert_output(self, expert: int, packed: Tensor) -> Tensor:
        """Expert `expert` (packed weights [N] on the device) on all R rows, times each row's routing weight
        (zero where the row did not choose it), staged for the next segment's sum; returns the staged [R, D] view.
        ResidentMoE's per-expert arithmetic, bit for bit.

        With graphs, one small CUDA graph per weight buffer (an expert-cache slot, captured by `prepare_experts` at
        start-up, else on first use) runs it and stages its output itself: the expert id goes in as a device scalar
        (a 4-byte copy from a pinned table), so one launch per verified expert replaces the eager path's dozen.
        """
        staged = self._staged[expert]
        if not self.use_graph:
            return staged.copy_(self._expert_compute(expert, packed))
        graph = self._expert_graphs.get(packed.data_ptr()) or self._capture_expert(packed)
        self._set_expert_id(expert)
        graph.replay()  # computes and stages in one launch (the slot may serve another expert of this layer before the sum)
        return staged

    def stage_output(self, expert: int, output: Tensor) -> None:
        """Stage expert `expert`'s weighted output [R, D] computed elsewhere (the host expert path: each row that chose
        it in place, in the step's dtype) for the next segment's sum, as `expert_output` stages its own: one copy on the
        current stream, non-blocking from pinned host memory."""
        self._staged[expert].copy_(output, non_blocking=True)

    def _set_expert_id(self, expert: int) -> None:
        """_expert_id[0] = expert in the current stream's order: the backend's set_int32 (on cuda a 4-byte copy from
        a pinned table, a few microseconds of host time less than a fill kernel's launch); torch's fill otherwise. Once per
        verified expert, so the int32 view is made once (`_expert_id32`): a view per call cost ~1 us of host time."""
        if self.backend is None or not self.use_graph:
            self._expert_id.fill_(expert)
            return
        self.backend.set_int32(self._expert_id32, 0, expert, torch.cuda.current_stream())

    def reset_experts(self) -> None:
        """Drop every expert graph (the cache's slots were reallocated); their outputs go with them."""
        self._expert_graphs, self._expert_outputs = {}, []
        self._expert_pool = torch.cuda.graph_pool_handle() if self.use_graph else None

    def prepare_experts(self, buffers: Sequence[Tensor]) -> None:
        """Capture the expert graph of each weight buffer now (start-up). Nothing to do without graphs."""
        if self.use_graph:
            for packed in buffers:
                if packed.data_ptr() not in self._expert_graphs:
                    self._capture_expert(packed)

    def _capture_expert(self, packed: Tensor) -> Any:
        """Warm up (Triton compilation) and capture `_stage_expert` on `packed` with the device expert id.

        The graphs share one pool: each keeps its output alive (the memory plan charges each slot for it), and
        its temporaries are dead once it returns.
        """
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the compute alone: staging now would overwrite the staged output of the
            self._expert_compute(self._expert_id, packed)  # expert the id still names (a capture on first use mid-layer)
        graph, out = capture_graph(lambda: self._stage_expert(packed), self._expert_pool, side)
        self._expert_graphs[packed.data_ptr()] = graph
        self._expert_outputs.append(out)
        return graph

    def _stage_expert(self, packed: Tensor) -> Tensor:
        """The expert of the device id on all rows, written into its place in the staging buffer (device index)."""
        out = self._expert_compute(self._expert_id, packed)
        self._staged.index_copy_(0, self._expert_id, out[None])
        return out

    def _expert_compute(self, expert: int | Tensor, packed: Tensor) -> Tensor:
        """The per-expert arithmetic; `expert` a Python int (eager) or the [1] device id (graphs): same values."""
        weight = torch.where(self.ids == expert, self.weights, self._no_weight).sum(dim=-1, keepdim=True)  # [R, 1], exact
        if self.kernel == "triton":
            spec = self.model.spec
            return resident_moe_triton(self.normed, self._single_expert, weight, packed[None], spec.hidden_size,
                                       spec.expert_intermediate, self.tiles)
        return self.model.expert_mlp(self.normed, packed) * weight

    # ---- graph capture ----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Capture the segment graphs now (start-up). Nothing to do without graphs.

        As GraphedStep.prepare: the warm-up writes KV only at the first uncommitted position, so a prefilled
        prompt survives; with a full KV the capture waits for first use.
        """
        if self.use_graph and not self._graphs and self.kv.length < self.kv.capacity:
            self.load(torch.zeros(1, dtype=torch.long, device=self.tokens.device), self.kv.length)
            self.capture()

    def capture(self) -> None:
        """Warm up every segment on a side stream, then capture each as a graph sharing one memory pool.

        The warm-up writes KV at the loaded positions with whatever the routed buffer holds; the next real
        run rewrites those positions (prepare loads the first uncommitted position). The graphs share a
        pool because they always replay in capture order and never overlap.
        """
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for index in range(len(self.moe_layers) + 1):
                    self._compute_segment(index)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs = [capture_graph(lambda index=index: self._compute_segment(index), pool, side)[0]
                  for index in range(len(self.moe_layers) + 1)]
        self._graphs = graphs
        log.debug("graph.segments_captured", rows=self.rows, segments=len(graphs))


def routed_sum(staged: Tensor, ids: Tensor, out: Tensor, *, triton: bool = False) -> None:
    """out[r] = 0 + staged[e_1, r] + ... + staged[e_A, r] over row r's experts ids[r] in ascending id, each
    add in out's dtype. staged: [E, R, D]; ids: [R, A] (distinct per row); out: [R, D], written in place.

    triton: one launch (CUDA, or CPU tensors under TRITON_INTERPRET=1); else 1 + 2A torch ops. Both round
    like torch's own `a + b` in the dtype, so they agree bit for bit (tests/test_segmented.py).
    """
    rows, active = ids.shape
    if triton:
        from specter.model.graphed import launch_routed_sum

        launch_routed_sum(staged, ids, out)
        return
    order = torch.sort(ids, dim=-1).values  # [R, A]
    row = torch.arange(rows, device=ids.device)
    total = torch.zeros_like(out)
    for slot in range(active):
        total = total + staged[order[:, slot], row]
    out.copy_(total)

