"""A micro-batch's forward and backward without host reads of device values (patch group
"speed-sync-free" of qvl.foundation.patches, with qvl.kernels.speed_rotary's packed rotary).

Megatron-Bridge 0.6.2's `Qwen25VLModel.forward` (megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py; Qwen2-VL
inherits it) reads the device to the host on every micro-batch:
- it ignores the `position_ids` it is given and recomputes the 3-D mRoPE positions with transformers'
  `get_rope_index` (a `.tolist()` of the token types and three `.item()` per image), after cutting the pack into
  rows with `unpack_mcore_thd_tensor_for_position_ids` (two `.tolist()`). qvl's loader computes the same positions on
  the host (qvl.data.mrope, equal to `get_rope_index` bit for bit: tests/kernels/test_speed_sync_free.py);
- `get_image_features` reads the split sizes of `image_grid_thw` only for the forward to concatenate the pieces
  again: the tower's whole output is the same tensor;
- `get_placeholder_mask` checks the placeholder count against the features on the device (`torch_compilable_check`
  and its message's f-string read it). The same check runs here on the host tokens and grids the loader has.
`loader_positions_forward` runs that forward with those three changes for a micro-batch whose positions came from
qvl's loader (`note_host_batch`); any other call takes upstream's forward. Megatron-Bridge's Qwen3-VL forward
(modelling_qwen3_vl/model.py) uses explicit [3, b, s] positions as given, so there the loader's need no patch.

Megatron-Bridge's `masked_next_token_loss` checks every micro-batch's loss for NaN and Inf through the rerun state
machine (megatron/core/rerun_state_machine.py `validate_result`), two host reads per micro-batch. qvl's step keeps
the losses instead (`defer_loss_check`) and `train_step_with_loss_check` reads them all at once after the step:
training still stops with the micro-batch and its value named, before the loop logs or saves that step.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from qvl.foundation.errors import QvlError

GROUP = "speed-sync-free"

_HOST_BATCHES = WeakIdKeyDictionary()  # loader position ids on the device -> the host batch they came with
_PENDING_LOSSES: list[torch.Tensor] = []  # this step's micro-batch losses, read once after the step
_IN_TRAIN_STEP: list[bool] = []  # non-empty while a `train_step_with_loss_check` runs


class NonFiniteLossError(QvlError, RuntimeError):
    """A micro-batch's loss was NaN or infinite: training stopped."""


class PlaceholderMismatchError(QvlError, ValueError):
    """A packed batch whose vision placeholder tokens and vision grids disagree."""


@dataclass(kw_only=True, slots=True, frozen=True)
class HostBatch:
    """What the forward would otherwise read back from the device, as the loader gave it (on the host)."""

    tokens: torch.Tensor  # [1, T] the pack's token ids
    image_grid_thw: torch.Tensor | None  # [n_images, 3]
    video_grid_thw: torch.Tensor | None  # [n_videos, 3]


def note_host_batch(position_ids: torch.Tensor, host: HostBatch) -> torch.Tensor:
    """Mark `position_ids` (the loader's, as passed to the model) as coming with `host`; returns them."""
    _HOST_BATCHES[position_ids] = host
    return position_ids


