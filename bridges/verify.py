"""Prove a conversion: the Megatron model's logits against the HF model's, and every exported tensor
against the HF checkpoint's, on a fixed multimodal input (two images of different sizes, multi-turn
text, and a short video). Works at any TP/PP layout of the Megatron model (collective).

A checkpoint with a multi-token-prediction head (Qwen3.5's `mtp.*`) is also checked there: Megatron-Core's MTP
block's logits against the published head's (qvl.bridges.mtp_reference), which transformers does not build."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from qvl.bridges.consistency import config_token_id, read_config
from qvl.foundation.errors import ConversionError

# fp32 CPU parity measured for all four families is <= 3e-7; bf16 checkpoints are compared in fp32.
DEFAULT_TOLERANCE = 1e-4


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    """What `verify` measured; `ok` is the verdict against `tolerance`."""

    max_abs_diff: float
    mean_abs_diff: float
    top1_agreement: float
    tokens: int
    tensors_compared: int
    tensors_different: list[str] = field(default_factory=list)
    tolerance: float = DEFAULT_TOLERANCE
    # the first MTP depth's logits against the published MTP head's (None: the model has no MTP layers)
    mtp_max_abs_diff: float | None = None
    mtp_top1_agreement: float | None = None

    @property
    def ok(self) -> bool:
        mtp_ok = self.mtp_max_abs_diff is None or self.mtp_max_abs_diff <= self.tolerance
        return self.max_abs_diff <= self.tolerance and mtp_ok and not self.tensors_different

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _image(height: int, width: int, seed: int):
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    return Image.fromarray(pixels)


def reference_inputs(hf_path: Path, *, video: bool = True) -> dict:
    """Deterministic processor outputs: two images of different sizes in a multi-turn chat, plus a video."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(hf_path))
    content = [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "A red square on a blue background."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    kwargs = {"images": [_image(56, 84, 0), _image(112, 56, 1)]}
    if video:
        messages.append({"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]})
        frames = np.stack([np.asarray(_image(64, 64, 10 + i)) for i in range(4)])
        kwargs["videos"] = [frames]
        kwargs["videos_kwargs"] = {"do_sample_frames": False}
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return dict(processor(text=[text], return_tensors="pt", **kwargs))


# Image grids (t, h, w) in patches for inputs built from config.json alone: two images of different shapes.
CONFIG_ONLY_GRIDS = ((1, 4, 6), (1, 8, 4))


def config_inputs(hf_path: Path) -> dict:
    """Deterministic test inputs from config.json alone, for a checkpoint saved without tokenizer or processor
    files: random text ids around two images whose placeholder tokens and pixel patches follow the vision config.
    The logit comparison needs only that both models see the same ids and pixels, not real text or images."""
    config = read_config(hf_path)
    vision, text = config["vision_config"], config.get("text_config", config)
    merge, patch = vision["spatial_merge_size"], vision["patch_size"]
    channels, temporal = vision.get("in_channels", 3), vision["temporal_patch_size"]
    ids = {f: config_token_id(config, f) for f in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    missing = [f for f, v in ids.items() if v is None]
    if missing:
        raise ConversionError(f"{hf_path}/config.json has no {', '.join(missing)}; verify cannot place image tokens")
    rng = np.random.default_rng(0)
    low = max(ids.values()) + 1  # ordinary text ids above the special tokens, inside the vocabulary
    words = lambda n: rng.integers(low, min(text["vocab_size"], low + 1000), n).tolist()  # noqa: E731
    tokens = words(8)
    for t, h, w in CONFIG_ONLY_GRIDS:
        tokens += [ids["vision_start_token_id"], *[ids["image_token_id"]] * (t * h * w // merge**2)]
        tokens += [ids["vision_end_token_id"], *words(5)]
    patches = sum(t * h * w for t, h, w in CONFIG_ONLY_GRIDS)
    input_ids = torch.tensor([tokens])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == ids["image_token_id"]).long(),  # 1 marks image tokens, as processors do
        "pixel_values": torch.from_numpy(rng.standard_normal((patches, channels * temporal * patch * patch))).float(),
        "image_grid_thw": torch.tensor(CONFIG_ONLY_GRIDS),
    }


def hf_logits(hf_path: Path, inputs: dict) -> torch.Tensor:
    """Logits of the HF model in fp32 on CPU."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(hf_path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs).logits.float()


def hf_logits_and_mtp(hf_path: Path, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the HF model and of the checkpoint's MTP head (the published definition,
    qvl.bridges.mtp_reference; transformers builds none), in fp32 on CPU."""
    from transformers import AutoModelForImageTextToText

    from qvl.bridges.mtp_reference import hf_logits_with_mtp, load_mtp_head

    model = AutoModelForImageTextToText.from_pretrained(str(hf_path), dtype=torch.float32).eval()
    return hf_logits_with_mtp(model, load_mtp_head(model, Path(hf_path)).eval(), inputs)


def megatron_logits(model_chunks: list, inputs: dict, *, mtp: bool = False) -> torch.Tensor | None:
    """Logits of a Megatron Qwen-VL model split over TP/PP ranks; every rank of the last stage returns them. With
    `mtp` (a model with MTP layers), each depth's logits follow the main ones along the sequence
    ([b, (1 + depths) * s, v]): patch group "fix-mtp-loss" hands the MTP states to the output layer
    (qvl.kernels.fix_mtp_loss)."""
    from megatron.core import parallel_state

    from qvl.foundation import patches
    from qvl.kernels import fix_mtp_loss

    model = model_chunks[0]
    model.eval()
    kwargs = {
        k: inputs[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw") if k in inputs
    }
    if "second_per_grid_ts" in inputs:
        kwargs["second_per_grid_ts"] = inputs["second_per_grid_ts"]
    ids = inputs["input_ids"]
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    hidden = model.config.hidden_size
    with torch.no_grad(), patches.applied(*([fix_mtp_loss.GROUP] if mtp else [])):
        if not first:  # receive the previous stage's activations: [s, b, h]
            received = torch.empty(ids.shape[1], ids.shape[0], hidden, dtype=model.config.params_dtype)
            torch.distributed.recv(
                received, group=pp_group, group_src=parallel_state.get_pipeline_model_parallel_rank() - 1
            )
            model.set_input_tensor(received)
        output = model(input_ids=ids, attention_mask=None, position_ids=None, runtime_gather_output=True, **kwargs)
        if not last:
            torch.distributed.send(
                output.contiguous(), group=pp_group, group_dst=parallel_state.get_pipeline_model_parallel_rank() + 1
            )
            return None
    return output.float()


def compare_exported_tensors(bridge, model_chunks: list, hf_path: Path) -> tuple[int, list[str]]:
    """Export every Megatron weight to HF names (gathered over TP/PP) and compare bit-for-bit."""
    from safetensors import safe_open

    files = sorted(Path(hf_path).glob("*.safetensors"))
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({name: path for name in f.keys()})
    exported, different = set(), []
    for name, tensor in bridge.export_hf_weights(model_chunks, cpu=True, show_progress=False):
        exported.add(name)
        if name not in where:
            different.append(f"{name} (not in the HF checkpoint)")
            continue
        with safe_open(str(where[name]), framework="pt") as f:
            reference = f.get_tensor(name)
        if reference.shape != tensor.shape or not torch.equal(reference, tensor.to(reference.dtype)):
            different.append(name)
    different += [f"{name} (never exported)" for name in sorted(set(where) - exported)]
    return len(exported & set(where)), different


def build_report(
    reference: torch.Tensor,
    ours: torch.Tensor,
    compared: int,
    different: list[str],
    tolerance: float,
    *,
    mtp_reference: torch.Tensor | None = None,
) -> VerifyReport:
    """Compare two logit tensors [b, s, v] (ours may carry vocab padding, and MTP logits after the main ones, which
    are compared with `mtp_reference`)."""
    tokens = reference.shape[1]
    ours = ours[..., : reference.shape[-1]]
    diff = (ours[:, :tokens] - reference).abs()
    agreement = (ours[:, :tokens].argmax(-1) == reference.argmax(-1)).float().mean()
    mtp = {}
    if mtp_reference is not None:
        ours_mtp = ours[:, tokens : 2 * tokens]
        mtp["mtp_max_abs_diff"] = float((ours_mtp - mtp_reference).abs().max())
        mtp["mtp_top1_agreement"] = float((ours_mtp.argmax(-1) == mtp_reference.argmax(-1)).float().mean())
    return VerifyReport(
        max_abs_diff=float(diff.max()),
        mean_abs_diff=float(diff.mean()),
        top1_agreement=float(agreement),
        tokens=tokens,
        tensors_compared=compared,
        tensors_different=different,
        tolerance=tolerance,
        **mtp,
    )
