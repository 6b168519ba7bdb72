"""Aligned widths (qvl.kernels.speed_aligned_widths): Qwen2.5-VL's vision MLP width 3420 is built as 3456 with zero padding, and
the padded model IS the unpadded one: equal outputs, equal gradients, exactly zero gradients on the padding (so AdamW
keeps it zero), a bit-exact HF -> Megatron -> HF round trip that passes `verify`, and the planner counting it.

The tiny Qwen2.5-VL tower here is the family record's with a misaligned MLP width (60 -> 64), so the mechanism runs
at test size."""

from __future__ import annotations

import copy

import pytest
import torch

from qvl.bridges.tiny_model import tiny_hf_config
from qvl.kernels import speed_aligned_widths
from qvl.recipes.architectures import get_architecture, hf_config

MISALIGNED = 60  # the tiny tower's MLP width here: 64 once padded


def misaligned_tiny_config():
    """The tiny Qwen2.5-VL config (family record) with a vision MLP width that is not a multiple of 64."""
    config = tiny_hf_config("qwen2_5_vl")
    config.vision_config.intermediate_size = MISALIGNED
    return config


def test_only_misaligned_hf_tower_widths_are_padded():
    real = hf_config(get_architecture("qwen2_5_vl", "3b")).vision_config
    padded, changes = speed_aligned_widths.padded_vision_config(real)
    assert changes == {"intermediate_size": (3420, 3456)} and padded.intermediate_size == 3456
    assert real.intermediate_size == 3420  # the checkpoint's config object is never changed
    assert padded.hidden_size == real.hidden_size and padded.depth == real.depth
    for family, size in [("qwen2_vl", "2b"), ("qwen3_vl", "4b")]:  # aligned already (1280 x 4; 4096)
        vision = hf_config(get_architecture(family, size)).vision_config
        assert speed_aligned_widths.padded_vision_config(vision) == (vision, {}), family
    # Qwen3-VL-8B's 4304 sits in Megatron's own (TP-split) tower, which this mechanism does not build.
    large = hf_config(get_architecture("qwen3_vl", "8b")).vision_config
    assert large.intermediate_size % 64 and speed_aligned_widths.padded_vision_config(large) == (large, {})
    assert (
        speed_aligned_widths.aligned(3420) == 3456
        and speed_aligned_widths.aligned(3456) == 3456
        and speed_aligned_widths.aligned(1) == 64
    )


def test_pad_and_strip_touch_only_the_mlp_width():
    up = torch.randn(60, 32)
    assert speed_aligned_widths.pad_to_parameter("visual.blocks.0.mlp.up_proj.weight", up, (64, 32)).shape == (64, 32)
    padded_down = speed_aligned_widths.pad_to_parameter("visual.blocks.0.mlp.down_proj.weight", up.T, (32, 64))
    assert padded_down.shape == (32, 64) and torch.equal(padded_down[:, :60], up.T) and not padded_down[:, 60:].any()
    bias = speed_aligned_widths.pad_to_parameter("visual.blocks.3.mlp.gate_proj.bias", torch.ones(60), (64,))
    assert torch.equal(bias, torch.cat([torch.ones(60), torch.zeros(4)]))
    # Not an MLP width, or not the aligned width: left alone for the shape check to report.
    assert speed_aligned_widths.pad_to_parameter("visual.blocks.0.attn.qkv.weight", up, (64, 32)) is up
    assert speed_aligned_widths.pad_to_parameter("visual.blocks.0.mlp.up_proj.weight", up, (128, 32)) is up
    assert speed_aligned_widths.pad_to_parameter("visual.blocks.0.mlp.down_proj.bias", torch.ones(60), (64,)).shape == (
        60,
    )
    layer = torch.nn.Linear(32, 64)
    assert speed_aligned_widths.strip_to_hf(layer, "visual.blocks.0.mlp.up_proj.weight", layer.weight) is layer.weight
    setattr(layer, speed_aligned_widths.HF_WIDTH_ATTRIBUTE, {"weight": (0, 60), "bias": (0, 60)})
    assert speed_aligned_widths.strip_to_hf(layer, "x.mlp.up_proj.weight", layer.weight).shape == (60, 32)
    assert speed_aligned_widths.strip_to_hf(layer, "x.mlp.up_proj.bias", layer.bias).shape == (60,)


