"""Megatron-Bridge's Qwen3-VL language-model side without host reads (patch group "qwen3-vl-sync-free" of
qvl.foundation.patches): the vision placeholder positions of a pack as host-computed indices instead of a boolean mask.

Megatron-Bridge 0.6.2's `Qwen3VLModel.forward` (megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py) puts the
vision features into the token embeddings with `combined_embeddings[vision_mask] = vision_embeds`, and its decoder
adds each deepstack feature at the same places (`Qwen3VLTransformerBlock._deepstack_process` in
transformer_block.py: `hidden_states[visual_pos_masks, :]`, read and written). Indexing with a boolean mask needs the
number of True entries on the host, so on a GPU each of them waits for the device, forward and backward: 144 of the
151 host syncs of a Qwen3-VL-4B step of 8 packs (benchmarks/RESULTS.md).

qvl's loader has the pack's tokens on the host: the step computes the placeholder positions there
(`host_vision_positions`), copies them to the device with the batch and notes them with its `input_ids`
(`note_vision_positions`). `indexed_forward` then runs the forward of a packed (THD) micro-batch with
`index_copy_`, and `indexed_deepstack` adds the deepstack features with `index_select` / `index_copy_`: sizes known
from shapes, values and gradients bitwise the masked version's (tests/recipes/test_qwen3_vl_sync_free.py). A call
without noted positions, or on a path qvl's step does not take (context parallelism, sequence parallelism over
tensor-parallel ranks, a pipeline stage without embeddings, caller-given masks), runs upstream's forward unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from qvl.foundation.errors import QvlError

GROUP = "qwen3-vl-sync-free"
_TAKES_POSITIONS = "qvl_takes_vision_positions"  # marks the patched forward, so the step computes positions for it
_POSITIONS = WeakIdKeyDictionary()  # a micro-batch's input_ids on the device -> its vision positions on the device


class VisionPositionsMismatch(QvlError, ValueError):
    """Host-computed vision positions that do not fit the vision features of the micro-batch."""


def vision_token_positions(tokens: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """Ascending flat indices (int64) of the entries of `tokens` equal to one of `token_ids`: the rows a boolean mask
    of those tokens selects, in the same order."""
    flat = tokens.reshape(-1)
    return torch.isin(flat, torch.tensor(list(token_ids), dtype=flat.dtype)).nonzero().flatten()


def host_vision_positions(model: Any, host_tokens: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The vision placeholder positions of a micro-batch, computed from its host tokens, where `model`'s forward takes
    them (Megatron-Bridge's Qwen3-VL with patch group "qwen3-vl-sync-free" applied, on the stage that embeds);
    None elsewhere. The tokens that count are those of the pixels given, as upstream's `reorganize_inputs` masks."""
    from megatron.core.utils import unwrap_model

    vlm = unwrap_model(model)
    if not getattr(type(vlm).forward, _TAKES_POSITIONS, False) or not vlm.pre_process or host_tokens.shape[0] != 1:
        return None
    token_ids = [
        token_id
        for field, token_id in (("pixel_values", vlm.image_token_id), ("pixel_values_videos", vlm.video_token_id))
        if kwargs.get(field) is not None
    ]
    return vision_token_positions(host_tokens, token_ids) if token_ids else None


