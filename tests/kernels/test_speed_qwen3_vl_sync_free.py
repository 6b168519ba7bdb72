"""qvl's Qwen3-VL forward with its vision layout computed on the host (qvl.bridges.qwen3_vl.Qwen3VLModel, its body
qvl.kernels.speed_qwen3_vl_sync_free): losses and every gradient bitwise upstream's in fp32, no host read of a tensor
in the forward or backward of qvl's step (images, videos, and both in token order, with the tower's precomputed
inputs put in that order), upstream's path where the forward is given no layout."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import traceback
import types

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.bridges.tiny_model import tiny_hf_config
from qvl.foundation import patches
from qvl.foundation.families import TINY_TOKEN_IDS
from qvl.foundation.graph_replay import VALUE_SIZED_OPS
from qvl.kernels import speed_qwen3_vl_sync_free, speed_qwen3_vl_tower, speed_rotary, vision_placement
from qvl.kernels.tower_inputs import tower_inputs_for_config
from qvl.kernels.vision_placement import VisionPlacement
from tests.kernels.test_speed_sync_free import (
    IMAGE_GRIDS,
    TEXT,
    VIDEO_GRID,
    _batch,
    _loader_positions,
    _packed_params,
    _video,
    _vision,
)
from tests.tiny_megatron import tiny_megatron_model

FAMILY = "qwen3_vl"
MODALITIES = {  # the pixel fields a micro-batch keeps
    "images": ("pixel_values", "image_grid_thw"),
    "videos": ("pixel_values_videos", "video_grid_thw"),
    "both": ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"),  # images, then the video
    "interleaved": ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"),  # image, video, image
}
_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")
# As benchmarks/step_census.py: tensor methods that read a value on the host, and ops whose output size is a value.
_READ_METHODS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})


def _bool_indexing(name: str, args) -> bool:
    """An aten index op with a boolean mask: on a GPU it reads the mask's count to the host (`x[mask] = scalar` runs
    as masked_fill_ and reads nothing: not counted, as in benchmarks/step_census.py)."""
    if name not in _INDEX_OPS or len(args) < 2 or ("index_put" in name and args[2].numel() == 1):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


class BoolIndexing(TorchDispatchMode):
    """Counts the aten ops that index with a boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += _bool_indexing(func.overloadpacket.__name__, args)
        return func(*args, **(kwargs or {}))


class HostReads:
    """The host reads of tensors while `active` (all of them device tensors in a training step), by call site: the
    read methods, value-sized ops and boolean indexing. Two CPU-only reads are left out: Megatron's check of the CPU
    RNG state around its RNG tracker's forks (a host tensor on any machine), and qvl's SDPA loop reading the block
    offsets (`_segments` in kernels/varlen_attention.py: on CUDA the varlen kernel takes them and reads nothing)."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self.active = False

    def record(self, what: str) -> None:
        if not self.active:
            return
        frame = next(f for f in reversed(traceback.extract_stack()[:-2]) if "/torch/" not in f.filename)
        host_side = frame.filename.endswith("megatron/core/tensor_parallel/random.py") or (
            frame.filename.endswith("kernels/varlen_attention.py") and frame.name == "_segments"
        )
        if not host_side:
            self.sites[f"{what} at {frame.filename.rsplit('/', 3)[-1]}:{frame.lineno}"] += 1

    @contextlib.contextmanager
    def counting(self):
        reads = self

        class Methods(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in _READ_METHODS and args and isinstance(args[0], torch.Tensor):
                    reads.record(f".{name.strip('_')}()")
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in VALUE_SIZED_OPS or _bool_indexing(name, args):
                    reads.record(name)
                return func(*args, **(kwargs or {}))

        with Methods(), Ops():
            yield self


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen3-VL family record's Megatron model (one deepstack layer), built by qvl's provider in fp32."""
    from qvl.foundation import distributed, runtime

    runtime.activate(force=True)
    distributed.init_distributed()
    try:
        # no DDP wrapper here, so no main_grad to accumulate into
        built, _ = tiny_megatron_model(FAMILY, gradient_accumulation_fusion=False)
        assert built.vision_transformer_config.deepstack_visual_indexes  # the deepstack path is exercised
        with torch.no_grad():  # norms at 1 and biases at 0 would hide a mix-up: perturb them
            for param in built.parameters():
                param.add_(0.05 * torch.randn_like(param))
        yield built
    finally:
        distributed.destroy_distributed()
        runtime.deactivate()


