"""Megatron-Bridge's Qwen3-VL language-model side with host-computed vision positions
(qvl.recipes.training.qwen3_vl_sync_free, patch group "qwen3-vl-sync-free"): losses and every gradient bitwise the
boolean-mask version's in fp32, no boolean-mask indexing left in the forward or backward, upstream's path where
no positions were noted."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qvl.bridges.tiny_model import tiny_hf_config
from qvl.foundation import patches
from qvl.recipes.training import qwen3_vl_sync_free as sync_free
from tests.recipes.test_sync_free import _batch

FAMILY = "qwen3_vl"
MODALITIES = {  # the pixel fields a micro-batch keeps
    "images": ("pixel_values", "image_grid_thw"),
    "videos": ("pixel_values_videos", "video_grid_thw"),
    "both": ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"),
}
_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")


class BoolIndexing(TorchDispatchMode):
    """Counts the aten ops that index with a boolean mask: on a GPU each one reads the mask's count to the host
    (`x[mask] = scalar` runs as masked_fill_ and reads nothing: not counted, as in benchmarks/step_census.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _INDEX_OPS and len(args) > 1 and not ("index_put" in name and args[2].numel() == 1):
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen3-VL family record's Megatron model (one deepstack layer), built by qvl's provider in fp32."""
    from qvl.bridges.providers import provider_from_hf
    from qvl.foundation import distributed, runtime

    runtime.activate(force=True)
    distributed.init_distributed()
    try:
        provider = provider_from_hf(tiny_hf_config(FAMILY))
        provider.gradient_accumulation_fusion = False  # no DDP wrapper here, so no main_grad to accumulate into
        provider.finalize()
        torch.manual_seed(0)
        built = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]
        assert built.vision_transformer_config.deepstack_visual_indexes  # the deepstack path is exercised
        with torch.no_grad():  # norms at 1 and biases at 0 would hide a mix-up: perturb them
            for param in built.parameters():
                param.add_(0.05 * torch.randn_like(param))
        yield built
    finally:
        distributed.destroy_distributed()
        runtime.deactivate()


def micro_batch(model, modality: str) -> tuple[types.SimpleNamespace, dict]:
    """A loader-like pack (text, two images, a video, text) and the step's model inputs keeping `modality`."""
    from qvl.recipes.training.step import model_inputs

    patch_dim = math.prod(model.vision_model.patch_embed.proj.weight.shape[1:])
    batch = _batch(FAMILY, tiny_hf_config(FAMILY), patch_dim)
    kwargs, _ = model_inputs(batch, torch.device("cpu"))
    kwargs.pop("second_per_grid_ts")  # Qwen2.5-VL's; Qwen3-VL's loader leaves it empty, so the step passes none
    for field in MODALITIES["both"]:
        if field not in MODALITIES[modality]:
            kwargs.pop(field)
    return batch, kwargs


def loss_and_grads(model, kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """The per-token losses, every parameter's gradient and the boolean-mask indexing ops of forward and backward."""
    model.zero_grad(set_to_none=True)
    with BoolIndexing() as indexing:
        losses = model(**kwargs)
        (losses * kwargs["loss_mask"]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, indexing.count


def reordering_ops(model, kwargs) -> int:
    """The boolean indexing of upstream's `reorganize_inputs`, which puts a pack's images and videos into token order
    for the tower (reading its grids too): not the language model's, left as it is."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import reorganize_inputs

    with BoolIndexing() as indexing:
        reorganize_inputs(
            input_ids=kwargs["input_ids"],
            pixel_values=kwargs.get("pixel_values"),
            pixel_values_videos=kwargs.get("pixel_values_videos"),
            image_grid_thw=kwargs.get("image_grid_thw"),
            video_grid_thw=kwargs.get("video_grid_thw"),
            image_token_id=model.image_token_id,
            video_token_id=model.video_token_id,
            square_merge_size=model.square_merge_size,
        )
    return indexing.count


def noted(model, batch, kwargs) -> torch.Tensor:
    """The step's host-computed vision positions, noted with `kwargs`' input_ids (as in
    qvl.recipes.training.step.forward_step)."""
    positions = sync_free.host_vision_positions(model, batch.tokens, kwargs)
    assert positions is not None and positions.dtype == torch.int64
    sync_free.note_vision_positions(kwargs["input_ids"], positions)
    return positions


@pytest.mark.parametrize("modality", list(MODALITIES))
def test_indexed_forward_is_the_masked_one_bit_for_bit_with_its_gradients(model, modality):
    batch, kwargs = micro_batch(model, modality)
    losses, grads, masked_ops = loss_and_grads(model, kwargs)
    with patches.applied(sync_free.GROUP):
        noted(model, batch, kwargs)
        got, got_grads, indexed_ops = loss_and_grads(model, kwargs)
    assert masked_ops > 0 and indexed_ops == reordering_ops(model, kwargs) == (2 if modality == "both" else 0)
    assert torch.equal(got, losses)
    assert got_grads.keys() == grads.keys()
    assert any(".deepstack_merger_list." in name for name in grads)  # the deepstack features reached the loss
    assert [name for name in grads if not torch.equal(got_grads[name], grads[name])] == []


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
        batch, kwargs = micro_batch(model, "images")
        losses, grads, _ = loss_and_grads(model, kwargs)
        with patches.applied(sync_free.GROUP):
            positions = noted(model, batch, kwargs)
            got, got_grads, indexed_ops = loss_and_grads(model, kwargs)
    finally:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = saved
    assert indexed_ops == 0
    layers = model.language_model.decoder.num_layers_per_pipeline_rank
    assert len(checkpointed) == 2 * layers  # every layer, masked then indexed (its positions among the arguments)
    assert all(any(a is positions for a in args) for args in checkpointed[layers:])
    assert torch.equal(got, losses)
    assert all(torch.equal(got_grads[name], grads[name]) for name in grads)


def test_without_noted_positions_upstreams_path_runs(model):
    """Positions are wanted only from a patched forward, and used only for the very input_ids they were noted with."""
    batch, kwargs = micro_batch(model, "images")
    assert sync_free.host_vision_positions(model, batch.tokens, kwargs) is None  # group not applied
    expected = loss_and_grads(model, kwargs)
    with patches.applied(sync_free.GROUP):
        noted(model, batch, kwargs)
        other = dict(kwargs, input_ids=kwargs["input_ids"].clone())  # equal tokens, another tensor: not noted
        got = loss_and_grads(model, other)
    assert got[2] == expected[2] > 0  # upstream's masked indexing ran
    assert torch.equal(got[0], expected[0])


def test_positions_that_do_not_fit_the_features_are_refused(model):
    batch, kwargs = micro_batch(model, "images")
    with patches.applied(sync_free.GROUP):
        positions = sync_free.host_vision_positions(model, batch.tokens, kwargs)
        sync_free.note_vision_positions(kwargs["input_ids"], positions[1:])
        with pytest.raises(sync_free.VisionPositionsMismatch, match=f"for {positions.numel() - 1} vision"):
            model(**kwargs)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_indexed_deepstack_is_the_masked_one_bit_for_bit(batch_size):
    """The deepstack addition alone, at flat [b*s] indices vs upstream's boolean mask: values and gradients."""
    from qvl.foundation import megatron

    megatron.import_megatron_bridge()
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_block import Qwen3VLTransformerBlock

    upstream = Qwen3VLTransformerBlock._deepstack_process
    indexed = sync_free.indexed_deepstack(upstream)
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(batch_size, 12, generator=generator) < 0.4  # [b, s]
    hidden = torch.randn(12, batch_size, 8, generator=generator)  # [s, b, h]
    embeds = torch.randn(int(mask.sum()), 8, generator=generator)
    weights = torch.randn(12, batch_size, 8, generator=generator)

    def run(function, where):
        h, e = hidden.clone().requires_grad_(), embeds.clone().requires_grad_()
        out = function(None, h * 1, where, e)  # a non-leaf, as a layer's output is
        (out * weights).sum().backward()
        return out.detach(), h.grad, e.grad

    expected = run(upstream, mask)
    got = run(indexed, mask.reshape(-1).nonzero().flatten())
    assert all(map(torch.equal, got, expected))
    assert not torch.equal(expected[0], hidden)  # the features were added
    assert all(map(torch.equal, run(indexed, mask), expected))  # a boolean mask still goes to upstream's
