"""The loader's packed THD batch through a tiny Megatron Qwen-VL equals each sample run on its own.

A packed sequence holds several conversations with their images; attention, mRoPE positions and the
vision tower must keep them independent, and in Qwen3.5-VL's hybrid LM the Gated DeltaNet layers' conv window and
recurrent state too (dense and MoE). fp32 on CPU; 1e-5 covers summation-order noise.
"""

from __future__ import annotations

import types

import pytest
import torch

from qvl.foundation import distributed
from tests.tiny_megatron import tiny_megatron_model


def _image_spans(
    tokens: torch.Tensor, cu: list[int], grid_thw: torch.Tensor, merge: int, image_token: int
) -> list[tuple[int, int]]:
    """Per sub-sequence, the (first, last+1) image indices it owns (images appear in token order)."""
    merged_per_image = (grid_thw.prod(-1) // merge**2).tolist()
    spans, image = [], 0
    for a, b in zip(cu[:-1], cu[1:]):
        pads, first = int((tokens[a:b] == image_token).sum()), image
        while pads > 0:
            pads -= merged_per_image[image]
            image += 1
        spans.append((first, image))
    return spans


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_vl", "qwen3_5_vl_moe"])
def test_packed_forward_equals_per_sample_forward(family, tmp_path, cpu_runtime):
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.load import build_packed_datasets
    from qvl.data.samples import write_sample_dataset
    from qvl.launchers.cli import main
    from qvl.training.step import model_inputs

    jsonl, media = write_sample_dataset(tmp_path / "samples", count=12, with_bad=False)
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", family)
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(jsonl),
                "--media-root",
                str(media),
                "--family",
                family,
                "--hf-path",
                str(hf),
                "--seq-length",
                "512",
                "--output",
                str(tmp_path / "data"),
            ]
        )
        == 0
    )
    distributed.init_distributed()
    try:
        model, _ = tiny_megatron_model(family, hf=hf, speed=False)
        model.eval()
        config = types.SimpleNamespace(
            path=str(tmp_path / "data"), hf_path=str(hf), family=family, micro_batch_size=1, num_workers=0
        )
        loader, _, _ = build_packed_datasets(config, None)
        batch = next(iter(loader))
        kwargs, _ = model_inputs(batch, torch.device("cpu"))
        cu = batch.cu_seqlens_q.tolist()
        assert len(cu) > 2, "the test needs a pack of several samples"
        with torch.no_grad():
            packed = model(**{k: v for k, v in kwargs.items() if k not in ("labels", "loss_mask")})[0]
            tokens, grids, pixels = batch.tokens[0], batch.image_grid_thw, batch.pixel_values
            rows = torch.cat([torch.zeros(1, dtype=torch.long), grids.prod(-1).cumsum(0)]).tolist()
            spans = _image_spans(tokens, cu, grids, merge=2, image_token=model.config.image_token_id)
            for (a, b), (i, j) in zip(zip(cu[:-1], cu[1:]), spans):
                alone = model(
                    input_ids=tokens[a:b][None],
                    attention_mask=None,
                    position_ids=None,
                    pixel_values=pixels[rows[i] : rows[j]] if j > i else None,
                    image_grid_thw=grids[i:j] if j > i else None,
                )[0]
                torch.testing.assert_close(packed[a:b], alone, rtol=1e-5, atol=1e-5)
    finally:
        distributed.destroy_distributed()