def _interleaved_subs() -> tuple[list[np.ndarray], list[dict]]:
    """Sub-sequences whose vision items alternate: an image; a video, then another image in the same sub-sequence."""
    image = TINY_TOKEN_IDS["image_token_id"]
    text = lambda n: [TEXT + k for k in range(n)]  # noqa: E731
    subs = [
        (
            text(3) + _vision(image, IMAGE_GRIDS[0]) + text(2),
            {"image_grid_thw": [IMAGE_GRIDS[0]], "video_grid_thw": []},
        ),
        (
            text(2) + _video(FAMILY) + text(3) + _vision(image, IMAGE_GRIDS[1]) + text(4),
            {"image_grid_thw": [IMAGE_GRIDS[1]], "video_grid_thw": [VIDEO_GRID]},
        ),
    ]
    return [np.array(ids) for ids, _ in subs], [media for _, media in subs]


def _interleaved_batch(patch_dim: int) -> types.SimpleNamespace:
    """A loader-like PackedBatch of `_interleaved_subs` (as tests/kernels/test_speed_sync_free.py's `_batch`)."""
    from qvl.data.count import IGNORE_INDEX

    sub_ids, sub_media = _interleaved_subs()
    tokens = torch.from_numpy(np.concatenate(sub_ids))[None]
    image_grid = torch.tensor([g for m in sub_media for g in m["image_grid_thw"]], dtype=torch.long)
    video_grid = torch.tensor([g for m in sub_media for g in m["video_grid_thw"]], dtype=torch.long)
    cu = _packed_params(sub_ids).cu_seqlens_q
    generator = torch.Generator().manual_seed(1)
    return types.SimpleNamespace(
        tokens=tokens,
        labels=torch.cat([tokens[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1),
        loss_mask=torch.ones(tokens.shape, dtype=torch.float32),
        position_ids=_loader_positions(FAMILY, sub_ids, sub_media, tiny_hf_config(FAMILY)),
        cu_seqlens_q=cu,
        max_seqlen=int(torch.diff(cu).max()),
        pixel_values=torch.randn(int(image_grid.prod(-1).sum()), patch_dim, generator=generator),
        image_grid_thw=image_grid,
        pixel_values_videos=torch.randn(int(video_grid.prod(-1).sum()), patch_dim, generator=generator),
        video_grid_thw=video_grid,
    )


def pack(model, modality: str) -> types.SimpleNamespace:
    """A loader-like micro-batch with the pixels of `modality` (the tokens keep every placeholder) and, as qvl's
    loader computes them, the tower's inputs of each kind."""
    patch_dim = math.prod(model.vision_model.patch_embed.proj.weight.shape[1:])
    if modality == "interleaved":
        batch = _interleaved_batch(patch_dim)
    else:
        batch = _batch(FAMILY, tiny_hf_config(FAMILY), patch_dim)
    batch.second_per_grid_ts = torch.zeros(0)  # Qwen2.5-VL's; Qwen3-VL's loader leaves it empty
    vision_config = tiny_hf_config(FAMILY).vision_config
    for pixels, grid, inputs in (
        ("pixel_values", "image_grid_thw", "image_tower_inputs"),
        ("pixel_values_videos", "video_grid_thw", "video_tower_inputs"),
    ):
        if pixels not in MODALITIES[modality]:
            setattr(batch, pixels, None)
            setattr(batch, grid, torch.zeros(0, 3, dtype=torch.long))
        grid_thw = getattr(batch, grid)
        setattr(batch, inputs, tower_inputs_for_config(grid_thw, vision_config) if grid_thw.numel() else None)
    return batch


def inputs_of(batch) -> dict:
    from qvl.training.step import model_inputs

    return model_inputs(batch, torch.device("cpu"))[0]


def with_host_batch(model, batch, kwargs, placement: VisionPlacement | None = None) -> dict:
    """`kwargs` and the host batch qvl's forward step passes with them (its vision layout replaced by `layout`)."""
    from qvl.training.step import host_batch

    host = host_batch(model, batch, kwargs, torch.device("cpu"))
    assert host.vision_placement is not None and host.vision_placement.positions.dtype == torch.int64
    return {
        **kwargs,
        "host_batch": host if placement is None else dataclasses.replace(host, vision_placement=placement),
    }


def loss_and_grads(model, kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """The per-token losses, every parameter's gradient and the boolean-mask indexing ops of forward and backward."""
    model.zero_grad(set_to_none=True)
    with BoolIndexing() as indexing:
        losses = model(**kwargs)
        (losses * kwargs["loss_mask"]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, indexing.count


def step_loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], HostReads]:
    """The losses and gradients of qvl's forward step on `batch` (with the step's patch groups), and the host reads
    of the model's forward and of the backward (the step's host-side work before the forward is not counted)."""
    from qvl.training.step import forward_step

    config = types.SimpleNamespace(
        model=types.SimpleNamespace(pipeline_model_parallel_size=1, seq_length=batch.tokens.shape[1]),
        # the output layer at every position, as upstream's forward runs it (its rows-only path: test_loss_rows.py)
        qvl=types.SimpleNamespace(vision_balance=False, loss_rows_only=False),
        rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=False, check_for_spiky_loss=False),
    )
    reads = HostReads()
    hooks = [
        model.register_forward_pre_hook(lambda *_: setattr(reads, "active", True)),
        model.register_forward_hook(lambda *_: setattr(reads, "active", False)),
    ]
    model.zero_grad(set_to_none=True)
    try:
        with patches.applied(speed_rotary.GROUP), reads.counting():
            losses, loss_function = forward_step(types.SimpleNamespace(cfg=config), iter([batch]), model)
            reads.active = True
            (losses * loss_function.args[0]).sum().backward()  # the step's loss mask
            reads.active = False
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, reads


def reorganized(model, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's `reorganize_inputs`: the pixels and the grid in token order."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import reorganize_inputs

    pixels, grid, _ = reorganize_inputs(
        input_ids=kwargs["input_ids"],
        pixel_values=kwargs["pixel_values"],
        pixel_values_videos=kwargs["pixel_values_videos"],
        image_grid_thw=kwargs["image_grid_thw"],
        video_grid_thw=kwargs["video_grid_thw"],
        image_token_id=model.image_token_id,
        video_token_id=model.video_token_id,
        square_merge_size=model.square_merge_size,
    )
    return pixels, grid


def same_tower_inputs(got, expected) -> bool:
    """Whether two MegatronTowerInputs hold equal values (tensors bitwise, dtypes included)."""
    values = [(getattr(got, f.name), getattr(expected, f.name)) for f in dataclasses.fields(expected)]
    return all(torch.equal(a, b) and a.dtype == b.dtype if isinstance(b, torch.Tensor) else a == b for a, b in values)


@pytest.mark.parametrize("modality", list(MODALITIES))
def test_the_steps_forward_is_upstreams_bit_for_bit_without_host_reads(model, modality, monkeypatch):
    """qvl's forward step against upstream's forward (boolean masks, `reorganize_inputs`, the tower computing its
    own inputs): the same losses and gradients, and not one host read of a tensor in the forward or backward; a pack
    with both kinds hands the tower its grid in token order, with the loader's inputs put in that order."""
    batch = pack(model, modality)
    losses, grads, masked_ops = loss_and_grads(model, inputs_of(batch))
    towers = []
    prepared = speed_qwen3_vl_tower.prepared_tower_forward
    monkeypatch.setattr(
        speed_qwen3_vl_tower, "prepared_tower_forward", lambda *a: towers.append(a[2]) or prepared(*a)
    )  # the tower-inputs path, looked up by qvl's tower forward at each call
    got, got_grads, reads = step_loss_and_grads(model, batch)

    assert masked_ops > 0 and dict(reads.sites) == {}
    assert torch.equal(got, losses)
    assert got_grads.keys() == grads.keys()
    assert any(".deepstack_merger_list." in name for name in grads)  # the deepstack features reached the loss
    assert [name for name in grads if not torch.equal(got_grads[name], grads[name])] == []
    (given,) = towers
    if modality in ("both", "interleaved"):  # upstream's token-order grid, and the tower's inputs for it
        _, grid = reorganized(model, inputs_of(batch))
        expected = tower_inputs_for_config(grid, tiny_hf_config(FAMILY).vision_config)
        assert given.grids == tuple(map(tuple, grid.tolist()))
    else:
        expected = getattr(batch, "image_tower_inputs" if modality == "images" else "video_tower_inputs")
    assert same_tower_inputs(given, expected)


def test_upstreams_forward_reads_the_host_where_the_step_does_not(model):
    """The counter itself: upstream's forward on a pack of images and videos reads its grids and tokens back."""
    kwargs = inputs_of(pack(model, "interleaved"))
    reads = HostReads()
    reads.active = True
    with reads.counting():
        model(**kwargs).sum().backward()
    sites = " ".join(reads.sites)
    assert "utils.py" in sites and "nonzero" in sites and ".tolist()" in sites  # reorganize_inputs' reads


def test_vision_order_is_reorganize_inputs(model):
    """The host order gives upstream's pixels (here each row's own index) and grid, dtype included."""
    batch = pack(model, "interleaved")
    kwargs = inputs_of(batch)
    rows = lambda n, first: torch.arange(first, first + n, dtype=torch.float32)[:, None]  # noqa: E731
    images, videos = kwargs["pixel_values"].shape[0], kwargs["pixel_values_videos"].shape[0]
    kwargs.update(pixel_values=rows(images, 0), pixel_values_videos=rows(videos, images))
    pixels, grid = reorganized(model, kwargs)

    order = vision_placement.vision_order(
        batch.tokens,
        batch.image_grid_thw,
        batch.video_grid_thw,
        image_token_id=model.image_token_id,
        video_token_id=model.video_token_id,
        square_merge_size=model.square_merge_size,
    )
    assert [kind for kind, *_ in order.pixel_rows] == [
        vision_placement.IMAGES,
        vision_placement.VIDEOS,
        vision_placement.IMAGES,
    ]
    assert order.grid_thw.dtype == grid.dtype and torch.equal(order.grid_thw, grid)
    assert order.pixel_counts == (images, videos)
    assert torch.equal(
        speed_qwen3_vl_sync_free._pixels_in_token_order(kwargs["pixel_values"], kwargs["pixel_values_videos"], order),
        pixels,
    )
    with pytest.raises(vision_placement.VisionPositionsMismatch, match="video pixel rows"):
        speed_qwen3_vl_sync_free._pixels_in_token_order(
            kwargs["pixel_values"], kwargs["pixel_values_videos"][1:], order
        )


@pytest.mark.parametrize("grids", ["image_grid_thw", "video_grid_thw"])
def test_placeholders_that_do_not_fit_the_grids_are_refused(model, grids):
    batch = pack(model, "interleaved")
    setattr(batch, grids, getattr(batch, grids)[:-1])  # one grid fewer than the placeholders say
    with pytest.raises(vision_placement.VisionPositionsMismatch, match="do not fit"):
        vision_placement.host_vision_placement(model, batch, inputs_of(batch))


def test_a_placement_without_order_leaves_the_reordering_to_upstream(model):
    """Given positions without a host order: `reorganize_inputs` orders the pixels (its two boolean masks), the
    language model still takes the indices: the same results."""
    batch = pack(model, "interleaved")
    kwargs = inputs_of(batch)
    losses, grads, _ = loss_and_grads(model, kwargs)
    placement = vision_placement.host_vision_placement(model, batch, kwargs)
    given = with_host_batch(model, batch, kwargs, VisionPlacement(positions=placement.positions))
    got, got_grads, indexed_ops = loss_and_grads(model, given)
    assert indexed_ops == 2  # the two boolean selections of upstream's scan of the tokens (find_vision_id_index)
    assert torch.equal(got, losses)
    assert all(torch.equal(got_grads[name], grads[name]) for name in grads)


def test_indexed_forward_under_full_recompute(model, monkeypatch):
    """Activation recompute hands the positions to the checkpointed layers: still the masked results."""
    from megatron.core import tensor_parallel

    checkpointed = []
    checkpoint = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *a: checkpointed.append(a[3:]) or checkpoint(*a))
    config = model.language_model.decoder.config
    saved = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    try:
        batch = pack(model, "images")
        kwargs = inputs_of(batch)
        losses, grads, _ = loss_and_grads(model, kwargs)
        given = with_host_batch(model, batch, kwargs)
        positions = given["host_batch"].vision_placement.positions
        got, got_grads, indexed_ops = loss_and_grads(model, given)
    finally:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = saved
    assert indexed_ops == 0
    layers = model.language_model.decoder.num_layers_per_pipeline_rank
    assert len(checkpointed) == 2 * layers  # every layer, masked then indexed (its positions among the arguments)
    assert all(any(a is positions for a in args) for args in checkpointed[layers:])
    assert torch.equal(got, losses)
    assert all(torch.equal(got_grads[name], grads[name]) for name in grads)


def test_without_a_placement_upstreams_path_runs(model):
    """A layout is computed only for a model whose forward takes one (qvl's), and used only where the forward is
    given one: without a host batch, or with one without a placement, upstream's masked path runs."""
    batch = pack(model, "interleaved")
    kwargs = inputs_of(batch)
    assert vision_placement.host_vision_placement(types.SimpleNamespace(pre_process=True), batch, kwargs) is None
    expected = loss_and_grads(model, kwargs)
    given = with_host_batch(model, batch, kwargs)
    without_layout = {**given, "host_batch": dataclasses.replace(given["host_batch"], vision_placement=None)}
    got = loss_and_grads(model, without_layout)
    assert got[2] == expected[2] > 0  # upstream's masked indexing ran
    assert torch.equal(got[0], expected[0])


def test_positions_that_do_not_fit_the_features_are_refused(model):
    batch = pack(model, "images")
    kwargs = inputs_of(batch)
    positions = vision_placement.host_vision_placement(model, batch, kwargs).positions
    given = with_host_batch(model, batch, kwargs, VisionPlacement(positions=positions[1:]))
    with pytest.raises(vision_placement.VisionPositionsMismatch, match=f"for {positions.numel() - 1} vision"):
        model(**given)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_indexed_deepstack_is_the_masked_one_bit_for_bit(model, batch_size):
    """The deepstack addition alone, qvl's decoder at flat [b*s] indices or a boolean mask vs upstream's boolean
    mask: values and gradients; and out of place, so that it takes a CUDA-graphed layer's output (a custom
    Function's, which upstream's in-place write is refused)."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_block import Qwen3VLTransformerBlock

    decoder = model.language_model.decoder
    assert isinstance(decoder, Qwen3VLTransformerBlock) and type(decoder) is not Qwen3VLTransformerBlock  # qvl's
    upstream = functools.partial(Qwen3VLTransformerBlock._deepstack_process, decoder)
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(batch_size, 12, generator=generator) < 0.4  # [b, s]
    hidden = torch.randn(12, batch_size, 8, generator=generator)  # [s, b, h]
    embeds = torch.randn(int(mask.sum()), 8, generator=generator)
    weights = torch.randn(12, batch_size, 8, generator=generator)

    def run(function, where):
        h, e = hidden.clone().requires_grad_(), embeds.clone().requires_grad_()
        out = function(h * 1, where, e)  # a non-leaf, as a layer's output is
        (out * weights).sum().backward()
        return out.detach(), h.grad, e.grad

    expected = run(upstream, mask)
    got = run(decoder._deepstack_process, mask.reshape(-1).nonzero().flatten())
    assert all(map(torch.equal, got, expected))
    assert not torch.equal(expected[0], hidden)  # the features were added
    assert all(map(torch.equal, run(decoder._deepstack_process, mask), expected))  # a boolean mask: upstream's

    class LayerGraph(torch.autograd.Function):  # returns its input as it is, as a graph replay returns its buffer
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    graphed = lambda where: lambda h, w, e: decoder._deepstack_process(LayerGraph.apply(h), w, e)  # noqa: E731
    for where in (mask, mask.reshape(-1).nonzero().flatten()):
        assert all(map(torch.equal, run(graphed(where), where), expected))
    if batch_size == 1:  # upstream's write into the view of the function's output
        with pytest.raises(RuntimeError, match="view and is being modified inplace"):
            run(lambda h, w, e: upstream(LayerGraph.apply(h), w, e), mask)


@pytest.mark.parametrize("modality", ["both", "videos"])
def test_a_pack_trains_with_its_tower_graphed_as_it_does_eagerly(model, modality, monkeypatch):
    """qvl's Qwen3-VL forward hands its tower call to the tower's graphs (qvl.kernels.tower_graphs, re-run on the
    CPU): over three micro-batches (warm-up, capture, replay) the losses are the eager ones, and the tower's
    `main_grad`s sum the eager gradients, deepstack mergers included (fp32)."""
    from qvl.kernels import speed_qwen3_vl_sync_free
    from qvl.kernels.tower_graphs import MegatronTowerGraphs
    from tests.kernels.test_megatron_tower_graphs import _megatron_ddp_like

    batch = pack(model, modality)
    kwargs = with_host_batch(model, batch, inputs_of(batch))
    eager_losses, eager_grads, _ = loss_and_grads(model, kwargs)
    tower = model.vision_model
    with _megatron_ddp_like(tower):
        graphs = MegatronTowerGraphs(tower, cuda=False)
        monkeypatch.setattr(speed_qwen3_vl_sync_free, "megatron_tower_graphs", lambda m: graphs)
        for _ in range(3):
            losses, _, _ = loss_and_grads(model, kwargs)
            torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
        assert graphs.stats()["calls"] == {"warm-up": 1, "captured": 1, "replayed": 1}, graphs.stats()
        assert any(".deepstack_merger_list." in name for name, _ in tower.named_parameters())
        for name, param in tower.named_parameters():
            want = 3 * eager_grads[f"vision_model.{name}"]
            scale = float(want.abs().max()) + 1e-6
            torch.testing.assert_close(param.main_grad, want, rtol=1e-4, atol=1e-5 * scale, msg=name)
