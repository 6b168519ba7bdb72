"""The patch group speed-cuda-graphs (qvl.kernels.speed_cuda_graphs): the language model's layers replayed as
Megatron-Core's CUDA graphs at fixed shapes. On the CPU: the fixed-size `cu_seqlens` (extra entries inert), that a
pack given the graphs' fixed shapes trains exactly as it does eagerly (outputs and gradients), that Megatron-Core's
graph buffers keep qvl's whole-pack type, that the group asks for graphs only where they can be captured, and (slow)
that a run with the graphs recorded on the CPU (qvl.foundation.graph_replay) trains as it does eagerly. The device's
own capture runs on a GPU (tests/test_bench_train.py, `gpu`)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from qvl.foundation import distributed, megatron, patches
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import FAMILIES, get_family
from qvl.kernels import speed_cuda_graphs, speed_rotary, speed_sync_free
from qvl.kernels.speed_cuda_graphs import GraphShapes, TooManySubSequencesError, fixed_size_cu_seqlens
from qvl.kernels.speed_rotary import WholePackCuSeqlens, mark_whole_pack
from tests.kernels.test_speed_sync_free import _batch, _loss_and_grads
from tests.tiny_megatron import tiny_megatron_model


def test_fixed_size_cu_seqlens_end_with_zero_length_sub_sequences():
    cu = mark_whole_pack(torch.tensor([0, 3, 7, 10], dtype=torch.int32))
    fixed = fixed_size_cu_seqlens(cu, slots=6)
    assert fixed.tolist() == [0, 3, 7, 10, 10, 10, 10] and fixed.dtype == torch.int32
    assert isinstance(fixed, WholePackCuSeqlens)  # still the whole pack: the rotary's one-pass path
    assert fixed_size_cu_seqlens(cu, slots=3) is cu  # already the fixed size
    assert type(fixed_size_cu_seqlens(cu.as_subclass(torch.Tensor), slots=4)) is torch.Tensor
    with pytest.raises(TooManySubSequencesError, match="a pack of 3 sub-sequences exceeds the CUDA graphs' 2 slots"):
        fixed_size_cu_seqlens(cu, slots=2)


def test_graph_shapes_come_from_the_fullest_pack_of_the_dataset(tmp_path):
    rows = [{"lengths": [100, 200]}, {"lengths": [50, 50, 50, 50, 30]}, {"lengths": [4000]}]
    (tmp_path / "packs.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    model = types.SimpleNamespace(cuda_graph_impl="local", seq_length=4096)
    config = types.SimpleNamespace(model=model, dataset=types.SimpleNamespace(path=str(tmp_path)))
    # five sub-sequences at most, and the pad sub-sequence a short pack gets
    assert speed_cuda_graphs.graph_shapes(config) == GraphShapes(tokens=4096, slots=6, max_seqlen=4096)
    # two packs a micro-batch: their tokens one after the other (found training so with the CPU's recorded graphs)
    config.train = types.SimpleNamespace(micro_batch_size=2)
    assert speed_cuda_graphs.graph_shapes(config) == GraphShapes(tokens=8192, slots=11, max_seqlen=4096)
    assert speed_cuda_graphs.graph_shapes(types.SimpleNamespace(model=types.SimpleNamespace(seq_length=8))) is None
    config.dataset.path = None
    with pytest.raises(ConfigError, match="needs an offline-packed dataset"):
        speed_cuda_graphs.graph_shapes(config)


def test_the_tower_calls_of_a_dataset_are_its_packs_image_and_video_rows(tmp_path):
    rows = [{"lengths": [9], "vision_rows": [1_024, 0]}, {"lengths": [9], "vision_rows": [256, 512]}, {"lengths": [9]}]
    for name, packs in (("new", rows[:2]), ("old", rows[1:])):  # "old": a pack prepared before packs recorded them
        (tmp_path / name).mkdir()
        (tmp_path / name / "packs.jsonl").write_text("\n".join(map(json.dumps, packs)) + "\n")
    calls = speed_cuda_graphs.dataset_tower_calls
    assert calls(str(tmp_path / "new")) == (1_024, 768)  # a pack's images and videos: one graphed call
    assert calls(str(tmp_path / "old")) == ()


def test_a_run_too_short_to_replay_sixteen_sizes_plans_fewer(monkeypatch):
    """A planned size's first call runs eagerly and its second captures: a run plans at most one size per
    CALLS_PER_SIZE (8) of the tower calls one data-parallel rank makes (train_iters x its packs per step)."""

    def config(iters, batch=8, tp=1):
        return types.SimpleNamespace(
            model=types.SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1),
            train=types.SimpleNamespace(train_iters=iters, global_batch_size=batch),
        )

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert speed_cuda_graphs.planned_size_count(config(1_000)) == 16
    assert speed_cuda_graphs.planned_size_count(config(6)) == 6  # 48 calls
    assert speed_cuda_graphs.planned_size_count(config(None)) == 16  # no iteration count: a long run
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert speed_cuda_graphs.planned_size_count(config(6)) == 1  # 4 data-parallel ranks: 12 calls each
    assert speed_cuda_graphs.planned_size_count(config(6, tp=2)) == 3  # 2 of them: 24 calls each


def test_layer_graphs_are_asked_for_only_where_cuda_is(monkeypatch):
    seen, trackers = [], []
    initialize = speed_cuda_graphs.with_layer_graphs(lambda cfg, **kwargs: seen.append(dict(vars(cfg.model))))
    monkeypatch.setattr(speed_cuda_graphs, "graph_safe_rng_tracker", lambda: trackers.append(True))
    config = lambda pp, overlap=False, mbs=1: types.SimpleNamespace(  # noqa: E731
        model=types.SimpleNamespace(cuda_graph_impl="none", pipeline_model_parallel_size=pp),
        ddp=types.SimpleNamespace(overlap_grad_reduce=overlap),
        dataset=types.SimpleNamespace(tower_calls_dataset=lambda: "/data/packed" if mbs == 1 else None),
        train=types.SimpleNamespace(train_iters=1_000, global_batch_size=8),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the step census: a CUDA run's groups on the CPU
    initialize(config(1), restart_store=None)
    assert seen.pop()["cuda_graph_impl"] == "none" and not trackers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    initialize(config(1))
    graphed = {"pipeline_model_parallel_size": 1, **speed_cuda_graphs.layer_graph_settings()}
    model = seen.pop()
    planned = {speed_cuda_graphs.TOWER_GRAPHS: True, speed_cuda_graphs.TOWER_DATASET: "/data/packed",
               speed_cuda_graphs.TOWER_SIZES: 16}  # fmt: skip
    assert model == {**graphed, **planned}  # the tower's bucket sizes planned from the dataset's packs
    assert speed_cuda_graphs.tower_graphs_allowed(types.SimpleNamespace(**model)) and trackers.pop()
    initialize(config(1, mbs=2))  # a micro-batch of two packs: its tower calls are not the packs'
    assert seen.pop()[speed_cuda_graphs.TOWER_DATASET] is None
    initialize(config(1, overlap=True))  # DDP's overlap needs the parameters' hooks: the tower stays eager
    model = seen.pop()
    assert model == {**graphed, **planned, speed_cuda_graphs.TOWER_GRAPHS: False, speed_cuda_graphs.TOWER_DATASET: None}
    assert not speed_cuda_graphs.tower_graphs_allowed(types.SimpleNamespace(**model))
    trackers.clear()
    initialize(config(2))  # pipeline stages keep their layers eager, and the tower (a stage's forwards run ahead)
    model = seen.pop()
    assert model["cuda_graph_impl"] == "none" and not speed_cuda_graphs.tower_graphs_allowed(
        types.SimpleNamespace(**model)
    )
    assert not trackers  # nothing graphed: the RNG tracker is Megatron-Bridge's as it makes it


def test_graphs_make_the_rng_tracker_graph_safe(monkeypatch):
    """Graphed layers or a graphed tower need Megatron-Core's RNG tracker graph-safe (an attention forks it inside a
    capture). Megatron-Bridge makes it so only where the layers are graphed, and Megatron-Core keeps the first tracker
    a process makes: none yet, or one that is not graph-safe (a notebook's earlier eager run), is made graph-safe;
    a graph-safe one is kept."""
    megatron.import_megatron_bridge()
    from megatron.core.tensor_parallel import random

    monkeypatch.setattr(random, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    speed_cuda_graphs.graph_safe_rng_tracker()
    made = random.get_cuda_rng_tracker()
    assert made.use_cudagraphable_rng
    speed_cuda_graphs.graph_safe_rng_tracker()
    assert random.get_cuda_rng_tracker() is made  # kept
    random.initialize_rng_tracker(force_reset=True)  # an eager run's
    assert not random.get_cuda_rng_tracker().use_cudagraphable_rng
    speed_cuda_graphs.graph_safe_rng_tracker()
    assert random.get_cuda_rng_tracker().use_cudagraphable_rng
    random.initialize_rng_tracker()  # Megatron-Bridge's seeding of an eager-layer run keeps it
    assert random.get_cuda_rng_tracker().use_cudagraphable_rng


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_asks_for_its_layers_graphs_and_its_towers(family, monkeypatch, caplog):
    """Every family's language model asks Megatron-Core for its layers' graphs, and its vision tower for its own:
    whole layers, or a MoE layer's router and combine (Megatron-Core's partial graphs: its experts run eagerly between
    them) and its attention (qvl's third graph) where that is not a Gated DeltaNet. A dense Gated DeltaNet layer
    (Qwen3.5-VL) graphs its MLP alone: the Gated DeltaNet kernels' grids follow the pack's 64-token chunks, so it
    runs eagerly. Judged from the provider Megatron builds the model from, as a run's `initialize_megatron`
    sees it."""
    from megatron.core.transformer.enums import CudaGraphModule

    from qvl.bridges.providers import auto_bridge
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.kernels.local_specs import GraphedMLPLayer

    megatron.import_megatron_bridge()
    hf_config = tiny_hf_config(family)
    provider = auto_bridge(hf_config).to_megatron_provider(load_weights=False)
    cfg = types.SimpleNamespace(
        model=provider,
        ddp=types.SimpleNamespace(overlap_grad_reduce=False),
        dataset=types.SimpleNamespace(tower_calls_dataset=lambda: None, path=None),
        train=types.SimpleNamespace(train_iters=1_000, global_batch_size=8),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(speed_cuda_graphs, "graph_safe_rng_tracker", lambda: None)  # the process's tracker untouched
    with caplog.at_level("INFO", logger=speed_cuda_graphs.__name__):
        speed_cuda_graphs.with_layer_graphs(lambda cfg: None)(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == speed_cuda_graphs.__name__]
    assert speed_cuda_graphs.eager_layers(cfg) is None and speed_cuda_graphs.graphed_parts(cfg) == (True, True)
    assert speed_cuda_graphs.tower_graphs_allowed(provider) and provider.cuda_graph_impl == "local"
    moe = get_family(family).moe
    assert provider.cuda_graph_modules == ([CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess] if moe else [])
    layer_types = getattr(getattr(hf_config, "text_config", hf_config), "layer_types", None) or ()
    gated_delta = "linear_attention" in layer_types
    notes = {
        (True, False): " (each MoE layer's attention, router and combine; its experts eager)",
        (
            True,
            True,
        ): " (each MoE layer's router and combine, and its full attention; Gated DeltaNet and experts eager)",
        (False, True): " (a Gated DeltaNet layer's MLP alone; its Gated DeltaNet eager)",
        (False, False): "",
    }
    note = notes[moe, gated_delta]
    if moe:
        from qvl.kernels.local_specs import GraphedAttentionMoELayer, local_gpt_layer_spec

        assert local_gpt_layer_spec(provider).module is GraphedAttentionMoELayer
    assert said == [f"speed-cuda-graphs: the language model's layers replay as CUDA graphs from step 2{note}"]
    if gated_delta:
        from qvl.bridges import qwen3_5_vl

        attention = qwen3_5_vl._attention_layer(provider, None)
        assert attention.module is not GraphedMLPLayer
        assert (qwen3_5_vl._gated_delta_layer(attention).module is GraphedMLPLayer) is not moe


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"pipeline_model_parallel_size": 2}, "pipeline parallelism"),
        ({"overlap_grad_reduce": True}, "with ddp.overlap_grad_reduce"),
        ({"vision_balance": True}, "vision_balance"),
        ({"num_moe_experts": 8, "recompute_granularity": "full"}, None),  # the layers' reasons are not the tower's
        ({"family": "qwen3_vl", "recompute_granularity": "selective"}, "recompute=selective keeps Megatron-Bridge's"),
        ({"family": "qwen3_5_vl", "recompute_granularity": "full"}, "recompute=full keeps Megatron-Bridge's"),
        ({"family": "qwen2_5_vl", "recompute_granularity": "full"}, None),  # the HF tower recomputes on its own terms
    ],
)
def test_the_tower_stays_eager_where_its_calls_cannot_take_their_graphs_one_at_a_time(change, reason):
    """A pipeline stage runs several micro-batches' forwards before their backwards (a bucket's graphs take one at a
    time), DDP's overlap needs the parameters' gradient hooks, balanced vision work is encoded eagerly, and Megatron-
    Bridge's tower recomputes with the language model, whose checkpointed blocks refuse the capture's warm-up."""
    model = types.SimpleNamespace(pipeline_model_parallel_size=change.pop("pipeline_model_parallel_size", 1))
    if "family" in change:  # the vision config's class names the family (its record says whose tower it is)
        model.vision_config = type(get_family(change.pop("family")).vision_config_class, (), {})()
    cfg = types.SimpleNamespace(
        model=model,
        ddp=types.SimpleNamespace(overlap_grad_reduce=change.pop("overlap_grad_reduce", False)),
        qvl=types.SimpleNamespace(vision_balance=change.pop("vision_balance", False)),
    )
    vars(model).update(change)
    got = speed_cuda_graphs.eager_tower(cfg)
    assert got == reason if reason is None else got.startswith(reason)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"recompute_granularity": "full"}, "full activation recompute"),
        ({"recompute_granularity": "selective"}, None),
        ({"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}, None),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm"]},
            "selective recompute of layernorm",
        ),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["moe", "moe_act"]},
            "selective recompute of moe, moe_act",
        ),
        ({"peft": object()}, None),  # the first layer's input is made to need a gradient: `graphable_input`
        ({"freeze_language_model": True}, None),
    ],
)
def test_runs_megatron_core_cannot_capture_keep_their_layers_eager(change, reason):
    """Found by training with the CPU's recorded graphs: under full recompute (and selective recompute of a MoE layer)
    creating the graphs asserts, and a recomputed norm trains other losses graphed than eagerly. Selective recompute of
    attention and MLPs and a frozen language model (adapters) train graphed."""
    model = types.SimpleNamespace(pipeline_model_parallel_size=1, num_moe_experts=None, recompute_granularity=None)
    cfg = types.SimpleNamespace(model=model, peft=change.pop("peft", None))
    vars(model).update(change)
    got = speed_cuda_graphs.eager_layers(cfg)
    assert got == reason if reason is None else got.startswith(reason)


def test_a_frozen_language_models_input_needs_a_gradient_only_where_graphs_capture_it():
    """Megatron-Core 0.19.2's capture warms each graph up with the gradient of its inputs: a frozen language model's
    input (adapters, freeze=language) is made to need one where the layers are graphed; elsewhere it is left as is."""
    graphed = types.SimpleNamespace(**speed_cuda_graphs.layer_graph_settings())
    eager = types.SimpleNamespace(cuda_graph_impl="none")
    frozen, trained = torch.ones(3, 1, 2), torch.ones(3, 1, 2, requires_grad=True) * 2
    got = speed_cuda_graphs.graphable_input(graphed, frozen)
    assert got.requires_grad and got.is_leaf and torch.equal(got, frozen)
    assert speed_cuda_graphs.graphable_input(graphed, trained) is trained  # its gradient flows back as it did
    assert speed_cuda_graphs.graphable_input(eager, frozen) is frozen
    with torch.no_grad():  # evaluation: nothing to capture a backward for
        assert speed_cuda_graphs.graphable_input(graphed, frozen) is frozen


def test_a_graphed_runs_saved_config_loads_without_its_graphs():
    """An export or check builds the model from the run's saved config, which carries the graphs it trained with
    (Megatron-Core then refuses the pair of settings it was saved with): loads reset them (qvl.bridges.convert,
    qvl.bridges.trained)."""
    from qvl.bridges import trained

    settings = speed_cuda_graphs.eager_settings()
    assert settings["cuda_graph_impl"] == "none" and not settings["cuda_graph_modules"]
    assert set(settings) <= set(speed_cuda_graphs.layer_graph_settings())  # each graph setting the run set, undone
    assert all(trained._LOAD_SETTINGS[name] == value for name, value in settings.items())


def test_megatron_bridge_builds_the_layer_graphs_qvl_asks_for_and_checks_the_rest():
    """Megatron-Bridge 0.6.2 refuses `cuda_graph_impl="local"` but for full-iteration graphs; the per-layer graphs
    this group sets (whole layers; a MoE layer's router and combine: Megatron-Core's schedules capture and replay
    them) pass, anything else meets upstream's check."""
    megatron.import_megatron_bridge()
    from megatron.bridge.models import gpt_provider

    qvl = types.SimpleNamespace(**speed_cuda_graphs.layer_graph_settings(), **{speed_cuda_graphs.TOWER_GRAPHS: True})
    moe = types.SimpleNamespace(num_moe_experts=4, moe_layer_freq=1, num_layers=2)
    qvl_moe = types.SimpleNamespace(**vars(moe), **speed_cuda_graphs.layer_graph_settings(moe),
                                    **{speed_cuda_graphs.TOWER_GRAPHS: True})  # fmt: skip
    scoped = types.SimpleNamespace(**vars(qvl) | {"cuda_graph_modules": ["attn"]})
    moe_scoped = types.SimpleNamespace(**vars(qvl_moe) | {"cuda_graph_modules": []})  # a MoE layer captured whole
    unmarked = types.SimpleNamespace(**speed_cuda_graphs.layer_graph_settings())
    for config in (qvl, qvl_moe, scoped, moe_scoped, unmarked):
        with pytest.raises(ValueError, match="only for full-iteration"):
            gpt_provider.validate_cuda_graph_configuration(config)
    with patches.applied(speed_cuda_graphs.GROUP):
        gpt_provider.validate_cuda_graph_configuration(qvl)
        gpt_provider.validate_cuda_graph_configuration(qvl_moe)
        for config in (scoped, moe_scoped, unmarked):
            with pytest.raises(ValueError, match="only for full-iteration"):
                gpt_provider.validate_cuda_graph_configuration(config)
    assert qvl.use_te_rng_tracker  # the provider asserts it for any graphs; without TE Megatron-Core's tracker serves