def _towers(dtype: torch.dtype):
    """The tiny misaligned HF tower and the same weights built padded (hook-zeroed, then loaded)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower

    config = misaligned_tiny_config().vision_config
    config._attn_implementation = "sdpa"
    padded_config, changes = speed_aligned_widths.padded_vision_config(config)
    torch.manual_seed(0)
    tower = Tower._from_config(config).to(dtype)
    padded = Tower._from_config(padded_config).to(dtype)
    assert padded.blocks[0].mlp.gate_proj.weight[MISALIGNED:].abs().sum() > 0  # HF initialised every row
    speed_aligned_widths.zero_padding([padded], changes=changes)
    assert not padded.blocks[0].mlp.down_proj.weight[:, MISALIGNED:].any()
    padded_shapes = {k: v.shape for k, v in padded.state_dict().items()}
    padded.load_state_dict(
        {
            k: speed_aligned_widths.pad_to_parameter(f"visual.{k}", v, padded_shapes[k])
            for k, v in tower.state_dict().items()
        }
    )
    return tower, padded


def _slices(shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(0, size) for size in shape)


def test_padded_tower_is_the_unpadded_tower_through_training_steps():
    tower, padded = _towers(torch.float64)
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])
    x = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, dtype=torch.float64)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (tower, padded)]
    reference = dict(tower.named_parameters())
    for step in range(3):
        outputs = [m(x, grid_thw=grid).pooler_output for m in (tower, padded)]
        assert torch.equal(outputs[0], outputs[1]), step  # the padded units add exact zeros
        for out in outputs:
            out.square().sum().backward()
        for name, param in padded.named_parameters():
            expected = reference[name]
            inside = _slices(expected.shape)
            torch.testing.assert_close(param.grad[inside], expected.grad, rtol=1e-12, atol=1e-15)
            outside = param.grad.clone()
            outside[inside] = 0
            assert not outside.any(), (step, name)  # the padding's gradient is exactly zero
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for name, param in padded.named_parameters():
        expected = reference[name]
        torch.testing.assert_close(param[_slices(expected.shape)], expected, rtol=1e-12, atol=1e-15)
    mlp = padded.blocks[0].mlp
    assert not mlp.gate_proj.weight[MISALIGNED:].any() and not mlp.up_proj.bias[MISALIGNED:].any()
    assert not mlp.down_proj.weight[:, MISALIGNED:].any()  # AdamW kept the padding at zero


@pytest.fixture(scope="module")
def misaligned_checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-VL HF checkpoint (weights, tokenizer, processor) whose vision MLP width is misaligned."""
    from transformers import AutoModelForImageTextToText

    from qvl.bridges.tiny_model import VOCAB_SIZE
    from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

    path = tmp_path_factory.mktemp("misaligned") / "hf"
    torch.manual_seed(2)
    model = AutoModelForImageTextToText.from_config(misaligned_tiny_config(), dtype=torch.float32)
    with torch.no_grad():  # biases and norms away from HF's 0 / 1 initialisation, so the comparisons see them
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    write_tiny_hf_processor_dir(path, "qwen2_5_vl", vocab_size=VOCAB_SIZE)
    return path


@pytest.fixture(scope="module")
def imported(misaligned_checkpoint, tmp_path_factory):
    """The misaligned checkpoint through `qvl convert import` (streamed, fp32)."""
    from qvl.bridges import convert
    from qvl.foundation.distributed import run_on_ranks

    megatron = tmp_path_factory.mktemp("imported") / "megatron"
    run_on_ranks(convert.import_on_rank, str(misaligned_checkpoint), str(megatron), "fp32", cpu=True)
    return megatron


def _assert_verified(report: dict) -> None:
    assert report["ok"] and report["tensors_different"] == [], report
    assert report["max_abs_diff"] <= 1e-6 and report["tensors_compared"] > 50


