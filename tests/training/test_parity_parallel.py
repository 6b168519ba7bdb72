"""Training parity through qvl's parallel paths: tensor parallel 2 (with sequence parallelism, the recipes' default,
and for Qwen2.5-VL without), pipeline parallel 2, and data parallel 2 (with the vision work balanced over the
replicas for Qwen2.5-VL), each on two gloo processes, against transformers' single-process Trainer on the same
conversations (docs/parity.md). Tiny Qwen2.5-VL and Qwen3.5-VL (its Gated DeltaNet layers split over TP, its hybrid
layer pattern over PP, its MTP head trained), and Qwen3-VL-MoE at expert, pipeline and tensor parallel 2, fp32, the
parity sample set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.test_parity import OPTIONS, SEQ_LENGTH, STEPS

pytestmark = pytest.mark.slow
FAMILY = "qwen2_5_vl"
LAYOUTS = {
    "tp2": {"tensor_parallel": 2},  # with sequence parallelism, on with TP unless asked otherwise
    "tp2_no_sp": {"tensor_parallel": 2, "sequence_parallel": False},
    "pp2": {"pipeline_parallel": 2},
    "dp2_vision_balance": {"vision_balance": True},
}
# Qwen3.5-VL: its Megatron vision tower is split over TP itself, so data parallelism without vision balancing
QWEN3_5_LAYOUTS = {"tp2": {"tensor_parallel": 2}, "pp2": {"pipeline_parallel": 2}, "dp2": {}}
MOE_LAYOUTS = {
    "ep2": {"expert_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "tp2": {"tensor_parallel": 2},
    # the experts as grouped GEMMs (patch group speed-grouped-experts): token counts from the all-to-all dispatcher,
    # and each expert's weights split over the TP ranks
    "ep2_grouped": {"expert_parallel": 2, "grouped_experts": True},
    "tp2_grouped": {"tensor_parallel": 2, "grouped_experts": True},
}


def parity_on_ranks(hf_path: str, data: str, root: str, layouts: dict | None = None) -> dict:
    """On each rank: every layout's parity run in turn (one spawn and one Megatron import for all three)."""
    from megatron.core import parallel_state

    from qvl.training.parity.run import ParitySpec, run_parity

    reports = {}
    for name, options in (layouts or LAYOUTS).items():
        parallel_state.destroy_model_parallel()  # Megatron-Bridge sets the layout up itself
        spec = ParitySpec(
            hf_path=Path(hf_path),
            data=Path(data),
            run_dir=Path(root) / name,
            steps=STEPS,
            options={**OPTIONS, **options},
        )
        report = run_parity(spec)
        reports[name] = report.as_dict() if report is not None else None
    return reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.foundation.distributed import run_on_ranks
    from qvl.training.parity.samples import prepare_parity_dataset

    root = tmp_path_factory.mktemp("parity_parallel")
    hf = write_tiny_hf_checkpoint(root / "hf", FAMILY)
    data = prepare_parity_dataset(hf, FAMILY, root, seq_length=SEQ_LENGTH)
    ranks = run_on_ranks(parity_on_ranks, str(hf), str(data), str(root), world_size=2, cpu=True)
    assert all(report is None for report in ranks[1].values()), "only rank 0 trains the reference"
    return ranks[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_takes_the_single_process_transformers_step(reports, layout):
    report = reports[layout]
    assert report["ok"], report["failures"]
    assert report["conversations"] == 4 and report["tensors_compared"] > 50 and not report["mask_mismatches"]
    # each of the four conversations exactly once per step, however the packs were spread over the ranks
    # (16 + 12 + 13 + 10 learned tokens with the tiny tokenizer; a pack read by both replicas would give 56 or 46)
    assert report["learned_tokens"] == 51
    assert [r["step"] for r in report["steps"]] == list(range(1, STEPS + 1))
    if layout.startswith("dp2"):
        assert any("data parallel: 2 replicas" in note for note in report["deliberate"])


@pytest.fixture(scope="module")
def qwen3_5_reports(tmp_path_factory) -> dict:
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.foundation.distributed import run_on_ranks
    from qvl.training.parity.samples import prepare_parity_dataset

    root = tmp_path_factory.mktemp("parity_parallel_qwen3_5")
    hf = write_tiny_hf_checkpoint(root / "hf", "qwen3_5_vl")
    data = prepare_parity_dataset(hf, "qwen3_5_vl", root, seq_length=SEQ_LENGTH)
    ranks = run_on_ranks(parity_on_ranks, str(hf), str(data), str(root), QWEN3_5_LAYOUTS, world_size=2, cpu=True)
    return ranks[0]


@pytest.mark.parametrize("layout", list(QWEN3_5_LAYOUTS))
def test_qwen3_5_parallel_layout_takes_the_single_process_transformers_step(qwen3_5_reports, layout):
    report = qwen3_5_reports[layout]
    assert report["ok"], report["failures"]
    assert report["conversations"] == 4 and report["tensors_compared"] > 50 and not report["mask_mismatches"]
    assert report["gate_tensors"] >= 6  # the decay gates too, at the common tolerances
    # the recipe's multi-token-prediction head trained and compared through the layout as well
    assert report["mtp_tensors"] >= 10 and all(r["mtp_loss_qvl"] is not None for r in report["steps"])
    assert [r["step"] for r in report["steps"]] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory) -> dict:
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.foundation.distributed import run_on_ranks
    from qvl.training.parity.samples import prepare_parity_dataset

    root = tmp_path_factory.mktemp("parity_parallel_moe")
    hf = write_tiny_hf_checkpoint(root / "hf", "qwen3_vl_moe")
    data = prepare_parity_dataset(hf, "qwen3_vl_moe", root, seq_length=SEQ_LENGTH)
    return run_on_ranks(parity_on_ranks, str(hf), str(data), str(root), MOE_LAYOUTS, world_size=2, cpu=True)[0]


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_parallel_layout_takes_the_single_process_transformers_step(moe_report, layout):
    """Qwen3-VL-MoE with its experts split over two processes (Megatron-Core's all-to-all token dispatcher on gloo);
    its layers over two pipeline stages (each pack padded to seq_length: the load-balancing loss must leave the pad
    out, qvl.kernels.fix_moe_pad_tokens); tensor parallel with sequence parallelism (which an MoE layer needs with TP:
    each rank routes its share of the pack, and the deepstack features' gradient is summed over the ranks,
    qvl.kernels.fix_qwen3_vl_deepstack_sp): transformers' step, with Megatron-Core's balancing loss where one model
    replica trains, every expert's weights compared under their HF names."""
    report = moe_report[layout]
    assert report["ok"], report["failures"]
    assert report["conversations"] == 4 and report["tensors_compared"] > 50
    assert [r["step"] for r in report["steps"]] == list(range(1, STEPS + 1))
    # one model replica: the reference adds the balancing loss too (off with data parallelism)
    if not layout.startswith("ep2"):
        assert all(r["moe_aux_loss_qvl"] and r["moe_aux_loss_hf"] for r in report["steps"])