def test_graph_buffers_keep_the_whole_pack_type():
    megatron.import_megatron_bridge()
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import cuda_graphs

    cu = mark_whole_pack(torch.tensor([0, 5, 8], dtype=torch.int32))
    with pytest.raises(AssertionError, match="not supported"):  # upstream refuses the subclass
        cuda_graphs._check_supported_type(cuda_graphs.ArgMetadata(cu))
    with patches.applied(speed_cuda_graphs.GROUP):
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
        metas = cuda_graphs.tree_map(lambda a: cuda_graphs.ArgMetadata(a) if torch.is_tensor(a) else a, params)
        for meta in (metas.cu_seqlens_q, metas.cu_seqlens_kv):
            cuda_graphs._check_supported_type(meta)
        buffers = cuda_graphs.tree_map(lambda m: m.zeros_like() if isinstance(m, cuda_graphs.ArgMetadata) else m, metas)
        hidden = cuda_graphs.ArgMetadata(torch.ones(8, 1, 4))
    assert type(buffers.cu_seqlens_q) is WholePackCuSeqlens and buffers.cu_seqlens_q.shape == (3,)
    assert buffers.cu_seqlens_q.dtype == torch.int32 and buffers.max_seqlen_q == 8
    assert hidden.type is torch.Tensor and type(hidden.zeros_like()) is torch.Tensor  # other tensors as upstream's
    assert cuda_graphs.ArgMetadata.__name__ == "ArgMetadata" and not patches.is_applied(speed_cuda_graphs.GROUP)


