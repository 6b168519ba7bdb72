"""A micro-batch's forward and backward without host reads: the body of qvl's Qwen2-VL / Qwen2.5-VL forward
(qvl.bridges.qwen2_5_vl) for a batch of qvl's loader, and the loss check once per step (patch group
"speed-sync-free" of qvl.foundation.patches), with qvl.kernels.speed_rotary's packed rotary.

Megatron-Bridge 0.6.2's `Qwen25VLModel.forward` (megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py) reads the
device to the host on every micro-batch:
- it ignores the `position_ids` it is given and recomputes the 3-D mRoPE positions with transformers'
  `get_rope_index` (a `.tolist()` of the token types and three `.item()` per image), after cutting the pack into
  rows with `unpack_mcore_thd_tensor_for_position_ids` (two `.tolist()`). qvl's loader computes the same positions on
  the host (qvl.data.mrope, equal to `get_rope_index` bit for bit: tests/kernels/test_speed_sync_free.py);
- `get_image_features` reads the split sizes of `image_grid_thw` only for the forward to concatenate the pieces
  again: the tower's whole output is the same tensor;
- `get_placeholder_mask` checks the placeholder count against the features on the device (`torch_compilable_check`
  and its message's f-string read it). The same check runs here on the host tokens and grids the loader has.
qvl's forward step hands qvl's model a `HostBatch` (what the loader computed on the host) as an argument of its
forward; `loader_positions_forward` is that forward with those three changes, the tower given the loader's inputs
(qvl.kernels.tower_inputs). A call without one runs upstream's forward. Megatron-Bridge's Qwen3-VL forward
(modelling_qwen3_vl/model.py) uses explicit [3, b, s] positions as given, so there the loader's need nothing more.
Where the step gives each distinct image of the micro-batch once (the host batch's `image_sources`, a
`DistinctVision`), the tower encodes those and `index_select` gives every placeholder its image's rows.

Megatron-Bridge's `masked_next_token_loss` checks every micro-batch's loss for NaN and Inf through the rerun state
machine (megatron/core/rerun_state_machine.py `validate_result`), two host reads per micro-batch. Megatron-Bridge's
`train_step` is not qvl's, so the check after the step is a registry patch (`train_step_with_loss_check`): it hands
the forward step it runs a `LossCheck` (qvl's forward step takes one as `loss_check`, and its loss function keeps
each loss there instead of checking it) and reads them all at once after the step: training still stops with the
micro-batch and its value named, before the loop logs or saves that step.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from qvl.foundation.errors import QvlError
from qvl.kernels import speed_cuda_graphs
from qvl.kernels.speed_hf_vision import tower_kwargs
from qvl.kernels.speed_qwen3_vl_sync_free import check_tower_rows
from qvl.kernels.tower_graphs import tower_graphs
from qvl.kernels.tower_inputs import DistinctVision, MegatronTowerInputs, TowerInputs, together
from qvl.kernels.vision_placement import VisionPlacement

GROUP = "speed-sync-free"


class NonFiniteLossError(QvlError, RuntimeError):
    """A micro-batch's loss was NaN or infinite: training stopped."""


class PlaceholderMismatchError(QvlError, ValueError):
    """A packed batch whose vision placeholder tokens and vision grids disagree."""


@dataclass(kw_only=True, slots=True, frozen=True)
class HostBatch:
    """What qvl's loader computed on the host for one micro-batch, for qvl's model forwards to take instead of
    reading it back from the device (qvl's forward step passes it as their `host_batch` argument)."""

    tokens: torch.Tensor  # [1, T] the pack's token ids, on the host
    image_grid_thw: torch.Tensor | None  # [n_images, 3], on the host
    video_grid_thw: torch.Tensor | None  # [n_videos, 3], on the host
    # The tower's inputs for the model's `image_grid_thw` / `video_grid_thw`, on the model's device; None where the
    # loader gave none (or, for Qwen3-VL, where `vision_placement` holds those of the token-order grid)
    image_tower_inputs: TowerInputs | MegatronTowerInputs | None = None
    video_tower_inputs: TowerInputs | MegatronTowerInputs | None = None
    vision_placement: VisionPlacement | None = None  # Qwen3-VL: where the vision rows go, on the model's device
    # Where the model is given each distinct image (video) of the micro-batch once: their grid, for which the tower
    # inputs above are, and each placeholder feature row's row in the tower's output, on the model's device
    image_sources: DistinctVision | None = None
    video_sources: DistinctVision | None = None


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


@dataclass(kw_only=True, frozen=True, slots=True)
class _TowerCall:
    """One kind's tower call of a micro-batch (its images, or its videos): the pixels and grid the tower encodes (each
    `distinct` image once), the loader's inputs for them, and the kind's placeholder token."""

    pixels: torch.Tensor
    grid: torch.Tensor
    inputs: Any
    distinct: DistinctVision | None
    token_id: int


