"""The vision tower replayed as CUDA graphs at bucketed shapes: the replicated HF tower (Qwen2-VL, Qwen2.5-VL), and
Megatron-Bridge's Qwen3-VL tower (Qwen3-VL, Qwen3.5-VL; `MegatronTowerGraphs`, at the end); the tower's part of patch
group "speed-cuda-graphs" (qvl.kernels.speed_cuda_graphs), on with the language model's layers' graphs and where
those cannot be captured (MoE and Gated DeltaNet models, full recompute: `eager_tower` says where it is not).

Why: the step census (benchmarks/RESULTS.md) counts 12,280 of a step's 15,994 kernel-launching ops in the vision
tower (forward, recompute and backward of every block for 8 packs): graphing the language model alone cannot bring a
step under its 2,000 launches. Replayed as one forward and one backward graph, a tower call is two launches plus the
copies that fill its inputs and take its output's gradient (`launches_per_call`: 16 with windows, 11 without).

How: a graph replays fixed shapes, and every micro-batch has its own patch count. `TowerGraphs` rounds a call up to
a bucket (qvl.kernels.tower_buckets: the smallest of the sizes planned from the prepared dataset's calls that holds
it, else eight patch counts per doubling, at most 1/8 more rows; the blocks and windows of `cu_seqlens` /
`cu_window_seqlens` are slots rounded up, and a size whose slots are short grows them: one graph per size) and pads
the call into that bucket's static buffers:
- pixel rows after the real ones are zeros (finite through every layer, and rows whose outputs are dropped get zero
  gradient: they add nothing to any weight's);
- `cu_seqlens` gets the pad rows as blocks of at most the bucket's longest block (its attention's `max_seqlen`: the
  call's longest image or frame rounded up, not the bucket's rows), then zero-length blocks;
- Qwen2.5-VL's windows: the pad rows in whole windows of the tower's window size (so the longest window stays the
  tower's), `window_index` keeps the pad units in place, then zero-length windows;
- the tower's output rows after the real ones are dropped, and their gradient is zero.
No value is read back to the host: the real inputs are copied into the buffers on the device, and the pad entries are
written from the call's row count (a host int) and constants on the device.

The first call of a bucket runs the padded tower eagerly (the micro-batch's real pass; it also warms up cuBLAS, the
varlen kernel and the compiled regions at the bucket's shapes); the second captures the forward and the backward
(one memory pool for all buckets) and replays; later calls replay. In the backward graph each trained parameter's
gradient goes into its `main_grad` (Megatron-Core's DDP buffer), as Megatron-Core's own per-layer graphs do
(megatron/core/transformer/cuda_graphs.py): the tower's `MainGradLinear`s already add theirs inside their GEMM (their
`grad_added_to_main_grad` set while capturing); the rest (norms, patch embedding, biases without one) are added after
them. Autograd gets no gradient for the parameters, so DDP's per-parameter hook does not run for them: with
`overlap_grad_reduce` (off in qvl's recipes), which needs those hooks, the tower runs eagerly
(qvl.kernels.speed_cuda_graphs.tower_graphs_allowed). The graphs assume Megatron's schedule without
pipeline parallelism: a micro-batch's backward before the next micro-batch's forward. A second call while a bucket's
backward is pending (images and videos of one micro-batch in one bucket) runs eagerly, as does a capture or replay
while another bucket's replayed backward is pending (`replay_pending`: the pool's blocks are shared), any call beyond
`MAX_GRAPHS` sizes, any call without autograd, any tower with a trained parameter that has no `main_grad`, and
every call of a bucket whose capture raised (logged with the error; `stats()` names it).

On the CPU the same buffers, padding and gradient routing run through `EagerReplay` (the tests), which re-runs the
captured passes instead of replaying kernels; `CudaGraphReplay` is the CUDA graph pair.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any

import torch

from qvl.foundation import graph_replay
from qvl.kernels.speed_hf_vision import tower_kwargs
from qvl.kernels.tower_buckets import MAX_GRAPHS, TowerBucket, bucket_size, planned_sizes, tower_bucket, tower_unit
from qvl.kernels.tower_inputs import MegatronTowerInputs, TowerInputs

logger = logging.getLogger(__name__)

# Kernels a graphed call launches besides its two replays: the copies and pad writes that fill its buffers (with
# Qwen2.5-VL's windows, and without), then the gradient's copy and its pad rows zeroed (tests count them)
FILL_LAUNCHES = {True: 12, False: 7}
MEGATRON_FILL_LAUNCHES = 13  # Qwen3-VL's: pixels, position ids, blocks, the corners' indices and weights
GRADIENT_LAUNCHES = 2


class CudaGraphReplay:
    """A forward and a backward pass captured as two CUDA graphs in `pool`, replayed on the current stream."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = torch.cuda.CUDAGraph()
        self.output: tuple[torch.Tensor, ...] | None = None

    def capture(self, forward: Any, backward: Any) -> tuple[torch.Tensor, ...]:
        """Record `forward()` (its output tensors are static) and `backward(outputs)`; nothing runs yet."""
        # thread_local: the loader's pin-memory thread may call CUDA while this thread captures
        with torch.cuda.graph(self.forward_graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = forward()
        if outputs[0].requires_grad:
            with torch.cuda.graph(self.backward_graph, pool=self.pool, capture_error_mode="thread_local"):
                backward(outputs)
        self.output = tuple(output.detach() for output in outputs)
        return self.output

    def forward(self) -> None:
        self.forward_graph.replay()

    def backward(self) -> None:
        self.backward_graph.replay()


class EagerReplay:
    """`CudaGraphReplay`'s contract with the passes re-run instead of replayed (CPU tests): the output is written
    into the tensor `capture` returned, and the backward runs on the last forward's autograd graph."""

    def __init__(self) -> None:
        self.forward_pass = self.backward_pass = None
        self.output: tuple[torch.Tensor, ...] | None = None
        self.live: tuple[torch.Tensor, ...] | None = None

    def capture(self, forward: Any, backward: Any) -> torch.Tensor:
        self.forward_pass, self.backward_pass = forward, backward
        with torch.no_grad():  # a capture records, it does not compute: these values are never read
            self.output = tuple(output.detach() for output in forward())
        return self.output

    def forward(self) -> None:
        with torch.enable_grad():  # called from an autograd Function's forward, where autograd is off
            self.live = self.forward_pass()
        for output, live in zip(self.output, self.live, strict=True):
            output.copy_(live.detach())

    def backward(self) -> None:
        live, self.live = self.live, None
        self.backward_pass(live)


class _Replayed(torch.autograd.Function):
    """A graphed tower call: forward and backward replayed; the parameters' gradients went into their `main_grad`.
    Its outputs are the call's rows of each of the tower's outputs (the embeddings, Qwen3-VL's deepstack features)."""

    @staticmethod
    def forward(ctx, graph: _BucketGraph, rows: int, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.graph, ctx.rows = graph, rows
        graph.replay.forward()
        return tuple(output[:rows].detach() for output in graph.replay.output)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None, None, None]:
        graph = ctx.graph
        for buffer, grad in zip(graph.grad_outputs, grads, strict=True):
            buffer[: ctx.rows].copy_(grad)
            buffer[ctx.rows :].zero_()
        graph.replay.backward()
        graph.pending = False
        return None, None, None


class _BucketGraph:
    """One bucket's static inputs, its eager first call, then its captured passes: of an HF tower (Qwen2-VL,
    Qwen2.5-VL) here, of Megatron-Bridge's Qwen3-VL tower in `_MegatronBucketGraph` (its own buffers, fill and
    forward pass)."""

    def __init__(self, graphs: TowerGraphs, bucket: TowerBucket, like: torch.Tensor) -> None:
        self.graphs, self.bucket = graphs, bucket
        self.pixels = torch.zeros(bucket.patches, like.shape[1], dtype=like.dtype, device=like.device)
        self.position_ids = torch.zeros(bucket.patches, 2, dtype=torch.long, device=like.device)
        self.cu_seqlens = torch.zeros(bucket.blocks + 1, dtype=torch.int32, device=like.device)
        steps = torch.arange(1, bucket.blocks + 1, dtype=torch.int32, device=like.device)
        self.block_steps = bucket.longest * steps  # the pad blocks' ends after the call's rows
        self.allocate(like.device)
        self.grad_outputs: tuple[torch.Tensor, ...] = ()
        self.replay: CudaGraphReplay | EagerReplay | None = None
        self.calls = 0
        self.pending = False  # a forward whose backward has not run: the buffers are in use
        self.failed: str | None = None  # why its capture failed: its calls run eagerly

    def allocate(self, device: torch.device) -> None:
        """The buffers beside pixels, position ids and blocks: Qwen2.5-VL's windows."""
        graphs, bucket = self.graphs, self.bucket
        self.window_index = self.cu_window_seqlens = None
        if graphs.window is not None:
            self.window_index = torch.arange(bucket.patches // graphs.merge_unit, device=device)
            self.cu_window_seqlens = torch.zeros(bucket.windows + 1, dtype=torch.int32, device=device)
            self.window_steps = graphs.window * torch.arange(1, bucket.windows + 1, dtype=torch.int32, device=device)
            self.all_units = self.window_index.clone()

    def fill(self, pixels: torch.Tensor, inputs: Any) -> None:
        """Copy a call into the buffers and write its pad entries (device ops only)."""
        rows = pixels.shape[0]
        self.pixels[:rows].copy_(pixels)
        self.pixels[rows:].zero_()
        self.position_ids[:rows].copy_(inputs.position_ids)
        self.position_ids[rows:].zero_()
        blocks = inputs.cu_seqlens.shape[0]
        self.cu_seqlens[:blocks].copy_(inputs.cu_seqlens)
        tail = self.cu_seqlens[blocks:]  # the pad rows in blocks of at most the longest, then empty blocks
        torch.add(self.block_steps[: tail.shape[0]], rows, out=tail)
        tail.clamp_(max=self.bucket.patches)
        self.fill_allocated(rows, inputs)

    def fill_allocated(self, rows: int, inputs: TowerInputs) -> None:
        """The buffers of `allocate`: Qwen2.5-VL's windows."""
        bucket = self.bucket
        if self.window_index is not None:
            units = rows // self.graphs.merge_unit
            self.window_index[:units].copy_(inputs.window_index)
            self.window_index[units:].copy_(self.all_units[units:])  # pad units stay where they are
            windows = inputs.cu_window_seqlens.shape[0]
            tail = self.cu_window_seqlens[windows:]
            torch.add(self.window_steps[: tail.shape[0]], rows, out=tail)  # whole windows over the pad rows
            tail.clamp_(max=bucket.patches)
            self.cu_window_seqlens[:windows].copy_(inputs.cu_window_seqlens)

    def forward_pass(self) -> tuple[torch.Tensor, ...]:
        """The tower on the buffers: its merged rows for all of the bucket's pixel rows."""
        graphs = self.graphs
        inputs = TowerInputs(
            position_ids=self.position_ids,
            cu_seqlens=self.cu_seqlens,
            max_seqlen=self.bucket.longest,
            window_index=self.window_index,
            cu_window_seqlens=self.cu_window_seqlens,
            max_window_seqlen=graphs.window,
        )
        return (graphs.tower(self.pixels, grid_thw=None, **tower_kwargs(inputs, graphs.tower)).pooler_output,)

    def backward_pass(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """The tower's backward from `grad_outputs`, every trained parameter's gradient added into its `main_grad`."""
        params = self.graphs.trained
        for param in params:
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = False
        grads = torch.autograd.grad(outputs, params, grad_outputs=self.grad_outputs, allow_unused=True)
        for param, grad in zip(params, grads, strict=True):
            if grad is not None and not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(grad)

    def __call__(self, pixels: torch.Tensor, inputs: Any) -> tuple[torch.Tensor, ...] | None:
        """The call's merged rows of each output, or None where the bucket's capture failed now (the caller runs it
        eagerly)."""
        merged = pixels.shape[0] // self.graphs.merge_unit
        self.fill(pixels, inputs)
        self.calls += 1
        if self.calls == 1:  # eager at the bucket's shapes: this micro-batch's pass, and the warm-up of its kernels
            outputs = self.forward_pass()
            self.grad_outputs = tuple(torch.zeros_like(output, requires_grad=False) for output in outputs)
            if outputs[0].requires_grad:
                self.pending = True
                outputs[0].register_hook(self._released)
            return tuple(output[:merged] for output in outputs)
        if self.replay is None:
            replay = self.graphs.new_replay()
            try:
                replay.capture(self.forward_pass, self.backward_pass)
            except RuntimeError as error:  # e.g. an op that cannot be captured: this bucket stays eager
                self.failed = f"a bucket whose capture failed ({type(error).__name__}: {str(error).splitlines()[0]})"
                logger.warning("speed-cuda-graphs: the vision tower's capture of %s failed: %s", self.bucket, error)
                return None
            self.replay = replay
        if not self.graphs.trained:
            self.replay.forward()
            return tuple(output[:merged] for output in self.replay.output)
        self.pending = True
        return _Replayed.apply(self, merged, self.graphs.trained[0])

    def _released(self, grad: torch.Tensor) -> None:
        self.pending = False


class _MegatronBucketGraph(_BucketGraph):
    """A bucket of Megatron-Bridge's Qwen3-VL tower (Qwen3-VL, Qwen3.5-VL): qvl's prepared forward
    (qvl.kernels.speed_qwen3_vl_tower.prepared_tower_forward) on fixed shapes. Its grid-dependent steps become
    gathers from buffers: the position table's four bilinear corners and weights are taken per patch
    (`pos_embed_order`, the loader's) where upstream looks them up per grid position and then repeats them over
    frames and permutes them (the same products and sums per element; the table's gradient sums a video's frames in
    another order), and the rotary's frequency table has the bucket's rows (a longer table, the same rows). Pad rows:
    zero pixels, the table's first row at weight 0, rotary position 0, one attention block of their own; the
    embeddings and every deepstack feature are cut to the call's rows."""

    def allocate(self, device: torch.device) -> None:
        rows = self.bucket.patches
        self.pos_embed_index = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.pos_embed_weight = torch.zeros(4, rows, dtype=torch.float32, device=device)

    def fill_allocated(self, rows: int, inputs: MegatronTowerInputs) -> None:
        """The corners' indices and weights of each patch, the pad rows' at zero."""
        pairs = ((self.pos_embed_index, inputs.pos_embed_index), (self.pos_embed_weight, inputs.pos_embed_weight))
        for buffer, per_position in pairs:  # each patch's corners and weights: a gather, no host read
            buffer[:, :rows].copy_(per_position.index_select(1, inputs.pos_embed_order))
            buffer[:, rows:].zero_()

    def forward_pass(self) -> tuple[torch.Tensor, ...]:
        """The tower on the buffers: its merged rows and deepstack features for all of the bucket's rows."""
        from qvl.kernels.speed_qwen3_vl_tower import tower_from_embeddings

        tower, rows = self.graphs.tower, self.bucket.patches
        table = tower.pos_embed.weight
        corners = tower.pos_embed(self.pos_embed_index) * self.pos_embed_weight.to(table.dtype)[:, :, None]
        pos_embeds = corners[0] + corners[1] + corners[2] + corners[3]
        frequencies = tower.rotary_pos_emb(rows)[self.position_ids].flatten(1)
        embeddings, deepstack = tower_from_embeddings(
            tower, self.pixels, pos_embeds, frequencies, self.cu_seqlens, self.bucket.longest
        )
        return (embeddings, *deepstack)


class TowerGraphs:
    """One replicated HF vision tower's graphs, a bucket each (see the module's docstring); `MegatronTowerGraphs`
    for Megatron-Bridge's Qwen3-VL tower."""

    bucket_graph_type: type[_BucketGraph] = _BucketGraph

    def __init__(
        self,
        tower: torch.nn.Module,
        *,
        cuda: bool = True,
        max_graphs: int = MAX_GRAPHS,
        planned_calls: Iterable[int] = (),
        planned_most: int = MAX_GRAPHS,
    ) -> None:
        """`planned_calls`: the pixel rows of every tower call the run will make (its prepared dataset's, of this
        tower's media kind or kinds): at most `planned_most` bucket sizes (and `max_graphs`) are planned to pad them
        least; () for the geometric grid."""
        config = tower.config
        self.tower = tower
        self.merge_unit = config.spatial_merge_size**2
        self.unit, self.window = tower_unit(config)  # a bucket's rows are a multiple of unit; window: None unwindowed
        self.sizes = planned_sizes(planned_calls, unit=self.unit, most=min(max_graphs, planned_most))
        self.trained = [p for p in tower.parameters() if p.requires_grad]
        self.cuda, self.max_graphs = cuda, max_graphs
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.buckets: dict[int, _BucketGraph] = {}  # by pixel rows: one graph per size
        self.refused: set[str] = set()
        self.calls: collections.Counter = collections.Counter()  # "warm-up", "captured", "replayed", "eager"
        self.regrown = 0  # graphs made again with more blocks or windows (`TowerBucket.grown`)
        self.rows = collections.Counter()  # "real" pixel rows of the graphed calls, "padded" their buckets' rows

    def new_replay(self) -> CudaGraphReplay | EagerReplay:
        return CudaGraphReplay(self.pool) if self.cuda else EagerReplay()

    def eager_reason(self, inputs: Any) -> str | None:
        """Why a call with `inputs` runs eagerly whatever its bucket (None: it can be graphed)."""
        if not isinstance(inputs, TowerInputs):
            return "a call without the loader's tower inputs"
        if not (torch.is_grad_enabled() and self.tower.training):
            return "a call without autograd (evaluation)"
        if inputs.max_window_seqlen is not None and inputs.max_window_seqlen > self.window:
            return f"a window of {inputs.max_window_seqlen} rows (the graphs' longest is {self.window})"
        return None

    def bucket_graph(self, pixels: torch.Tensor, inputs: Any) -> tuple[_BucketGraph | None, str | None]:
        """The graph of the call's bucket (made on its first call), or None and why the call runs eagerly."""
        windows = None if self.window is None else inputs.cu_window_seqlens.shape[0] - 1
        blocks = inputs.cu_seqlens.shape[0] - 1
        rows = bucket_size(pixels.shape[0], unit=self.unit, sizes=self.sizes)
        graph = self.buckets.get(rows)
        longest = max(inputs.max_seqlen, graph.bucket.longest if graph is not None else 0)
        needed = tower_bucket(
            pixels.shape[0], blocks, windows, unit=self.unit, window=self.window, longest=longest, sizes=self.sizes
        )
        if graph is not None and graph.pending:
            return None, "a second call while the bucket's backward is pending"
        if graph is None or not graph.bucket.holds(needed):
            if graph is None and len(self.buckets) >= self.max_graphs:
                return None, f"more than {self.max_graphs} sizes of tower calls"
            if any(getattr(p, "main_grad", None) is None for p in self.trained):  # DDP gives them before step 1
                return None, "trained tower parameters without Megatron DDP's main_grad"
            bucket = needed if graph is None else graph.bucket.grown(needed)
            self.regrown += graph is not None  # the old graph and its buffers go (its backward has run)
            graph = self.buckets[needed.patches] = self.bucket_graph_type(self, bucket, pixels)
        if graph.calls and self.replay_pending(graph):
            return None, "a call while another size's replayed backward is pending (one memory pool)"
        return (None, graph.failed) if graph.failed is not None else (graph, None)

    def replay_pending(self, graph: _BucketGraph) -> bool:
        """Whether a bucket other than `graph` has replayed a forward whose backward has not run. Every bucket's
        graphs are captured into one memory pool, and a later capture may be given the blocks an earlier one's
        saved activations used (they are free once its backward was captured): so a replay may write where a pending
        backward will read. Replayed as captured, a forward and then its backward, no two buckets' passes overlap:
        a second call before the first's backward runs eagerly (qvl's forwards make one call per micro-batch, a
        micro-batch's images and videos together). Its first call (eager, outside the pool) may run: only a capture
        or a replay uses the pool."""
        return any(other.pending and other.replay is not None for other in self.buckets.values() if other is not graph)

    def bucket_rows(self, patches: int) -> int:
        """The pixel rows a graphed call of `patches` rows runs: its bucket's (the step census counts them)."""
        return bucket_size(patches, unit=self.unit, sizes=self.sizes)

    def __call__(self, pixels: torch.Tensor, inputs: Any, grid_thw: torch.Tensor) -> torch.Tensor:
        """The tower's merged output rows for `pixels` (the tower's `pooler_output`), replayed where it can be."""
        return self.outputs(pixels, inputs, grid_thw)[0]

    def eager(self, pixels: torch.Tensor, inputs: Any, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tower called as without graphs: its outputs."""
        given = tower_kwargs(inputs, self.tower) if isinstance(inputs, TowerInputs) else {}
        return (self.tower(pixels, grid_thw=grid_thw, **given).pooler_output,)

    def outputs(self, pixels: torch.Tensor, inputs: Any, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tower's outputs for `pixels`, replayed where they can be."""
        reason = self.eager_reason(inputs)
        graph, reason = (None, reason) if reason is not None else self.bucket_graph(pixels, inputs)
        if graph is not None:
            kind = ("warm-up", "captured")[graph.calls] if graph.calls < 2 else "replayed"
            output = graph(pixels, inputs)
            if output is not None:
                self.calls[kind] += 1
                self.rows.update(real=pixels.shape[0], padded=graph.bucket.patches)
                return output
            reason = graph.failed
        self.calls["eager"] += 1
        if reason not in self.refused:
            self.refused.add(reason)
            logger.info("speed-cuda-graphs: the vision tower runs eagerly for %s", reason)
        return self.eager(pixels, inputs, grid_thw)

    def stats(self) -> dict:
        """What the graphs did so far: buckets (sizes), whether their sizes were planned from the dataset, graphs made
        again with more slots, calls by kind, the rows padding added, why calls ran eagerly."""
        real = self.rows["real"]
        return {
            "buckets": len(self.buckets),
            "planned_sizes": len(self.sizes),
            "regrown": self.regrown,
            "calls": dict(self.calls),
            "padding_share": round(self.rows["padded"] / real - 1, 4) if real else None,
            "eager_because": sorted(self.refused),
        }


class MegatronTowerGraphs(TowerGraphs):
    """The graphs of Megatron-Bridge's Qwen3-VL vision tower (qvl's subclass, qvl.bridges.qwen3_vl): called with the
    loader's `MegatronTowerInputs`, it returns the tower's embeddings and deepstack features, as the tower does."""

    bucket_graph_type = _MegatronBucketGraph

    def eager_reason(self, inputs: Any) -> str | None:
        from qvl.kernels.speed_qwen3_vl_tower import takes_prepared_inputs

        if not isinstance(inputs, MegatronTowerInputs):
            return "a call without the loader's tower inputs"
        if not (torch.is_grad_enabled() and self.tower.training):
            return "a call without autograd (evaluation)"
        if not takes_prepared_inputs(self.tower, inputs, None):
            return "a call upstream's forward serves (a pipeline stage's input, Transformer Engine's vision graphs)"
        return None

    def eager(self, pixels: torch.Tensor, inputs: Any, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = inputs if isinstance(inputs, MegatronTowerInputs) else None
        embeddings, deepstack = self.tower(hidden_states=pixels, grid_thw=grid_thw, tower_inputs=given)
        return (embeddings, *deepstack)

    def __call__(
        self, pixels: torch.Tensor, inputs: Any, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower's embeddings and deepstack features for `pixels`, replayed where they can be."""
        embeddings, *deepstack = self.outputs(pixels, inputs, grid_thw)
        return embeddings, deepstack


def launches_per_call(*, windowed: bool, outputs: int = 1, megatron: bool = False) -> int:
    """Kernels one graphed tower call launches, forward and backward (the step census's estimate uses it): its
    fills, two replays and each of its `outputs`' gradient."""
    fills = MEGATRON_FILL_LAUNCHES if megatron else FILL_LAUNCHES[windowed]
    return fills + 1 + GRADIENT_LAUNCHES * outputs + 1


def megatron_tower_graphs(model: Any) -> MegatronTowerGraphs | None:
    """The graphs of a Qwen3-VL / Qwen3.5-VL model's Megatron vision tower (`model.vision_model`), made on first use,
    where speed-cuda-graphs marked the tower graphed (`tower_graphs_allowed`); None elsewhere (eager)."""
    return _graphs_of(model, "vision_model", MegatronTowerGraphs)


def tower_graphs(model: Any) -> TowerGraphs | None:
    """The graphs of a Qwen2-VL / Qwen2.5-VL model's replicated tower (`model.visual`), made on first use, where
    speed-cuda-graphs marked the tower graphed (`tower_graphs_allowed`: a CUDA run); None elsewhere (eager)."""
    return _graphs_of(model, "visual", TowerGraphs)


def _graphs_of(model: Any, attribute: str, graphs_type: type[TowerGraphs]) -> TowerGraphs | None:
    from qvl.kernels.speed_cuda_graphs import TOWER_DATASET, TOWER_SIZES, dataset_tower_calls, tower_graphs_allowed

    tower = getattr(model, attribute, None)
    if tower is None or not tower_graphs_allowed(model.config) or not graph_replay.can_capture():
        return None
    graphs = getattr(tower, "qvl_graphs", None)
    if graphs is None:
        dataset = getattr(model.config, TOWER_DATASET, None)
        calls = dataset_tower_calls(dataset) if dataset else ()
        most = getattr(model.config, TOWER_SIZES, MAX_GRAPHS)
        graphs = graphs_type(tower, planned_calls=calls, planned_most=most)
        if graphs.sizes:
            count = len(graphs.sizes)
            logger.info(
                "speed-cuda-graphs: the vision tower's %d bucket size%s planned from %s",
                count, "" if count == 1 else "s", dataset,
            )  # fmt: skip
        tower.qvl_graphs = graphs  # a plain attribute: not a submodule, not in the state dict
    return graphs
