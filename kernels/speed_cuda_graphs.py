"""The language model's layers replayed as CUDA graphs at the fixed shapes offline packing gives (patch group
"speed-cuda-graphs" of qvl.foundation.patches; on CUDA only, qvl.kernels.switch).

Why: without Transformer Engine a training step is bound by the host. On an H100 (benchmarks/RESULTS.md,
2026-11-26) the GPU sat idle 31% of the step while the host launched ~17k kernels; each of the language model's
layers launches some forty kernels per pack each way. A CUDA graph replays a layer's forward (or backward) as one
launch.

How: Megatron-Core's own per-layer graphs (`cuda_graph_impl="local"`, megatron/core/transformer/cuda_graphs.py)
need no Transformer Engine. The first training step runs eagerly and records the order of the layers' forwards and
backwards; at its end (Megatron-Core's schedules call `create_cudagraphs`) each layer's forward and backward is
captured once, into one memory pool; later micro-batches copy their inputs into the graphs' static buffers and
replay. Weight gradients go into `main_grad` inside the backward graphs. A graph replays only what it captured: every
micro-batch must give each layer the same shapes and the same non-tensor arguments (else Megatron-Core asserts that
no captured graph matches). qvl's forward step makes them so (`graph_shapes`, qvl.training.step.model_inputs):
- tokens: every pack padded to `seq_length` (one extra sub-sequence of pad tokens, no loss), as for pipeline stages;
- `cu_seqlens`: a fixed-size device tensor, `slots + 1` entries: the pack's bounds, then its last bound repeated
  (`fixed_size_cu_seqlens`): zero-length sub-sequences at the end, which attention skips and the whole-pack rotary
  never reads; `slots` is the dataset's fullest pack plus the pad sub-sequence;
- `max_seqlen`: `seq_length` for every pack (the flash kernel's grid grows with it: a little more work per call).

What changes upstream (the registry's entries of this group):
- `megatron.bridge.training.setup:initialize_megatron` (`with_layer_graphs`): before Megatron is initialised, the
  language model's config asks for whole-layer graphs; Megatron-Bridge's initialize then seeds a graph-safe RNG
  tracker from it (one made earlier in the process without graphs is made again: `graph_safe_rng_tracker`), and the
  layers build their graph managers when the model is built. Where no graph can be captured (no CUDA, and not the
  CPU's recorded graphs) it changes nothing: the step census applies the groups of a CUDA run on the CPU.
- `megatron.bridge.models.gpt_provider:validate_cuda_graph_configuration` (`allowing_layer_graphs`): Megatron-Bridge
  0.6.2 refuses local graphs that are not full-iteration ones when it builds the model; these pass. Its provider also
  asserts `use_te_rng_tracker` for any graphs, which the settings give (without TE, Megatron-Core's own tracker).
- `megatron.bridge.training.train:_delete_cuda_graphs` (`deleting_layer_graphs`): Megatron-Core's local graphs are
  deleted when the loop ends, as Megatron-Bridge deletes TE's.
- `megatron.core.transformer.cuda_graphs:ArgMetadata` (`keeping_whole_pack`): the static input buffers Megatron-Core
  allocates are plain tensors, and its type check refuses tensor subclasses; qvl's `WholePackCuSeqlens` (the rotary's
  no-host-read path, qvl.kernels.speed_rotary) keeps its type in the buffer (and through the `clone` and `detach`
  the graphs' warm-up and shared buffers make of it: its own `__torch_function__`).

On the CPU the group runs with the graphs recorded (patch group "cpu-cuda-graphs", qvl.foundation.graph_replay): the
same managers, buffers and copies, each capture's ops replayed as recorded. That is how Megatron-Bridge's refusal and
assertion, the lost whole-pack type and Qwen3-VL's in-place deepstack add into a graphed layer's output
(qvl.kernels.speed_qwen3_vl_sync_free, qvl.bridges.qwen3_vl) were found before any GPU ran them;
tests/kernels/test_speed_cuda_graphs.py trains tiny Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE both ways, Qwen3-VL and
Qwen3-VL-MoE also at TP=2.

A MoE layer is captured in part (`moe_graphs`), as Megatron-Core 0.19.2's own training graphs capture it: its router
(with the all-to-all dispatcher's preprocessing, whose counts the graph copies to the host) and its combine are two
graphs each way, the experts between them run eagerly, and the layer's call is eager; its attention (with the input
norm and the residual add) is a third graph each way where it is not a Gated DeltaNet (qvl's
`local_specs.GraphedAttentionMoELayer`, through the same CudaGraphManager). Its packs are padded to `seq_length` as for
whole layers; the pad is masked out of the router's balancing loss (qvl.kernels.fix_moe_pad_tokens), the mask one of
the router graph's inputs. Where the run's experts are grouped on one expert rank (`grouped_experts=true`, EP and expert
TP 1, dropless) nothing of the MoE block reads back to the host or changes shape, and the whole block is one graph
each way (qvl.kernels.moe_block_graphs): no router graph to wait for and no eager experts.

The vision tower is graphed by qvl's own forward where this group marked it (`tower_graphs_allowed`): the replicated
HF tower (Qwen2-VL, Qwen2.5-VL) by qvl.kernels.tower_graphs, Megatron-Bridge's Qwen3-VL tower (Qwen3-VL, Qwen3.5-VL)
by its `MegatronTowerGraphs`, at bucketed patch counts, since every pack has its own (the sizes planned from the
dataset's packs where a micro-batch is one pack: `planned_dataset`, `TOWER_DATASET`). Its calls are bucketed on their
own, so it replays as graphs also where the layers cannot be captured (full activation recompute): the tower is
most of a step's launches (the step census: 7,952 of 12,146 for Qwen2.5-VL-3B's shapes), and the language model's
packs are not padded for it. Not graphed: the embedding and output layer, the loss and the optimizer; the layers where
they cannot be captured at fixed shapes or Megatron-Core cannot make their graphs (`eager_layers`: pipeline stages,
full activation recompute), a MoE layer's experts, Qwen3.5's Gated DeltaNet attention (fla's kernels launch one
program per 64-token chunk of each sub-sequence, so their grids follow the pack; they read nothing back under
speed-gated-delta-sync-free; a dense layer's MLP is graphed apart: qvl.kernels.local_specs.GraphedMLPLayer); the tower
under pipeline parallelism, DDP's overlapped gradient reduction, balanced vision work, or, Megatron-Bridge's tower,
activation recompute (`eager_tower`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from qvl.foundation import graph_replay
from qvl.foundation.errors import ConfigError, QvlError
from qvl.foundation.megatron import gated_delta_net
from qvl.kernels.moe_block_graphs import WHOLE_MOE, whole_moe_blocks
from qvl.kernels.speed_rotary import WholePackCuSeqlens, mark_whole_pack

logger = logging.getLogger(__name__)

GROUP = "speed-cuda-graphs"
WARMUP_STEPS = 2  # eager runs of each layer before its capture (Megatron-Core's cuda_graph_warmup_steps)
TOWER_GRAPHS = "qvl_tower_graphs"  # the model config's flag: its vision tower may be graphed too
TOWER_DATASET = "qvl_tower_dataset"  # the model config's dataset whose tower calls plan the tower's bucket sizes
TOWER_SIZES = "qvl_tower_sizes"  # the model config's most planned sizes: fewer for a run too short to replay them
CALLS_PER_SIZE = 8  # a planned size's warm-up and capture take at most a quarter of its calls, on average


class TooManySubSequencesError(QvlError):
    """A pack has more sub-sequences than the graphs' fixed `cu_seqlens` holds."""


