"""Each distinct image (video) of a micro-batch encoded once (qvl.kernels.tower_inputs.VisionSources /
DistinctVision, qvl.training.step.model_inputs): on a preference micro-batch whose pairs' sides share their images,
qvl's forward step runs the vision tower once over the distinct patches, half of what it encodes with every
placeholder's pixels given, and its losses and every parameter's gradient are the duplicated path's within fp32
rounding (the gather's backward sums both sides' gradients into the one pass); upstream's forward, given the distinct
pixels without a host batch, gets them expanded back and computes exactly what it computes from the loader's."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from qvl.bridges.tiny_model import tiny_hf_config
from qvl.foundation.families import TINY_TOKEN_IDS, get_family
from qvl.kernels.tower_inputs import first_occurrences, tower_inputs_for_config
from tests.kernels.test_speed_qwen3_vl_sync_free import step_loss_and_grads
from tests.kernels.test_speed_sync_free import (
    IMAGE_GRIDS,
    SECONDS_PER_GRID,
    TEXT,
    VIDEO_GRID,
    _loader_positions,
    _packed_params,
    _video,
    _vision,
)
from tests.tiny_megatron import tiny_megatron_model

# Qwen2.5-VL encodes each kind in its own tower call (its videos case has images too); Qwen3-VL one call for all, in
# the tower's own order where images and videos mix
CASES = [("qwen2_5_vl", True), ("qwen3_vl", False), ("qwen3_vl", True)]


@pytest.fixture(scope="module")
def models():
    """Each family's tiny Megatron model as training builds it (fp32, norms and biases perturbed), built on use."""
    from qvl.foundation import distributed, patches, runtime
    from qvl.kernels import speed_hf_vision

    runtime.activate(force=True)
    distributed.init_distributed()
    built = {}

    def model(family: str):
        if family not in built:
            # no DDP wrapper here, so no main_grad to accumulate into
            built[family], _ = tiny_megatron_model(family, gradient_accumulation_fusion=False)
            with torch.no_grad():
                for param in built[family].parameters():
                    param.add_(0.05 * torch.randn_like(param))
        return built[family]

    try:
        yield model
    finally:
        patches.undo(speed_hf_vision.GROUP)  # the Qwen2.5-VL build's pre-wrap hook applied the lean tower
        distributed.destroy_distributed()
        runtime.deactivate()


def pairs_batch(family: str, patch_dim: int, *, videos: bool, deduplicated: bool) -> types.SimpleNamespace:
    """A loader-like preference micro-batch: two pairs, each side's prompt the pair's image (the first pair's also a
    video), the answers different; the pixels one entry per placeholder, each pair's sides the same values; with
    `deduplicated` the loader's sources and the tower inputs of the distinct grids (qvl.data.encode)."""
    image = TINY_TOKEN_IDS["image_token_id"]
    in_seconds = get_family(family).video_positions_in_seconds
    sub_ids, sub_media, image_sources, video_sources = [], [], [], []
    for pair, (grid, with_video) in enumerate([(IMAGE_GRIDS[0], videos), (IMAGE_GRIDS[1], False)]):
        prompt = [TEXT, TEXT + 1, *_vision(image, grid), *(_video(family) if with_video else []), TEXT + 2]
        for side in range(2):
            sub_ids.append(np.array(prompt + [TEXT + 10 + side + k for k in range(4)]))
            media = {"image_grid_thw": [grid], "video_grid_thw": [VIDEO_GRID] if with_video else []}
            sub_media.append(media | ({"second_per_grid_ts": [SECONDS_PER_GRID]} if with_video and in_seconds else {}))
            image_sources.append(pair)
            video_sources += [0] if with_video else []
    batch = types.SimpleNamespace(**_packed_text(family, sub_ids, sub_media))
    # the loader's seconds per grid where the family's positions count them (Qwen2.5-VL), else empty
    batch.second_per_grid_ts = torch.tensor([SECONDS_PER_GRID] * len(video_sources) * in_seconds)
    generator = torch.Generator().manual_seed(2)
    vision_config = tiny_hf_config(family).vision_config
    for kind, sources in (("image", image_sources), ("video", video_sources)):
        grid = torch.tensor([g for m in sub_media for g in m[f"{kind}_grid_thw"]], dtype=torch.long).reshape(-1, 3)
        sources = torch.tensor(sources, dtype=torch.long)
        firsts = first_occurrences(sources)
        distinct = [torch.randn(int(g.prod()), patch_dim, generator=generator) for g in grid[firsts]]
        given = {"pixels": None, "grid_thw": grid, "tower_inputs": None, "sources": None}
        if len(sources):
            given |= {
                "pixels": torch.cat([distinct[s] for s in sources.tolist()]),
                "tower_inputs": tower_inputs_for_config(grid[firsts] if deduplicated else grid, vision_config),
                "sources": sources if deduplicated else None,
            }
        setattr(batch, "pixel_values" if kind == "image" else "pixel_values_videos", given.pop("pixels"))
        for name, value in given.items():
            setattr(batch, f"{kind}_{name}", value)
    return batch