def _tower_call(pixels, grid, inputs, distinct: DistinctVision | None, token_id: int) -> _TowerCall:
    if distinct is not None:
        if pixels.shape[0] != distinct.patches:
            raise PlaceholderMismatchError(
                f"the model was given {pixels.shape[0]} pixel rows for distinct images of {distinct.patches} "
                "patches; give it the pixels and host batch of one micro-batch (qvl.training.step.model_inputs and "
                "host_batch)"
            )
        grid = distinct.grid_thw
    return _TowerCall(pixels=pixels, grid=grid, inputs=inputs, distinct=distinct, token_id=token_id)


def _vision_embeddings(model, calls: list[_TowerCall], like: torch.Tensor) -> list[torch.Tensor]:
    """The tower's output for each call: what `get_image_features` / `get_video_features` return, concatenated (they
    split it by grid only for Megatron-Bridge's forward to concatenate the pieces again). With the loader's tower
    `inputs`, transformers takes them instead of computing them from the device grid. Given each `distinct` image
    once, the tower encodes those (its inputs are theirs) and every placeholder gets its rows. Where the tower replays
    as CUDA graphs, a micro-batch's images and videos are one call (`together`): one graph per micro-batch, where two
    would wait for each other (qvl.kernels.tower_graphs.TowerGraphs.replay_pending)."""
    visual, graphs = model.visual, tower_graphs(model)
    merged = visual.spatial_merge_size**2
    if graphs is not None and len(calls) == 2 and all(isinstance(call.inputs, TowerInputs) for call in calls):
        first, second = calls
        rows = first.pixels.shape[0]
        inputs = together(first.inputs, second.inputs, rows=rows, merge_unit=merged)
        pixels = torch.cat([first.pixels.type(visual.dtype), second.pixels.type(visual.dtype)])
        output = graphs(pixels, inputs, torch.cat([first.grid, second.grid]))
        check_tower_rows(visual, [output], pixels.shape[0], merged)
        outputs = list(output.split([rows // merged, second.pixels.shape[0] // merged]))
    else:
        outputs = []
        for call in calls:
            pixels = call.pixels.type(visual.dtype)
            if graphs is not None:  # replayed as CUDA graphs (speed-cuda-graphs)
                output = graphs(pixels, call.inputs, call.grid)
            else:
                given = tower_kwargs(call.inputs, visual) if isinstance(call.inputs, TowerInputs) else {}
                output = visual(pixels, grid_thw=call.grid, **given).pooler_output
            check_tower_rows(visual, [output], pixels.shape[0], merged)
            outputs.append(output)
    return [
        (output if call.distinct is None else call.distinct.features(output)).to(like.device, like.dtype)
        for call, output in zip(calls, outputs, strict=True)
    ]


def _embeddings(
    model,
    host: HostBatch,
    *,
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor | None,
    pixel_values: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """The decoder input [s, b, h]: upstream's pre-process with the vision features scattered without host reads."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    if inputs_embeds is None:
        inputs_embeds = model.language_model.embedding(input_ids=input_ids, position_ids=None)
        inputs_embeds = inputs_embeds.transpose(1, 0).contiguous()  # [b, s, h]
    check_placeholders(
        host,
        image_token_id=model.config.image_token_id,
        video_token_id=model.config.video_token_id,
        merge=model.visual.spatial_merge_size,
    )
    kinds = (
        (pixel_values, image_grid_thw, host.image_tower_inputs, host.image_sources, model.config.image_token_id),
        (pixel_values_videos, video_grid_thw, host.video_tower_inputs, host.video_sources, model.config.video_token_id),
    )
    calls = [_tower_call(*kind) for kind in kinds if kind[0] is not None]
    for call, embeds in zip(calls, _vision_embeddings(model, calls, inputs_embeds), strict=True):
        inputs_embeds = inputs_embeds.masked_scatter((input_ids == call.token_id).unsqueeze(-1), embeds)
    inputs_embeds = inputs_embeds.transpose(1, 0)  # [s, b, h]
    if model.config.sequence_parallel:
        pg = model.config._pg_collection
        inputs_embeds = scatter_to_sequence_parallel_region(inputs_embeds, group=pg.tp if pg is not None else None)
    return inputs_embeds


def takes_loader_positions(
    host: HostBatch | None, *, input_ids: Any, position_ids: Any, packed_seq_params: Any
) -> bool:
    """Whether a Qwen2-VL / Qwen2.5-VL forward call is the one `loader_positions_forward` runs: a packed (THD)
    micro-batch with the loader's positions and its host batch."""
    return (
        host is not None
        and input_ids is not None
        and isinstance(position_ids, torch.Tensor)
        and packed_seq_params is not None
        and packed_seq_params.qkv_format == "thd"
    )


def loader_positions_forward(
    model,
    host: HostBatch,
    *,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    pixel_values: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    runtime_gather_output: bool | None,
    packed_seq_params: Any,
    output_processor: Any = None,
    output_processor_context: Any = None,
) -> torch.Tensor:
    """`Qwen25VLModel.forward` for a packed micro-batch of qvl's loader: its positions as given, the vision features
    placed and checked from `host`, nothing read from the device (`takes_loader_positions` says when it applies)."""
    if model.pre_process:
        inputs_embeds = _embeddings(
            model,
            host,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
        )
        inputs_embeds = speed_cuda_graphs.graphable_input(model.config, inputs_embeds)
    return model.language_model.forward(
        input_ids=None,
        position_ids=position_ids,
        attention_mask=attention_mask,
        decoder_input=inputs_embeds,
        labels=labels,
        loss_mask=loss_mask,
        runtime_gather_output=runtime_gather_output,
        packed_seq_params=packed_seq_params,
        output_processor=output_processor,
        output_processor_context=output_processor_context,
    )


def defers_loss_check() -> bool:
    """Whether a training step may check its losses at its end: with the rerun state machine disabled (its other
    modes re-run a micro-batch from `validate_result`). Evaluation and any other caller keep upstream's check."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    return get_rerun_state_machine().mode == RerunMode.DISABLED


@dataclass(kw_only=True, slots=True)
class LossCheck:
    """One training step's micro-batch losses, kept on the device and checked for NaN and Inf once, after it."""

    losses: list[torch.Tensor] = field(default_factory=list)

    def keep(self, loss: torch.Tensor) -> None:
        """Keep a micro-batch's loss (on the device) for the check at the step's end."""
        self.losses.append(loss.detach().reshape(()))

    def handed_to(self, forward_step_func: Any) -> Any:
        """`forward_step_func` with this check as its `loss_check` argument where it takes one (qvl's forward step,
        qvl.training.step.forward_step); any other forward step unchanged (its losses checked upstream's way)."""
        if "loss_check" not in inspect.signature(forward_step_func).parameters:
            return forward_step_func
        return functools.partial(forward_step_func, loss_check=self)

    def raise_if_non_finite(self, iteration: int) -> None:
        """Read this step's micro-batch losses in one transfer; raise if any is NaN or infinite.

        Upstream reads each loss twice as it is computed (NaN, then Inf), which makes the host wait for the GPU inside
        the pipeline of micro-batches. Here the GPU runs the whole step first; the read comes after the optimizer
        step, which already waited for the GPU (the grad norm), so it costs one small copy and no idle time."""
        if not self.losses:
            return
        values = torch.stack([loss.float() for loss in self.losses]).tolist()
        bad = [(index, value) for index, value in enumerate(values) if not math.isfinite(value)]
        if bad:
            index, value = bad[0]
            raise NonFiniteLossError(
                f"the loss of micro-batch {index + 1} of {len(values)} at iteration {iteration} is {value} "
                f"({len(bad)} non-finite in this step); training stopped before logging or saving it. Resume from "
                "the last checkpoint with a lower learning rate or a tighter clip_grad, or look at that micro-batch's "
                "data"
            )


def masked_loss(
    loss_mask: torch.Tensor,
    output_tensor,
    *,
    check_for_nan_in_loss: bool,
    check_for_spiky_loss: bool,
    loss_check: LossCheck | None = None,
) -> tuple:
    """Megatron-Bridge's `masked_next_token_loss`; its NaN/Inf check left to `loss_check` (the step's end) if given."""
    from megatron.bridge.training.losses import masked_next_token_loss

    defer = check_for_nan_in_loss and loss_check is not None
    result = masked_next_token_loss(
        loss_mask,
        output_tensor,
        check_for_nan_in_loss=check_for_nan_in_loss and not defer,
        check_for_spiky_loss=check_for_spiky_loss,
    )
    if defer:
        loss_check.keep(result[0])
    return result


def train_step_with_loss_check(original):
    """Megatron-Bridge's `train_step`, its forward step handed a `LossCheck` that is read once after the step."""

    @functools.wraps(original)
    def train_step(forward_step_func, *args, **kwargs):
        if not defers_loss_check():
            return original(forward_step_func, *args, **kwargs)
        check = LossCheck()
        result = original(check.handed_to(forward_step_func), *args, **kwargs)
        global_state = kwargs.get("global_state", args[4] if len(args) > 4 else None)
        iteration = getattr(getattr(global_state, "train_state", None), "step", -1) + 1
        check.raise_if_non_finite(iteration)
        return result

    return train_step