@dataclass(kw_only=True, slots=True, frozen=True)
class GraphShapes:
    """What every micro-batch gives the graphed layers: `tokens` per pack, `cu_seqlens` of `slots + 1` entries, and
    `max_seqlen`."""

    tokens: int
    slots: int
    max_seqlen: int
    whole_layers: bool = True  # False: MoE layers' partial graphs (`moe_graphs`), whose layer calls are eager


def graphs_requested(model_config: Any) -> bool:
    """Whether `model_config` (the language model's TransformerConfig) replays its layers as Megatron-Core's graphs."""
    return getattr(model_config, "cuda_graph_impl", "none") == "local"


def tower_graphs_allowed(model_config: Any) -> bool:
    """Whether the vision tower of a model with `model_config` (the language model's TransformerConfig) replays as
    graphs (qvl.kernels.tower_graphs): where this group marked it so (`with_layer_graphs`, from `eager_tower`),
    whether or not the language model's layers are graphed too."""
    return bool(getattr(model_config, TOWER_GRAPHS, False))


def eager_layers(cfg: Any) -> str | None:
    """Why the language model of `cfg`'s run (a ConfigContainer) keeps its layers eager under this group, None where
    they replay as graphs. A graph replays the shapes it captured (`layer_graph_settings`): pipeline stages send
    activations between micro-batches of other stages. (A Gated DeltaNet layer's kernel grids follow the pack's
    64-token chunks: Qwen3.5's dense ones graph their MLP alone, qvl.kernels.local_specs.GraphedMLPLayer; a MoE one's
    graphs hold none of its attention.) A MoE layer is graphed in part (`moe_graphs`), except where its all-to-all
    dispatcher reads its splits to the host inside the router (a capacity factor without padding to it, or the
    router's fp8 padding: Megatron-Core 0.19.2 refuses to capture those). Full activation recompute keeps the layers eager too (Megatron-Core 0.19.2 cannot make the graphs:
    `create_cudagraphs` asserts on the shared buffers' count), and so does selective recompute of a module the graphs
    cannot hold (UNGRAPHED_RECOMPUTE)."""
    model = cfg.model
    if getattr(model, "pipeline_model_parallel_size", 1) > 1:
        return "pipeline parallelism keeps the layers eager"
    if moe_graphs(model) and getattr(model, "moe_token_dispatcher_type", None) == "alltoall":
        dropping = getattr(model, "moe_expert_capacity_factor", None) is not None and not getattr(
            model, "moe_pad_expert_input_to_capacity", False
        )
        if dropping or getattr(model, "moe_router_padding_for_fp8", False):
            return (
                "MoE layers whose all-to-all dispatcher reads its splits to the host inside the router (a capacity "
                "factor without moe_pad_expert_input_to_capacity, or moe_router_padding_for_fp8) keep the model eager"
            )
    if getattr(model, "recompute_granularity", None) == "full":
        # a recomputed layer runs its forward again inside the backward: Megatron-Core 0.19.2's graphs then lose the
        # record of the buffers they share, and creating them asserts (seen with the CPU's recorded graphs)
        return "full activation recompute keeps the layers eager"
    recomputed = sorted(set(_selective(model)) & UNGRAPHED_RECOMPUTE)
    if recomputed:
        return (
            f"selective recompute of {', '.join(recomputed)} keeps the layers eager (recompute_modules: "
            "core_attn and mlp are recomputed inside the graphs)"
        )
    return None


