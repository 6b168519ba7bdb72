"""A micro-batch without host reads (qvl.kernels.speed_sync_free; patch group "speed-sync-free").

The loader's mRoPE positions equal what Megatron-Bridge's forward computes (transformers' `get_rope_index` for
Qwen2-VL / Qwen2.5-VL, Megatron-Bridge's own for Qwen3-VL) bit for bit on a pack with several images, a video and
text-only sub-sequences; qvl's model forward given the loader's host batch gives upstream's losses and gradients bit
for bit and reads no device value; a NaN loss still stops training, with its losses read once per step.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest
import torch

from qvl.foundation import distributed, megatron, patches
from qvl.foundation.families import FAMILIES, TINY_TOKEN_IDS, get_family
from tests.tiny_megatron import tiny_megatron_model

IMAGE_GRIDS = [(1, 4, 6), (1, 6, 4)]
VIDEO_GRID = (2, 4, 4)
SECONDS_PER_GRID = 2.0
MERGE = 2
TEXT = 20  # the first ordinary token id of the tiny vocabulary (special tokens are ids 0-6)


def _vision(token_id: int, grid: tuple[int, int, int]) -> list[int]:
    pads = grid[0] * grid[1] * grid[2] // MERGE**2
    return [TINY_TOKEN_IDS["vision_start_token_id"], *[token_id] * pads, TINY_TOKEN_IDS["vision_end_token_id"]]


def _video(family: str) -> list[int]:
    """A video as the family's processor writes it: one run, or a timestamp before each frame's run (Qwen3-VL)."""
    video = TINY_TOKEN_IDS["video_token_id"]
    if not get_family(family).video_frames_timestamped:
        return _vision(video, VIDEO_GRID)
    frame = (1, *VIDEO_GRID[1:])
    return [tok for _ in range(VIDEO_GRID[0]) for tok in (TEXT + 9, *_vision(video, frame))]


def _pack(family: str) -> tuple[list[np.ndarray], list[dict]]:
    """Sub-sequences: text only; two images; a video; text only again."""
    image = TINY_TOKEN_IDS["image_token_id"]
    text = lambda n: [TEXT + k for k in range(n)]  # noqa: E731
    no_media = {"image_grid_thw": [], "video_grid_thw": []}
    subs = [
        (text(7), no_media),
        (
            text(3) + _vision(image, IMAGE_GRIDS[0]) + text(2) + _vision(image, IMAGE_GRIDS[1]) + text(4),
            {"image_grid_thw": IMAGE_GRIDS, "video_grid_thw": []},
        ),
        (
            text(2) + _video(family) + text(3),
            {"image_grid_thw": [], "video_grid_thw": [VIDEO_GRID], "second_per_grid_ts": [SECONDS_PER_GRID]},
        ),
        (text(5), no_media),
    ]
    return [np.array(ids) for ids, _ in subs], [media for _, media in subs]


def _loader_positions(family: str, sub_ids, sub_media, hf_config) -> torch.Tensor:
    from qvl.data.mrope import RopeConfig, packed_position_ids

    rope = RopeConfig(
        family=family,
        spatial_merge_size=MERGE,
        image_pad_id=TINY_TOKEN_IDS["image_token_id"],
        video_pad_id=TINY_TOKEN_IDS["video_token_id"],
        tokens_per_second=getattr(hf_config.vision_config, "tokens_per_second", None),
    )
    return torch.from_numpy(np.ascontiguousarray(packed_position_ids(sub_ids, sub_media, rope)))[:, None]


def _packed_params(sub_ids):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *np.cumsum([len(s) for s in sub_ids])], dtype=torch.int32)
    longest = max(len(s) for s in sub_ids)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def _grids(sub_media, key):
    rows = [g for media in sub_media for g in media[key]]
    return torch.tensor(rows, dtype=torch.long) if rows else None


def _upstream_positions(hf_config, input_ids, packed, image_grid, video_grid) -> torch.Tensor:
    """What Megatron-Bridge's Qwen-VL forward computes when it is given no positions."""
    if _family_of(hf_config).megatron_vision_tower:  # Qwen3-VL: Megatron-Bridge's rope index, packed
        from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import get_rope_index

        positions, _ = get_rope_index(
            hf_config.vision_config.spatial_merge_size,
            TINY_TOKEN_IDS["image_token_id"],
            TINY_TOKEN_IDS["video_token_id"],
            TINY_TOKEN_IDS["vision_start_token_id"],
            input_ids,
            image_grid_thw=image_grid,
            video_grid_thw=None if video_grid is None else video_grid.clone(),
            packed_seq_params=packed,
        )
        return positions
    # Qwen25VLModel.forward (megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py): rows, transformers' rope index,
    # repacked; transformers' method bound to an object with the model's config, as Megatron-Bridge binds it.
    import transformers
    from megatron.bridge.training.utils.packed_seq_utils import (
        repack_mcore_thd_position_ids,
        unpack_mcore_thd_tensor_for_position_ids,
    )

    hf_model_class = transformers.MODEL_MAPPING[type(hf_config)]
    rows, mask, starts, lengths = unpack_mcore_thd_tensor_for_position_ids(input_ids, packed)
    types_ = torch.zeros_like(rows, dtype=torch.int)
    types_[rows == TINY_TOKEN_IDS["image_token_id"]] = 1
    types_[rows == TINY_TOKEN_IDS["video_token_id"]] = 2
    owner = types.SimpleNamespace(config=hf_config)
    owner.get_vision_position_ids = functools.partial(hf_model_class.get_vision_position_ids, owner)
    positions, _ = hf_model_class.get_rope_index(
        owner,
        rows,
        types_,
        image_grid,
        video_grid,
        second_per_grid_ts=torch.tensor([SECONDS_PER_GRID]),
        attention_mask=mask,
    )
    return repack_mcore_thd_position_ids(
        positions, padded_starts=starts, lengths=lengths, total_length=input_ids.size(1)
    )