def test_a_pack_at_the_graphs_fixed_shapes_trains_as_it_does_eagerly(tmp_path, cpu_runtime):
    """The inputs the graphs capture (the pack padded to seq_length, cu_seqlens of a fixed size, one max_seqlen)
    give the eager forward's per-token losses on the pack's tokens and its gradients (fp32)."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.training.step import host_batch, model_inputs

    family = "qwen2_5_vl"
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", family)
    distributed.init_distributed()
    try:
        model, hf_config = tiny_megatron_model(family, hf=hf, speed=False)
        batch = _batch(family, hf_config, math.prod(model.visual.patch_embed.proj.weight.shape[1:]))
        tokens, subs = batch.tokens.shape[1], batch.cu_seqlens_q.shape[0] - 1
        shapes = GraphShapes(tokens=tokens + 13, slots=subs + 4, max_seqlen=tokens + 13)
        cpu = torch.device("cpu")
        results = []
        with patches.applied(speed_rotary.GROUP, speed_sync_free.GROUP):  # the whole-pack rotary, as on a GPU
            for graph_shapes in (None, shapes):
                kwargs, _ = model_inputs(batch, cpu, graph_shapes=graph_shapes)
                results.append(_loss_and_grads(model, {**kwargs, "host_batch": host_batch(model, batch, kwargs, cpu)}))
                params = kwargs["packed_seq_params"]
        assert params.cu_seqlens_q.shape == (subs + 5,) and isinstance(params.cu_seqlens_q, WholePackCuSeqlens)
        assert params.max_seqlen_q == tokens + 13 and kwargs["input_ids"].shape == (1, tokens + 13)
        (eager_losses, eager_grads), (fixed_losses, fixed_grads) = results
        torch.testing.assert_close(fixed_losses[:, :tokens], eager_losses, rtol=1e-5, atol=1e-6)
        assert fixed_grads.keys() == eager_grads.keys()
        for name, grad in eager_grads.items():
            torch.testing.assert_close(fixed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        distributed.destroy_distributed()


def _tiny_run(tmp_path, family: str, recipe: str, steps: int, *extra: str) -> list[str]:
    """A tiny `family` checkpoint and the sample set prepared for it in `tmp_path`; the `qvl train` arguments of
    `recipe` over them on the CPU for `steps` steps of two micro-batches."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.samples import write_sample_dataset
    from tests.run_qvl import qvl_in_process

    jsonl, media = write_sample_dataset(tmp_path / "samples")
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", family)
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", family, "--hf-path", str(hf)]
    qvl_in_process("data", "prepare", *prepare, "--seq-length", "256", "--output", str(tmp_path / "data"))
    return [recipe, f"train_iters={steps}", "global_batch_size=2", "micro_batch_size=1", "seq_length=256",
            "warmup_iters=1", "lr=1e-3", "save_interval=100", "log_interval=1", f"data={tmp_path / 'data'}",
            f"hf_path={hf}", *extra, "--model", "tiny", "--device", "cpu"]  # fmt: skip