# Selective recompute a layer's graphs cannot hold (seen with the CPU's recorded graphs): `layernorm` (and `moe_act`,
# the same mechanism: Megatron-Core's CheckpointWithoutOutput, whose recompute hooks a graph does not replay) trains
# other losses graphed than eagerly (2e-5 by step 4, Qwen2.5-VL and Qwen3-VL-MoE); `moe` recomputes a MoE layer's
# partial graphs, and creating them asserts as under full recompute.
UNGRAPHED_RECOMPUTE = frozenset({"layernorm", "moe_act", "moe"})


def _selective(model: Any) -> list[str]:
    """The modules `model` (its provider or TransformerConfig) recomputes selectively ([] otherwise)."""
    if getattr(model, "recompute_granularity", None) != "selective":
        return []
    return list(getattr(model, "recompute_modules", None) or [])


def moe_graphs(model: Any) -> bool:
    """Whether the language model (its provider or TransformerConfig) has MoE layers, whose graphs are partial
    (`layer_graph_settings`): an expert takes the tokens routed to it, whose counts its dispatcher reads to the host
    to split them, so Megatron-Core 0.19.2's MoETransformerLayer (qvl.kernels.local_specs) captures what comes before
    (the pre-MLP norm, the router, its load-balancing loss and the dispatcher's preprocessing, whose counts come to the
    host in the graph's copies) and what comes after (the combine and the residual add), and runs the experts between
    them eagerly; qvl's MoE layer (qvl.kernels.local_specs.GraphedAttentionMoELayer) graphs its attention apart too,
    but a Gated DeltaNet. Those layers' calls are then eager: a pack's pad may be marked
    (qvl.kernels.fix_moe_pad_tokens) and the mask is one of the router graph's inputs."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern

    return bool(getattr(model, "num_moe_experts", None)) and any(get_moe_layer_pattern(model))


def eager_parts(model: Any) -> str:
    """What the graphs of `model`'s layers (the language model's provider, its graphs set) hold, in words for the
    run's log, where not every layer is graphed whole: a MoE layer's attention and its MoE block whole where the run
    asks for that (qvl.kernels.moe_block_graphs), else its attention, router and combine, its experts eager
    (qvl.kernels.local_specs.GraphedAttentionMoELayer); a Gated DeltaNet attention is eager (a dense layer's MLP
    graphed alone, qvl.kernels.local_specs.GraphedMLPLayer)."""
    gated_delta = gated_delta_net(model)
    if getattr(model, WHOLE_MOE, False):  # qvl.kernels.moe_block_graphs
        if gated_delta:
            return " (each MoE layer's whole MoE block, experts included, and its full attention; Gated DeltaNet eager)"
        return " (each MoE layer's attention and its whole MoE block, experts included)"
    if getattr(model, "cuda_graph_modules", None):
        if gated_delta:
            return " (each MoE layer's router and combine, and its full attention; Gated DeltaNet and experts eager)"
        return " (each MoE layer's attention, router and combine; its experts eager)"
    return " (a Gated DeltaNet layer's MLP alone; its Gated DeltaNet eager)" if gated_delta else ""


def eager_tower(cfg: Any) -> str | None:
    """Why the vision tower of `cfg`'s run (a ConfigContainer) stays eager under this group, None where it replays as
    graphs, with the layers' graphs or without them (full recompute: the tower's calls
    are bucketed on their own, and the language model's packs are not padded for it). Eager: under pipeline
    parallelism (the first stage runs several micro-batches' forwards before their backwards, and a bucket's graphs
    take one at a time), where DDP overlaps its gradient reduction with the backward (the tower's graphs add into
    main_grad without the parameters' hooks), where the vision work is balanced over ranks
    (qvl.training.vision_balance encodes eagerly), or where Megatron-Bridge's tower recomputes with the language
    model (any `recompute`)."""
    if getattr(cfg.model, "pipeline_model_parallel_size", 1) > 1:
        return "pipeline parallelism keeps the vision tower eager"
    if getattr(getattr(cfg, "ddp", None), "overlap_grad_reduce", False):
        return (
            "with ddp.overlap_grad_reduce the vision tower stays eager (its graphs add gradients into main_grad "
            "without the parameters' hooks that overlap needs)"
        )
    if getattr(getattr(cfg, "qvl", None), "vision_balance", False):
        return "vision_balance keeps the vision tower eager (it encodes each rank's share of the images eagerly)"
    recompute = getattr(cfg.model, "recompute_granularity", None)
    if recompute and megatron_tower(cfg.model):
        # Megatron-Bridge's Qwen3-VL tower takes the language model's recompute settings: its checkpointed blocks
        # refuse the capture's warm-up through torch.autograd.grad (seen with the CPU's recorded graphs)
        return (
            f"recompute={recompute} keeps Megatron-Bridge's vision tower eager (it recomputes with the language model)"
        )
    return None


def megatron_tower(model: Any) -> bool:
    """Whether the model of `model` (its provider) has Megatron-Bridge's Qwen3-VL vision tower (Qwen3-VL, Qwen3.5-VL),
    from its family's record."""
    from qvl.foundation.families import family_of_provider

    family = family_of_provider(model)
    return family is not None and family.megatron_vision_tower


def graphed_parts(cfg: Any) -> tuple[bool, bool]:
    """(layers, tower): what a run of `cfg` (a ConfigContainer) replays as CUDA graphs where this group applies: the
    language model's layers where they can be captured (`eager_layers`), the vision tower where its calls can
    (`eager_tower`), each without the other."""
    return eager_layers(cfg) is None, eager_tower(cfg) is None


def graphable_input(model_config: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The language model's input (the first graphed layer's), made to require a gradient where the run's layers are
    graphed and it needs none (a frozen language model: adapters, freeze=language). Megatron-Core 0.19.2's capture
    warms each layer's graph up with the gradient of its inputs, and `torch.autograd.grad` refuses an empty list (seen
    with the CPU's recorded graphs). The gradient the first layer then computes for it (one layer's input-gradient
    GEMMs) goes nowhere."""
    if graphs_requested(model_config) and torch.is_grad_enabled() and not hidden_states.requires_grad:
        return hidden_states.detach().requires_grad_()
    return hidden_states


def graph_shapes(config: Any) -> GraphShapes | None:
    """The fixed shapes of a run whose layers are graphed (a ConfigContainer), None for an eager run: a micro-batch of
    several packs is their tokens one after the other (`micro_batch_size` x `seq_length`) and their sub-sequences."""
    if not graphs_requested(config.model):
        return None
    packs = getattr(getattr(config, "train", None), "micro_batch_size", 1) or 1
    seq_length = config.model.seq_length
    path = getattr(config.dataset, "path", None)
    if path is None:
        raise ConfigError(
            "speed-cuda-graphs needs an offline-packed dataset (its fullest pack fixes cu_seqlens' size); "
            "set dataset.path to a `qvl data prepare` folder"
        )
    return GraphShapes(
        tokens=packs * seq_length,
        slots=packs * most_sub_sequences(str(path)) + 1,
        max_seqlen=seq_length,
        whole_layers=not getattr(config.model, "cuda_graph_modules", None),
    )


@functools.cache
def most_sub_sequences(dataset: str) -> int:
    """The most sub-sequences any pack of a `qvl data prepare` folder holds (its packs.jsonl)."""
    packs = pathlib.Path(dataset) / "packs.jsonl"
    if not packs.is_file():
        raise ConfigError(f"{dataset} has no packs.jsonl; prepare it with `qvl data prepare` for speed-cuda-graphs")
    with packs.open() as rows:
        return max(len(json.loads(row)["lengths"]) for row in rows if row.strip())


def planned_dataset(cfg: Any) -> str | None:
    """The dataset whose packs plan the graphed tower's bucket sizes: what a ConfigContainer's dataset config names
    (qvl's packed datasets: their own folder where each micro-batch is one pack, so that a tower call is a pack's
    images or videos); None elsewhere (the geometric grid)."""
    calls_of = getattr(getattr(cfg, "dataset", None), "tower_calls_dataset", None)
    path = calls_of() if callable(calls_of) else None
    return None if path is None else str(path)


def planned_size_count(cfg: Any) -> int:
    """The most bucket sizes a run of `cfg` (a ConfigContainer) plans for its tower: MAX_GRAPHS, fewer for a run
    too short to call each size CALLS_PER_SIZE times (a size's first call runs eagerly and its second captures, so
    a size adds two calls that do not replay). Its calls: `train_iters` times the packs one data-parallel rank
    trains per step (the launcher's WORLD_SIZE over tensor, pipeline and context parallelism)."""
    from qvl.kernels.tower_buckets import MAX_GRAPHS

    model, train = cfg.model, cfg.train
    splits = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        splits *= getattr(model, name, 1) or 1
    ranks = max(1, int(os.environ.get("WORLD_SIZE", "1")) // splits)
    calls = (getattr(train, "train_iters", None) or 0) * max(1, train.global_batch_size // ranks)
    return max(1, min(MAX_GRAPHS, calls // CALLS_PER_SIZE)) if calls else MAX_GRAPHS


def dataset_tower_calls(dataset: str) -> tuple[int, ...]:
    """The pixel rows of every graphed tower call a `qvl data prepare` folder's packs make, one per pack with media
    (packs.jsonl's `vision_rows`: each pack's image rows and video rows, the tower's distinct media, which a graphed
    tower takes in one call); () for a dataset prepared before packs recorded them, or without packs.jsonl (read once
    per version of the file)."""
    packs = pathlib.Path(dataset) / "packs.jsonl"
    if not packs.is_file():  # a run refuses it (graph_shapes); a plan of a folder not prepared yet has none
        return ()
    return _tower_calls(str(packs), packs.stat().st_mtime_ns)


@functools.cache
def _tower_calls(packs: str, version: int) -> tuple[int, ...]:
    calls = []
    with open(packs) as rows:
        for row in rows:
            if not row.strip():
                continue
            vision = json.loads(row).get("vision_rows")
            if vision is None:
                return ()
            calls.append(sum(vision))
    return tuple(call for call in calls if call > 0)


def fixed_size_cu_seqlens(cu_seqlens: torch.Tensor, slots: int) -> torch.Tensor:
    """`cu_seqlens` ([n + 1], on its device) as `slots + 1` entries: its last bound repeated after it. The extra
    sub-sequences have length zero: attention skips them, and nothing is read back to the host to make them."""
    extra = slots + 1 - cu_seqlens.shape[0]
    if extra < 0:
        raise TooManySubSequencesError(
            f"a pack of {cu_seqlens.shape[0] - 1} sub-sequences exceeds the CUDA graphs' {slots} slots; "
            "train on the dataset the run was configured with (its fullest pack sets the slots)"
        )
    if not extra:
        return cu_seqlens
    padded = torch.cat([cu_seqlens, cu_seqlens[-1:].expand(extra)])  # an op on a WholePackCuSeqlens: a plain tensor
    return mark_whole_pack(padded) if isinstance(cu_seqlens, WholePackCuSeqlens) else padded


def layer_graph_settings(model: Any = None) -> dict[str, Any]:
    """The TransformerConfig fields that make Megatron-Core capture the language model's layers (`model`, its
    provider; None: a dense one) as graphs of their own: each whole layer, or a MoE layer's router and combine
    (`moe_graphs`; Megatron-Core's enum members: the fields are set after the config normalised its strings), and
    qvl's mark of MoE layers that capture their whole MoE block instead (qvl.kernels.moe_block_graphs).
    `use_te_rng_tracker`: Megatron-Bridge's GPT provider asserts it for any CUDA graphs; without TE Megatron-Core
    makes its own tracker instead, graph-safe where graphs are asked for (tensor_parallel.random's
    `initialize_rng_tracker`), which is what these graphs need."""
    from megatron.core.transformer.enums import CudaGraphModule

    modules = [CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess] if moe_graphs(model) else []
    return {"cuda_graph_impl": "local", "cuda_graph_modules": modules, "cuda_graph_warmup_steps": WARMUP_STEPS,
            "use_te_rng_tracker": True, WHOLE_MOE: whole_moe_blocks(model)}  # fmt: skip


def eager_settings() -> dict[str, Any]:
    """The TransformerConfig fields of a model built from a graphed run's saved config to load it (an export, a
    check): the run's config carries the graphs it trained with (`layer_graph_settings`), which a load refuses
    (`inference_cuda_graph_scope` was normalised before the graphs were set) and does not need."""
    return {"cuda_graph_impl": "none", "cuda_graph_modules": [], "use_te_rng_tracker": False}


def graph_safe_rng_tracker() -> None:
    """Megatron-Core makes its model-parallel RNG tracker once per process and keeps it, graph-safe only where the
    language model's config asks for graphs when Megatron-Bridge seeds it. Graphed layers and a graphed tower both
    need it graph-safe (a tower's attention forks it inside the capture): a tracker that is not graph-safe, or none
    yet, is made graph-safe here, before the seeding, which keeps it and adds the run's seeds (after a run without
    graphs in this process, a notebook's second run, the one it left would not be graph-safe)."""
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker() if random._CUDA_RNG_STATE_TRACKER_INITIALIZED else None
    if tracker is None or not getattr(tracker, "use_cudagraphable_rng", False):
        random.initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)


def with_layer_graphs(original):
    """Patch factory for Megatron-Bridge's `initialize_megatron` as setup() calls it: the language model's config set
    for whole-layer CUDA graphs first, where its layers can be captured (`eager_layers`), and marked for the vision
    tower's graphs where its calls can (`eager_tower`), where CUDA is (the step census runs a CUDA run's groups on
    the CPU)."""

    @functools.wraps(original)
    def initialize_megatron(cfg, *args, **kwargs):
        if graph_replay.can_capture() and not graphs_requested(cfg.model):
            layers, tower = eager_layers(cfg), eager_tower(cfg)
            if layers is None:
                for name, value in layer_graph_settings(cfg.model).items():
                    setattr(cfg.model, name, value)
                logger.info(
                    "speed-cuda-graphs: the language model's layers replay as CUDA graphs from step 2%s",
                    eager_parts(cfg.model),
                )
                if tower is not None:
                    logger.warning("speed-cuda-graphs: %s", tower)
            elif tower is None:
                logger.warning("speed-cuda-graphs: %s; the vision tower alone replays as CUDA graphs", layers)
            else:
                logger.warning("speed-cuda-graphs: %s; cuda_graphs=true changes nothing in this run", layers)
            if layers is None or tower is None:
                graph_safe_rng_tracker()
            setattr(cfg.model, TOWER_GRAPHS, tower is None)
            setattr(cfg.model, TOWER_DATASET, planned_dataset(cfg) if tower is None else None)
            setattr(cfg.model, TOWER_SIZES, planned_size_count(cfg))
        return original(cfg, *args, **kwargs)

    return initialize_megatron


def allowing_layer_graphs(original):
    """Patch factory for Megatron-Bridge's `validate_cuda_graph_configuration` as its GPT provider calls it when it
    builds the language model: the local graphs `with_layer_graphs` set (marked by TOWER_GRAPHS: whole layers, or MoE
    layers' router and combine) pass; any other configuration is checked as upstream checks it."""

    @functools.wraps(original)
    def validate_cuda_graph_configuration(config, *args, **kwargs):
        ours = layer_graph_settings(config)["cuda_graph_modules"]
        if graphs_requested(config) and hasattr(config, TOWER_GRAPHS) and config.cuda_graph_modules == ours:
            return None
        return original(config, *args, **kwargs)

    return validate_cuda_graph_configuration


def deleting_layer_graphs(original):
    """Patch factory for Megatron-Bridge's `_delete_cuda_graphs`, run when its training loop ends: Megatron-Core's
    local per-layer graphs are deleted too (`delete_cuda_graphs`: the runners, the global record and the pool), so
    their memory goes with the run and a later run in this process captures its own."""

    @functools.wraps(original)
    def _delete_cuda_graphs(cuda_graph_helper):
        original(cuda_graph_helper)
        from megatron.core.transformer import cuda_graphs

        if cuda_graphs._CudagraphGlobalRecord.cudagraph_created or cuda_graphs._CudagraphGlobalRecord.cudagraph_record:
            cuda_graphs.delete_cuda_graphs()

    return _delete_cuda_graphs


def keeping_whole_pack(original):
    """Patch factory for Megatron-Core's `ArgMetadata`: a `WholePackCuSeqlens` argument is recorded as a tensor (the
    supported-type check) whose static buffer is a `WholePackCuSeqlens` again."""

    class ArgMetadata(original):
        def __init__(self, arg):
            super().__init__(arg)
            self.whole_pack = isinstance(arg, WholePackCuSeqlens)
            if self.whole_pack:
                self.type = torch.Tensor

        def zeros_like(self):
            buffer = super().zeros_like()
            return buffer.as_subclass(WholePackCuSeqlens) if self.whole_pack else buffer

    return ArgMetadata
