"""The vision tower's gradients with `vision_balance` equal the replicated tower's, through Megatron's own DDP and
`finalize_model_grads` (which AVERAGES the replicated HF tower's gradients over TP): tiny Qwen2-VL and
Qwen2.5-VL built by their recipes, fp32, two gloo processes at TP=2 (one replica) and at DP=2 (one rank holds
every image). Also: each image is encoded once (counted at the tower), and 3 SGD steps give the same losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.numerics import assert_equal_up_to_summation_order

FAMILIES = {"qwen2_vl": "qwen2_vl_2b_sft", "qwen2_5_vl": "qwen2_5_vl_3b_sft"}
# Per DP replica: images (t, h, w patches) of its one packed sequence; replica 1 of the DP=2 layout has none.
IMAGES = ([[1, 8, 8], [1, 8, 12], [1, 4, 8], [1, 12, 8], [1, 4, 4]], [])
TEXT_TOKENS = 24
STEPS, LR = 3, 0.5


def _batch(config, images: list[list[int]], seed: int) -> dict:
    """One packed sequence: each image's placeholders between vision start/end, then text; a loss on every token."""
    generator = torch.Generator().manual_seed(seed)
    ids = []
    for grid in images:
        ids += [config.vision_start_token_id] + [config.image_token_id] * (int(np.prod(grid)) // 4)
        ids += [config.vision_end_token_id]
    ids += torch.randint(10, 500, (TEXT_TOKENS,), generator=generator).tolist()
    tokens = torch.tensor([ids])
    kwargs = dict(input_ids=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=torch.ones(tokens.shape))
    if images:
        vision = config.vision_config
        width = 3 * vision.temporal_patch_size * vision.patch_size**2
        kwargs["pixel_values"] = torch.randn(int(np.prod(images, axis=1).sum()), width, generator=generator)
        kwargs["image_grid_thw"] = torch.tensor(images)
    return kwargs


def _forward_kwargs(batch: dict) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    n = batch["input_ids"].shape[1]
    cu = torch.tensor([0, n], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    return {**batch, "attention_mask": None, "position_ids": None, "packed_seq_params": params}


def train_both_ways(family: str, hf_path: str, tensor_parallel: int) -> dict:
    """On each rank: 3 SGD steps replicated, then the same 3 steps balanced from the same weights; the tower's
    reduced gradients after step 1, the losses and the images each tower call got, per mode."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import unwrap_model

    from qvl.foundation import distributed
    from qvl.recipes.registry import get_recipe
    from qvl.training.step import balanced_vision_inputs

    parallel_state.destroy_model_parallel()
    distributed.init_distributed(tensor_parallel=tensor_parallel)
    cfg = get_recipe(FAMILIES[family]).fn(
        hf_path=hf_path, precision="fp32", tensor_parallel=tensor_parallel, pipeline_parallel=1, sequence_parallel=False
    )
    cfg.model.finalize()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    (model,) = cfg.model.provide_distributed_model(ddp_config=ddp, use_cpu_initialization=True)
    vlm = unwrap_model(model)
    counted = []
    vlm.visual.register_forward_pre_hook(lambda m, a, kw: counted.append(len(kw["grid_thw"])), with_kwargs=True)
    initial = {k: v.clone() for k, v in vlm.state_dict().items() if isinstance(v, torch.Tensor)}
    replica = parallel_state.get_data_parallel_rank()
    batch = _batch(vlm.config, IMAGES[replica], seed=replica)
    out = {}
    for mode in ("replicated", "balanced"):
        vlm.load_state_dict(initial, strict=False)
        counted.clear()
        losses = []
        for step in range(STEPS):
            model.zero_grad_buffer()
            kwargs = _forward_kwargs(batch)
            if mode == "balanced":
                kwargs = balanced_vision_inputs(model, kwargs)
            loss = (model(**kwargs) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            loss.backward()
            finalize_model_grads([model])
            reduced = loss.detach().clone()
            torch.distributed.all_reduce(reduced, group=parallel_state.get_data_parallel_group())
            losses.append(float(reduced))
            if step == 0:
                grads = {n: p.main_grad.clone() for n, p in vlm.visual.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.main_grad
        out[mode] = {"losses": losses, "grads": grads, "images_encoded": sum(counted)}
    return out


def train_all(hf_paths: dict[str, str]) -> dict:
    """Every (family, layout) in one pair of processes (one spawn and one Megatron import: ~40 s saved each)."""
    return {
        (family, layout): train_both_ways(family, hf_paths[family], tp)
        for layout, tp in (("tp2", 2), ("dp2", 1))
        for family in FAMILIES
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.distributed import run_on_ranks

    root = tmp_path_factory.mktemp("tiny_hf")
    for family in FAMILIES:
        tiny_hf_config(family).save_pretrained(root / family)
    ranks = run_on_ranks(train_all, {f: str(root / f) for f in FAMILIES}, world_size=2, cpu=True)
    return {key: [rank[key] for rank in ranks] for key in ranks[0]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tower_gradients_losses_and_encodings_match_the_replicated_tower(results, family, layout):
    ranks = results[family, layout]
    images = sum(len(i) for i in (IMAGES if layout == "dp2" else IMAGES[:1]))
    replicated = sum(r["replicated"]["images_encoded"] for r in ranks)
    balanced = [r["balanced"]["images_encoded"] for r in ranks]
    # Replicated at TP=2 both ranks encode the replica's images; balanced, each image once, on both ranks.
    assert replicated == images * (2 if layout == "tp2" else 1) * STEPS
    assert sum(balanced) == images * STEPS and min(balanced) > 0
    for rank, result in enumerate(ranks):
        want, got = result["replicated"], result["balanced"]
        # Step 1: identical weights, bit-identical embeddings: the same loss bit for bit.
        assert got["losses"][0] == want["losses"][0], rank
        # The tower's gradient: the same per-image terms summed in another order (each rank's share, x2 at TP=2,
        # then the reduction), so equal to float32 rounding; a TP average without the x2 would be off by 50%.
        for name, grad in want["grads"].items():
            assert_equal_up_to_summation_order(got["grads"][name], grad, what=f"{rank} {name}")
        # Later steps start from weights that differ by that rounding only.
        assert got["losses"] == pytest.approx(want["losses"], abs=5e-6), rank