LAYERS_GRAPHED = "the language model's layers replay as CUDA graphs from step 2"
TOWER_ALONE = "the vision tower alone replays as CUDA graphs"


def _eager_and_graphed(
    tmp_path, args: list[str], steps: int, train=None, after_eager=None, said=LAYERS_GRAPHED, rel: float = 1e-5
):
    """`qvl train ARGS` eagerly, then (`after_eager()` called between) with `cuda_graphs=true` (`train`: how, default
    in this process): the graphed run says what it graphs (`said`) and gives the eager run's losses (to `rel`)."""
    from qvl.training.loop import read_losses
    from tests.run_qvl import qvl_in_process

    train = train or qvl_in_process
    train("train", *args, "--run-dir", str(tmp_path / "eager"))
    if after_eager is not None:
        after_eager()
    out = train("train", *args, "cuda_graphs=true", "--run-dir", str(tmp_path / "graphed"))
    assert said in out
    eager, graphed = read_losses(tmp_path / "eager"), read_losses(tmp_path / "graphed")
    assert sorted(graphed) == list(range(1, steps + 1))
    for step, loss in eager.items():
        assert graphed[step] == pytest.approx(loss, rel=rel), step


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_run_with_cuda_graphs_trains_on_the_cpu_as_it_does_eagerly(family, tmp_path, monkeypatch):
    """`qvl train ... cuda_graphs=true --device cpu`: Megatron-Core's per-layer graphs and qvl's vision tower graphs
    (HF tower; Megatron-Bridge's Qwen3-VL tower) are captured after the first step and replayed as recorded
    (cpu-cuda-graphs). Every micro-batch after the capture replays them, and the losses are the eager run's. Before
    this ran, every such run failed on a GPU too: at the model's build (Megatron-Bridge's checks), at the first
    capture (the whole-pack bounds lost their type) and, for Qwen3-VL, at the first deepstack add after a graph."""
    from qvl.foundation.graph_replay import RecordedGraph
    from tests.run_qvl import qvl_in_process

    recipe = {"qwen2_5_vl": "qwen2_5_vl_3b_pretrain", "qwen3_vl": "qwen3_vl_2b_pretrain"}[family]
    args = _tiny_run(tmp_path, family, recipe, 4)
    replays, captures = [], []
    replay, capture_end = RecordedGraph.replay, RecordedGraph.capture_end
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: replays.append(len(self.ops)) or replay(self))
    monkeypatch.setattr(RecordedGraph, "capture_end", lambda self: capture_end(self) or captures.append(self))

    def nothing_captured() -> None:
        assert not captures

    _eager_and_graphed(tmp_path, args, 4, after_eager=nothing_captured)
    layers = len(captures) - 2  # each layer's forward and backward, and the tower's bucket (one size)
    assert layers >= 4 and layers % 2 == 0
    # the layers' graphs at the 6 micro-batches of steps 2 to 4; the tower's also at the call that captured them
    assert len(replays) == 6 * layers + 7 * 2
    # the graphed run's checkpoint exports (its saved config carries the graphs, which a load must not build)
    hf = str(tmp_path / "hf")
    exported = qvl_in_process("convert", "export", str(tmp_path / "graphed"), str(tmp_path / "hf-out"), "--hf", hf,
                              "--device", "cpu")  # fmt: skip
    assert "checked against the trained model" in exported and exported.rstrip().endswith("OK")