def check_placeholders(host: HostBatch, *, image_token_id: int, video_token_id: int, merge: int) -> None:
    """The host-side form of transformers' `get_placeholder_mask` count check, one clear error."""
    for kind, token_id, grid in (
        ("image", image_token_id, host.image_grid_thw),
        ("video", video_token_id, host.video_grid_thw),
    ):
        if grid is None or not grid.numel():
            continue
        tokens = int((host.tokens == token_id).sum())
        features = int((grid.prod(-1) // merge**2).sum())
        if tokens != features:
            raise PlaceholderMismatchError(
                f"a packed batch has {tokens} {kind} placeholder tokens but its {kind}_grid_thw {grid.tolist()} "
                f"gives {features} {kind} features; prepare the dataset again with `qvl data prepare` for this "
                "checkpoint's processor"
            )


def _vision_embeddings(model, pixels: torch.Tensor, grid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The tower's output for `pixels`: what `get_image_features` / `get_video_features` return, concatenated (they
    split it by grid only for Megatron-Bridge's forward to concatenate the pieces again)."""
    output = model.visual(pixels.type(model.visual.dtype), grid_thw=grid).pooler_output
    return output.to(like.device, like.dtype)


def _embeddings(model, args: dict, host: HostBatch) -> torch.Tensor:
    """The decoder input [s, b, h]: upstream's pre-process with the vision features scattered without host reads."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    input_ids, inputs_embeds = args["input_ids"], args["inputs_embeds"]
    if inputs_embeds is None:
        inputs_embeds = model.language_model.embedding(input_ids=input_ids, position_ids=None)
        inputs_embeds = inputs_embeds.transpose(1, 0).contiguous()  # [b, s, h]
    check_placeholders(
        host,
        image_token_id=model.config.image_token_id,
        video_token_id=model.config.video_token_id,
        merge=model.visual.spatial_merge_size,
    )
    for pixels, grid, token_id in (
        (args["pixel_values"], args["image_grid_thw"], model.config.image_token_id),
        (args["pixel_values_videos"], args["video_grid_thw"], model.config.video_token_id),
    ):
        if pixels is not None:
            embeds = _vision_embeddings(model, pixels, grid, inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter((input_ids == token_id).unsqueeze(-1), embeds)
    inputs_embeds = inputs_embeds.transpose(1, 0)  # [s, b, h]
    if model.config.sequence_parallel:
        pg = model.config._pg_collection
        inputs_embeds = scatter_to_sequence_parallel_region(inputs_embeds, group=pg.tp if pg is not None else None)
    return inputs_embeds


def loader_positions_forward(original):
    """`Qwen25VLModel.forward` that, given the loader's positions of a packed (THD) batch, uses them and reads
    nothing from the device; any other call goes to upstream's forward."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        position_ids, packed = arguments["position_ids"], arguments["packed_seq_params"]
        host = _HOST_BATCHES.get(position_ids) if isinstance(position_ids, torch.Tensor) else None
        if host is None or packed is None or packed.qkv_format != "thd" or arguments["input_ids"] is None:
            return original(*bound.args, **bound.kwargs)
        inputs_embeds = _embeddings(self, arguments, host) if self.pre_process else arguments["inputs_embeds"]
        return self.language_model.forward(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=arguments["attention_mask"],
            decoder_input=inputs_embeds,
            labels=arguments["labels"],
            loss_mask=arguments["loss_mask"],
            runtime_gather_output=arguments["runtime_gather_output"],
            packed_seq_params=packed,
        )

    return forward


def defer_loss_check() -> bool:
    """Whether a loss computed now is checked at the step's end: inside a training step that will read it
    (`train_step_with_loss_check`), with the rerun state machine disabled (its other modes re-run a micro-batch from
    `validate_result`). Evaluation and any other caller keep upstream's check."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    return bool(_IN_TRAIN_STEP) and get_rerun_state_machine().mode == RerunMode.DISABLED


def masked_loss(
    loss_mask: torch.Tensor, output_tensor, *, check_for_nan_in_loss: bool, check_for_spiky_loss: bool
) -> tuple:
    """Megatron-Bridge's `masked_next_token_loss`, its NaN/Inf check deferred to the step's end where possible."""
    from megatron.bridge.training.losses import masked_next_token_loss

    defer = check_for_nan_in_loss and defer_loss_check()
    result = masked_next_token_loss(
        loss_mask,
        output_tensor,
        check_for_nan_in_loss=check_for_nan_in_loss and not defer,
        check_for_spiky_loss=check_for_spiky_loss,
    )
    if defer:
        note_loss(result[0])
    return result


def note_loss(loss: torch.Tensor) -> None:
    """Keep a micro-batch's loss (on the device) for the check at the step's end."""
    _PENDING_LOSSES.append(loss.detach().reshape(()))


def check_losses(iteration: int) -> None:
    """Read this step's micro-batch losses in one transfer; raise if any is NaN or infinite.

    Upstream reads each loss twice as it is computed (NaN, then Inf), which makes the host wait for the GPU inside
    the pipeline of micro-batches. Here the GPU runs the whole step first; the read comes after the optimizer step,
    which already waited for the GPU (the grad norm), so it costs one small copy and no idle time."""
    if not _PENDING_LOSSES:
        return
    values = torch.stack([loss.float() for loss in _PENDING_LOSSES]).tolist()
    _PENDING_LOSSES.clear()
    bad = [(index, value) for index, value in enumerate(values) if not math.isfinite(value)]
    if bad:
        index, value = bad[0]
        raise NonFiniteLossError(
            f"the loss of micro-batch {index + 1} of {len(values)} at iteration {iteration} is {value} "
            f"({len(bad)} non-finite in this step); training stopped before logging or saving it. Resume from the "
            "last checkpoint with a lower learning rate or a tighter clip_grad, or look at that micro-batch's data"
        )


def train_step_with_loss_check(original):
    """Megatron-Bridge's `train_step` followed by the check of every micro-batch loss it kept (`check_losses`)."""

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        _PENDING_LOSSES.clear()  # from a step that raised part-way
        _IN_TRAIN_STEP.append(True)
        try:
            result = original(*args, **kwargs)
        finally:
            _IN_TRAIN_STEP.pop()
        global_state = kwargs.get("global_state", args[5] if len(args) > 5 else None)
        iteration = getattr(getattr(global_state, "train_state", None), "step", -1) + 1
        check_losses(iteration)
        return result

    return train_step