def test_import_pads_export_strips_and_verify_passes(misaligned_checkpoint, imported, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForImageTextToText

    from qvl.bridges import convert
    from qvl.foundation.distributed import run_on_ranks

    metadata = dcp.FileSystemReader(str(imported / "iter_0000000")).read_metadata().state_dict_metadata
    widths = {
        k: tuple(m.size) for k, m in metadata.items() if k.endswith((".mlp.gate_proj.weight", ".mlp.down_proj.weight"))
    }
    assert widths and all(64 in shape and MISALIGNED not in shape for shape in widths.values()), widths
    (report,) = run_on_ranks(convert.verify_on_rank, str(misaligned_checkpoint), str(imported), None, True, cpu=True)
    _assert_verified(report)
    run_on_ranks(convert.export_on_rank, str(imported), str(tmp_path / "export"), cpu=True)
    original = AutoModelForImageTextToText.from_pretrained(str(misaligned_checkpoint), dtype=torch.float32)
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    assert exported.config.vision_config.intermediate_size == MISALIGNED
    original, exported = original.state_dict(), exported.state_dict()
    assert original.keys() == exported.keys()
    assert [k for k in original if not torch.equal(original[k], exported[k])] == []


@pytest.mark.slow
def test_verify_strips_across_two_pipeline_stages(misaligned_checkpoint, imported):
    """PP=2: the tower lives on the first stage; the last stage receives its stripped tensors by broadcast."""
    from qvl.bridges import convert
    from qvl.foundation.distributed import run_on_ranks

    reports = run_on_ranks(
        convert.verify_on_rank, str(misaligned_checkpoint), str(imported), None, True, pipeline_parallel=2, cpu=True
    )
    (report,) = [r for r in reports if r is not None]
    _assert_verified(report)


def test_planner_counts_the_padded_width():
    from qvl.bridges.providers import provider_from_hf
    from qvl.recipes.shapes import model_shapes, vision_param_count

    config = hf_config(get_architecture("qwen2_5_vl", "3b"))
    provider = provider_from_hf(copy.deepcopy(config))
    assert provider.vision_config.intermediate_size == 3456
    assert config.vision_config.intermediate_size == 3420
    _, vision = model_shapes(provider)
    assert vision.intermediate_size == 3456  # FLOPs and activation memory read this shape
    unpadded = copy.copy(provider)
    unpadded.vision_config = config.vision_config
    blocks, width, extra = 32, 1280, 3456 - 3420
    # per block: gate and up gain `extra` rows and biases, down gains `extra` columns
    assert vision_param_count(provider) - vision_param_count(unpadded) == blocks * (
        2 * extra * (width + 1) + width * extra
    )


@pytest.mark.slow
def test_padded_tower_trains_resumes_bit_exactly_and_exports_unpadded(misaligned_checkpoint, tmp_path):
    """Megatron-Bridge's loop (distributed optimizer, AdamW with weight decay) on the misaligned tiny model: a run
    stopped and resumed repeats every loss bit for bit, the padding is still exactly zero in the trained checkpoint,
    and the export is HF-shaped."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForImageTextToText

    from qvl.bridges.convert import copy_hf_side_files
    from qvl.data.samples import write_sample_dataset
    from qvl.training.loop import read_losses
    from tests.run_qvl import qvl_in_process as qvl

    jsonl, media = write_sample_dataset(tmp_path / "samples", count=16, with_bad=False)
    data = tmp_path / "data"
    qvl("data", "prepare", "--input", str(jsonl), "--media-root", str(media), "--family", "qwen2_5_vl",
         "--hf-path", str(misaligned_checkpoint), "--seq-length", "256", "--output", str(data))  # fmt: skip
    common = ["qwen2_5_vl_3b_pretrain", "train_iters=4", "global_batch_size=2", "micro_batch_size=1", "seq_length=256",
              "warmup_iters=1", "lr=1e-3", "save_interval=100", "log_interval=1", f"data={data}",
              f"hf_path={misaligned_checkpoint}", "--model", "tiny", "--device", "cpu"]  # fmt: skip
    qvl("train", *common, "--run-dir", str(tmp_path / "full"))
    qvl("train", *common, "--run-dir", str(tmp_path / "resumed"), "--stop-after", "2")
    qvl("train", *common, "--run-dir", str(tmp_path / "resumed"))
    full, resumed = read_losses(tmp_path / "full"), read_losses(tmp_path / "resumed")
    assert sorted(full) == [1, 2, 3, 4] and resumed == full  # bit-identical floats
    checkpoints = tmp_path / "full" / "checkpoints"
    path = checkpoints / "iter_0000004"
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    names = [k for k in metadata if k.endswith(("mlp.gate_proj.weight", "mlp.up_proj.bias", "mlp.down_proj.weight"))]
    tensors = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in names}
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert len(tensors) == 3 * 4  # three padded parameters in each of the tower's four blocks
    for name, tensor in tensors.items():
        inside, padding = tensor.split([MISALIGNED, 64 - MISALIGNED], dim=1 if "down_proj" in name else 0)
        assert inside.abs().sum() > 0 and not padding.any(), name  # trained, and the padding still exactly zero
    copy_hf_side_files(misaligned_checkpoint, checkpoints / "hf")
    qvl("convert", "export", str(checkpoints), str(tmp_path / "export"), "--device", "cpu")
    exported = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    assert exported.config.vision_config.intermediate_size == MISALIGNED
    assert exported.model.visual.blocks[0].mlp.down_proj.weight.shape[1] == MISALIGNED


@pytest.mark.gpu
def test_padded_mlp_matches_the_unpadded_one_on_cuda_bf16():
    """The real width (3420 -> 3456) in bf16 on the GPU: the padded GEMMs give the unpadded outputs and gradients
    within bf16 rounding (the padding adds exact zeros, cuBLAS may order the sums differently), zero padding grads."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    config = hf_config(get_architecture("qwen2_5_vl", "3b")).vision_config
    padded_config, changes = speed_aligned_widths.padded_vision_config(config)
    torch.manual_seed(0)
    mlp = Qwen2_5_VLMLP(config, bias=True).to("cuda", torch.bfloat16)
    padded = Qwen2_5_VLMLP(padded_config, bias=True).to("cuda", torch.bfloat16)
    shapes = {k: v.shape for k, v in padded.state_dict().items()}
    padded.load_state_dict(
        {k: speed_aligned_widths.pad_to_parameter(f"x.mlp.{k}", v, shapes[k]) for k, v in mlp.state_dict().items()}
    )
    x = torch.randn(8192, 1280, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, out_padded = mlp(x), padded(x)
    torch.testing.assert_close(out_padded, out, rtol=1.6e-2, atol=1e-2)
    (grad_x,) = torch.autograd.grad(out.float().square().sum(), x)
    out_padded.float().square().sum().backward()
    torch.testing.assert_close(x.grad, grad_x, rtol=1.6e-2, atol=1e-2)
    assert not padded.gate_proj.weight.grad[3420:].any() and not padded.up_proj.bias.grad[3420:].any()
    assert not padded.down_proj.weight.grad[:, 3420:].any()
    assert changes == {"intermediate_size": (3420, 3456)}