@pytest.mark.slow
def test_a_model_whose_layers_stay_eager_trains_with_its_vision_tower_graphed(tmp_path, monkeypatch):
    """Where the language model's layers cannot be captured (full recompute), `cuda_graphs=true` still replays the
    vision tower as graphs (recorded on the CPU; the HF tower with its windows): one bucket size's forward and backward
    captured at its second call and replayed at every later one, no layer captured, no pack padded, and the losses are
    the eager run's."""
    from qvl.foundation.graph_replay import RecordedGraph

    args = _tiny_run(tmp_path, "qwen2_5_vl", "qwen2_5_vl_3b_pretrain", 4, "recompute=full")
    replays, captures = [], []
    replay, capture_end = RecordedGraph.replay, RecordedGraph.capture_end
    monkeypatch.setattr(RecordedGraph, "replay", lambda self: replays.append(len(self.ops)) or replay(self))
    monkeypatch.setattr(RecordedGraph, "capture_end", lambda self: capture_end(self) or captures.append(self))
    _eager_and_graphed(tmp_path, args, 4, said=TOWER_ALONE)
    assert len(captures) == 2  # the tower's bucket: its forward and its backward, no layer's
    assert len(replays) == 7 * 2  # the call that captured them and the 6 after it
    assert all(replays)