def note_vision_positions(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Mark `positions` (on the model's device) as the vision positions of the micro-batch whose tokens are
    `input_ids` (the very tensor passed to the model)."""
    _POSITIONS[input_ids] = positions


def _takes_indexed_path(model: Any, args: dict) -> bool:
    """Whether a forward call is the packed single-CP-rank path the indexed forward reproduces."""
    input_ids, packed, positions = args["input_ids"], args["packed_seq_params"], args["position_ids"]
    split_over_tp = model.config.sequence_parallel and model.pg_collection.tp.size() > 1
    return (
        model.pre_process
        and model.language_model is not None
        and not model.use_dist_train
        and args["inference_params"] is None
        and packed is not None
        and packed.qkv_format == "thd"
        and input_ids.dim() == 2
        and input_ids.size(0) == 1
        and isinstance(positions, torch.Tensor)  # explicit mRoPE positions [3, b, s], as the loader gives
        and positions.dim() == 3
        and positions.size(0) == 3
        and args["image_input_mask"] is None
        and args["video_input_mask"] is None
        and model.pg_collection.cp.size() == 1
        and not split_over_tp  # upstream splits the deepstack features per rank with a `.tolist()`
    )


def _vision_inputs(model: Any, args: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The tower's pixels and grid, as upstream's `reorganize_inputs` gives them (without building the mask)."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import reorganize_inputs

    images, videos = args["pixel_values"], args["pixel_values_videos"]
    if images is not None and videos is not None:  # re-ordered into token order, reading the grids (upstream's)
        data, grid, _ = reorganize_inputs(
            input_ids=args["input_ids"],
            pixel_values=images,
            pixel_values_videos=videos,
            image_grid_thw=args["image_grid_thw"],
            video_grid_thw=args["video_grid_thw"],
            image_token_id=model.image_token_id,
            video_token_id=model.video_token_id,
            square_merge_size=model.square_merge_size,
        )
        return data, grid
    if images is not None:
        return images, args["image_grid_thw"]
    return videos, args["video_grid_thw"]


def _vision_features(model: Any, args: dict) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The tower's embeddings and deepstack features, or (None, None) without vision, as upstream computes them."""
    data, grid = _vision_inputs(model, args)
    if grid is None or grid.shape[0] == 0:
        return None, None
    if data.shape[0] > 0:
        return model.vision_model(hidden_states=data, grid_thw=grid)
    dtype, device = model.config.params_dtype, data.device
    empty = torch.zeros((0, model.config.hidden_size), device=device, dtype=dtype)
    hidden = model.language_model.config.hidden_size
    deepstack = [
        torch.zeros((0, hidden), device=device, dtype=dtype)
        for _ in model.vision_transformer_config.deepstack_visual_indexes
    ]
    return empty, deepstack


def _embeddings(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, vision_embeds) -> torch.Tensor:
    """The decoder input [s, b, h]: token embeddings with the vision embeddings copied into `positions`' rows."""
    combined = model.language_model.embedding(input_ids=input_ids, position_ids=None).clone()  # [s, b, h]
    if vision_embeds is not None:
        if vision_embeds.shape[0] != positions.numel():
            raise VisionPositionsMismatch(
                f"the vision tower gave {vision_embeds.shape[0]} embeddings for {positions.numel()} vision "
                "placeholder tokens; the packed batch's grids and placeholders disagree: prepare the dataset again "
                "with `qvl data prepare` for this checkpoint's processor"
            )
        combined = combined.transpose(0, 1).contiguous()  # [b, s, h], as upstream masks it
        combined.view(-1, combined.shape[-1]).index_copy_(0, positions, vision_embeds)
        combined = combined.transpose(0, 1).contiguous()
    if model.config.sequence_parallel:
        from megatron.core import tensor_parallel

        combined = tensor_parallel.scatter_to_sequence_parallel_region(combined, group=model.pg_collection.tp)
        combined = combined.contiguous()
    return combined


def _forward_with_positions(model: Any, args: dict, positions: torch.Tensor):
    """Upstream's forward for a packed micro-batch on one CP rank, vision rows addressed by `positions`."""
    torch.cuda.nvtx.range_push("Qwen3VLModel.forward.pre_process")
    vision_embeds, deepstack = _vision_features(model, args)
    decoder_input = _embeddings(model, args["input_ids"], positions, vision_embeds)
    model.language_model.rotary_pos_emb.is_thd_format = True
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push("Qwen3VLModel.forward.language_model")
    output = model.language_model(
        input_ids=args["input_ids"],
        position_ids=args["position_ids"],
        attention_mask=None,
        decoder_input=decoder_input,
        labels=args["labels"],
        loss_mask=args["loss_mask"],
        inference_params=None,
        packed_seq_params=args["packed_seq_params"],
        runtime_gather_output=args["runtime_gather_output"],
        visual_pos_masks=positions,  # int64 indices: `indexed_deepstack` adds the deepstack features there
        deepstack_visual_embeds=deepstack,
        **(args["extra_block_kwargs"] or {}),
        **args["kwargs"],
    )
    torch.cuda.nvtx.range_pop()
    return output


# Replacement factories named by qvl.foundation.patches.


def indexed_forward(original):
    """`Qwen3VLModel.forward` that, given a packed micro-batch whose vision positions the step noted, addresses the
    vision rows by those indices; any other call goes to upstream's forward."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        input_ids = arguments["input_ids"]
        positions = _POSITIONS.get(input_ids) if isinstance(input_ids, torch.Tensor) else None
        if positions is None or not _takes_indexed_path(self, arguments):
            return original(*bound.args, **bound.kwargs)
        return _forward_with_positions(self, arguments, positions)

    setattr(forward, _TAKES_POSITIONS, True)
    return forward


def indexed_deepstack(original):
    """`Qwen3VLTransformerBlock._deepstack_process` that takes int64 row indices into the [b*s] tokens as well as
    upstream's boolean mask (which goes to upstream's)."""

    @functools.wraps(original)
    def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
        if visual_pos_masks.dtype == torch.bool:
            return original(self, hidden_states, visual_pos_masks, visual_embeds)
        hidden_states = hidden_states.transpose(0, 1).contiguous()  # [b, s, h]
        rows = hidden_states.view(-1, hidden_states.shape[-1])
        # upstream: `hidden_states[mask, :] = hidden_states[mask, :].clone() + visual_embeds`, the same sum and copy
        rows.index_copy_(0, visual_pos_masks, rows.index_select(0, visual_pos_masks) + visual_embeds)
        return hidden_states.transpose(0, 1).contiguous()

    return _deepstack_process