def _family_of(hf_config):
    return next(r for r in FAMILIES.values() if r.config_class == type(hf_config).__name__)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loader_positions_equal_the_models_rope_index_bitwise(family):
    megatron.import_megatron_bridge()
    from qvl.bridges.tiny_model import tiny_hf_config

    hf_config = tiny_hf_config(family)
    sub_ids, sub_media = _pack(family)
    input_ids = torch.from_numpy(np.concatenate(sub_ids))[None]
    packed = _packed_params(sub_ids)
    theirs = _upstream_positions(
        hf_config, input_ids, packed, _grids(sub_media, "image_grid_thw"), _grids(sub_media, "video_grid_thw")
    )
    ours = _loader_positions(family, sub_ids, sub_media, hf_config)
    assert ours.shape == theirs.shape == (3, 1, input_ids.shape[1])
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)


def _batch(family: str, hf_config, patch_dim: int):
    """A loader-like PackedBatch of `_pack`'s sub-sequences with random pixels (only the fields the step reads)."""
    from qvl.data.count import IGNORE_INDEX

    sub_ids, sub_media = _pack(family)
    tokens = torch.from_numpy(np.concatenate(sub_ids))[None]
    generator = torch.Generator().manual_seed(0)
    labels = torch.cat([tokens[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    image_grid, video_grid = _grids(sub_media, "image_grid_thw"), _grids(sub_media, "video_grid_thw")
    cu = _packed_params(sub_ids).cu_seqlens_q
    return types.SimpleNamespace(
        tokens=tokens,
        labels=labels,
        loss_mask=torch.ones(tokens.shape, dtype=torch.float32),
        position_ids=_loader_positions(family, sub_ids, sub_media, hf_config),
        cu_seqlens_q=cu,
        max_seqlen=int(torch.diff(cu).max()),
        pixel_values=torch.randn(int(image_grid.prod(-1).sum()), patch_dim, generator=generator),
        image_grid_thw=image_grid,
        pixel_values_videos=torch.randn(int(video_grid.prod(-1).sum()), patch_dim, generator=generator),
        video_grid_thw=video_grid,
        second_per_grid_ts=torch.tensor([SECONDS_PER_GRID]),
    )


def _loss_and_grads(model, kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    losses = model(**kwargs)
    (losses * kwargs["loss_mask"]).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_forward_with_loader_positions_equals_upstream_bitwise(family, tmp_path, cpu_runtime):
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.kernels import speed_rotary, speed_sync_free
    from qvl.training.step import host_batch, model_inputs

    hf = write_tiny_hf_checkpoint(tmp_path / "hf", family)
    distributed.init_distributed()
    try:
        model, hf_config = tiny_megatron_model(family, hf=hf, speed=False)
        patch_dim = math.prod(model.visual.patch_embed.proj.weight.shape[1:])
        batch = _batch(family, hf_config, patch_dim)
        assert type(model).__module__ == f"qvl.bridges.{family}"  # qvl's model class, built by qvl's provider
        kwargs, _ = model_inputs(batch, torch.device("cpu"))
        assert kwargs["position_ids"] is not None and "pixel_values_videos" in kwargs
        upstream = _loss_and_grads(model, kwargs)  # no host batch: upstream's forward
        calls = []
        with patches.applied(speed_rotary.GROUP, speed_sync_free.GROUP), pytest.MonkeyPatch.context() as spy:
            for name in ("get_rope_index", "get_image_features", "get_video_features", "get_placeholder_mask"):
                spy.setattr(model, name, lambda *a, _name=name, **k: calls.append(_name))
            ours = _loss_and_grads(
                model, {**kwargs, "host_batch": host_batch(model, batch, kwargs, torch.device("cpu"))}
            )
        assert calls == []  # none of transformers' host-reading helpers ran
        assert torch.equal(ours[0], upstream[0])
        assert ours[1].keys() == upstream[1].keys() and any(n.startswith("visual.") for n in ours[1])
        assert all(torch.equal(ours[1][n], upstream[1][n]) for n in upstream[1])

        wrong = types.SimpleNamespace(**{**vars(batch), "image_grid_thw": batch.image_grid_thw.flip(0)[:1]})
        with (
            patches.applied(speed_rotary.GROUP, speed_sync_free.GROUP),
            pytest.raises(speed_sync_free.PlaceholderMismatchError, match="12 image"),
        ):
            wrong_kwargs = model_inputs(wrong, torch.device("cpu"))[0]
            model(**wrong_kwargs, host_batch=host_batch(model, wrong, wrong_kwargs, torch.device("cpu")))
    finally:
        distributed.destroy_distributed()


class _Reads:
    """Counts host reads of tensor values (`.item()`, `.tolist()`, `bool()`); a read that a torch function mode (the
    CPU runtime's) passes on to the same method again counts once."""

    def __init__(self, spy: pytest.MonkeyPatch):
        self.count, self._depth = 0, 0
        for name in ("item", "tolist", "__bool__"):
            spy.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.count += self._depth == 0
            self._depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return read


def _fake_train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state, *rest):
    """Megatron-Bridge's train_step's part here: each micro-batch's forward step and loss function, as its schedule
    calls them."""
    results = []
    for _ in range(3):
        output, loss_func = forward_step_func(data_iterator, model)
        results.append(loss_func(output))
    return results


def _forward_step(outputs: list[torch.Tensor], *, takes_loss_check: bool = True):
    """A forward step handing out `outputs` in turn with qvl's loss function (taking a `loss_check` as qvl's does)."""
    from qvl.kernels.speed_sync_free import masked_loss

    given = iter(outputs)

    def loss_function(out, loss_check):
        mask = torch.ones(out.shape)
        return functools.partial(
            masked_loss, mask, check_for_nan_in_loss=True, check_for_spiky_loss=False, loss_check=loss_check
        )

    def forward_step(data_iterator, model, *, loss_check=None):
        out = next(given)
        return out, loss_function(out, loss_check)

    def forward_step_without_check(data_iterator, model):
        out = next(given)
        return out, loss_function(out, None)

    return forward_step if takes_loss_check else forward_step_without_check


def test_a_nan_loss_stops_training_after_one_read_per_step(cpu_runtime):
    megatron.import_megatron_bridge()
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    from qvl.kernels.speed_sync_free import NonFiniteLossError, masked_loss, train_step_with_loss_check

    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=4))
    finite = [torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 3.0)]
    with_nan = [finite[0], torch.tensor([1.0, float("nan"), 1.0, 1.0]), finite[2]]
    checked_step = train_step_with_loss_check(_fake_train_step)
    destroy_rerun_state_machine()
    try:
        with pytest.MonkeyPatch.context() as spy:
            reads = _Reads(spy)
            results = checked_step(_forward_step(finite), None, None, None, None, state, None, None, None)
            assert reads.count == 1  # the whole step's losses in one read
            reads.count = 0
            with pytest.raises(NonFiniteLossError, match=r"micro-batch 2 of 3 at iteration 5 is nan"):
                checked_step(_forward_step(with_nan), None, None, None, None, state, None, None, None)
            assert reads.count == 1
        assert [float(r[0]) for r in results] == [4.0, 8.0, 12.0]
        # outside a checked training step (evaluation, another loop) upstream checks each loss as it comes
        with pytest.raises(RuntimeError, match="NaN"):
            masked_loss(torch.ones(4), with_nan[1], check_for_nan_in_loss=True, check_for_spiky_loss=False)
        # and so it does for a forward step that takes no `loss_check`, inside a checked training step
        with pytest.raises(RuntimeError, match="NaN"):
            checked_step(_forward_step(with_nan, takes_loss_check=False), None, None, None, None, state, None, None)
    finally:
        destroy_rerun_state_machine()


@pytest.mark.slow
def test_the_step_census_finds_no_host_read_inside_a_micro_batch(tiny_census):
    """One training step of the tiny census config (Megatron-Bridge's loop, qvl's step, the code path a CUDA device
    takes): no host read in the language model, the vision tower or the loss; at most 10 in the whole step."""
    result = tiny_census["after"]
    regions, sites = result["regions"], result["sync_sites"]
    assert [regions[r]["host_syncs"] for r in ("lm", "vision", "loss")] == [0, 0, 0], sites
    assert result["step"]["host_syncs"] <= 10, sites
    assert not any("get_rope_index" in site or "packed_seq_utils" in site for site in sites), sites