@pytest.mark.slow
def test_lora_with_cuda_graphs_trains_on_the_cpu_as_it_does_eagerly(tmp_path):
    """Qwen3-VL LoRA from a converted checkpoint: the frozen language model's input is made to need a gradient for the
    graphs' warm-up (`graphable_input`), the checkpoint loads (Megatron-Bridge's Qwen3-VL model registered its decoder
    twice where graphs are on), the losses are the eager run's and the adapters export as a peft adapter."""
    from tests.run_qvl import qvl_in_process

    megatron_dir, hf = str(tmp_path / "megatron"), str(tmp_path / "hf")
    args = _tiny_run(tmp_path, "qwen3_vl", "qwen3_vl_2b_peft", 3, f"pretrained_checkpoint={megatron_dir}")
    qvl_in_process("convert", "import", hf, megatron_dir, "--dtype", "fp32", "--device", "cpu")
    _eager_and_graphed(tmp_path, args, 3)
    exported = qvl_in_process("convert", "export-adapter", str(tmp_path / "graphed"), hf, str(tmp_path / "lora"),
                              "--device", "cpu")  # fmt: skip
    assert exported.rstrip().endswith("OK (tolerance 1e-05)")


@pytest.mark.slow
def test_a_run_with_cuda_graphs_at_tensor_parallel_2_trains_as_it_does_eagerly(tmp_path):
    """Qwen3-VL at TP=2 (sequence parallelism on, as every recipe turns it on with TP), two gloo ranks: the layers'
    graphs hold the sequence-parallel all-gathers and reduce-scatters, and the deepstack features are added at each
    rank's boolean mask into a graphed layer's output; the losses are the eager run's."""
    from tests.run_qvl import qvl_on_two_ranks

    args = _tiny_run(tmp_path, "qwen3_vl", "qwen3_vl_2b_pretrain", 3, "tensor_parallel=2")
    _eager_and_graphed(tmp_path, args, 3, train=qvl_on_two_ranks)