def _packed_text(family: str, sub_ids: list[np.ndarray], sub_media: list[dict]) -> dict:
    """The loader's token fields of a pack of `sub_ids` (every next token learned)."""
    from qvl.data.count import IGNORE_INDEX

    tokens = torch.from_numpy(np.concatenate(sub_ids))[None]
    cu = _packed_params(sub_ids).cu_seqlens_q
    return {
        "tokens": tokens,
        "labels": torch.cat([tokens[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1),
        "loss_mask": torch.ones(tokens.shape, dtype=torch.float32),
        "position_ids": _loader_positions(family, sub_ids, sub_media, tiny_hf_config(family)),
        "cu_seqlens_q": cu,
        "max_seqlen": int(torch.diff(cu).max()),
    }


def tower(model) -> torch.nn.Module:
    return getattr(model, "visual", None) or model.vision_model


def patches_seen(model, run) -> tuple[list[int], object]:
    """The patch count of every vision tower call during `run()`, and its result."""
    seen = []

    def hook(module, args, kwargs):
        seen.append((kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]).shape[0])

    handle = tower(model).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        return seen, run()
    finally:
        handle.remove()


def assert_as_fp32_rounding(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to fp32 rounding of a re-ordered sum: within 1e-5 of the tensor's scale."""
    scale = expected.abs().max().clamp(min=1e-6)
    assert (got - expected).abs().max() <= 1e-5 * scale, what


@pytest.mark.parametrize(("family", "videos"), CASES, ids=[f"{f}-{'videos' if v else 'images'}" for f, v in CASES])
def test_the_tower_encodes_each_pairs_image_once_with_the_duplicated_paths_losses_and_gradients(models, family, videos):
    model = models(family)
    patch_dim = math.prod(tower(model).patch_embed.proj.weight.shape[1:])
    duplicated = pairs_batch(family, patch_dim, videos=videos, deduplicated=False)
    deduplicated = pairs_batch(family, patch_dim, videos=videos, deduplicated=True)
    assert torch.equal(duplicated.pixel_values, deduplicated.pixel_values)

    seen_twice, (losses, grads, _) = patches_seen(model, lambda: step_loss_and_grads(model, duplicated))
    seen_once, (got, got_grads, reads) = patches_seen(model, lambda: step_loss_and_grads(model, deduplicated))

    every_placeholder = sum(int(g.prod(-1).sum()) for g in (duplicated.image_grid_thw, duplicated.video_grid_thw))
    assert sum(seen_twice) == every_placeholder
    assert len(seen_once) == len(seen_twice) and 2 * sum(seen_once) == every_placeholder  # one tower pass per pair
    if family == "qwen3_vl":  # the indexed forward reads nothing back, gathers included
        assert dict(reads.sites) == {}
    assert_as_fp32_rounding(got, losses, "losses")
    assert got_grads.keys() == grads.keys() and any(name.startswith(("visual.", "vision_model.")) for name in grads)
    for name, grad in grads.items():
        assert_as_fp32_rounding(got_grads[name], grad, name)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_upstreams_forward_gets_the_distinct_pixels_expanded_back(models, family):
    """Without a host batch (upstream's forward: context parallelism, a caller of its own) the model expands the
    distinct pixels on the device and computes exactly what it computes from the loader's pixels."""
    from qvl.training.step import model_inputs

    model = models(family)
    patch_dim = math.prod(tower(model).patch_embed.proj.weight.shape[1:])
    duplicated, deduplicated = (
        model_inputs(pairs_batch(family, patch_dim, videos=True, deduplicated=flag), torch.device("cpu"))[0]
        for flag in (False, True)
    )
    assert "vision_sources" not in duplicated and deduplicated["vision_sources"] is not None
    assert deduplicated["pixel_values"].shape[0] * 2 == duplicated["pixel_values"].shape[0]
    with torch.no_grad():
        seen, got = patches_seen(model, lambda: model(**deduplicated))
        expected = model(**duplicated)
    assert torch.equal(got, expected) and sum(seen) == sum(
        duplicated[name].shape[0] for name in ("pixel_values", "pixel_values_videos")
    )


def test_the_vision_balanced_step_gets_the_distinct_pixels_expanded_back(models):
    """`vision_balance` (Qwen2.5-VL's HF tower, here on one rank) encodes the pixels as the loader gives them: from the
    distinct pixels it builds exactly the embeddings it builds from every placeholder's."""
    from qvl.training.step import balanced_vision_inputs, model_inputs

    model = models("qwen2_5_vl")
    patch_dim = math.prod(tower(model).patch_embed.proj.weight.shape[1:])
    duplicated, deduplicated = (
        model_inputs(pairs_batch("qwen2_5_vl", patch_dim, videos=True, deduplicated=flag), torch.device("cpu"))[0]
        for flag in (False, True)
    )
    with torch.no_grad():
        got, expected = (balanced_vision_inputs(model, kwargs) for kwargs in (deduplicated, duplicated))
    assert "vision_sources" not in got and "pixel_values" not in got
    assert torch.equal(got["inputs_embeds"], expected["inputs_embeds"])
