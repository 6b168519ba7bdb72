"""Training parity with transformers (docs/parity.md): a qvl training step on Megatron-Bridge is the step
transformers' Trainer takes on the same conversations unpacked, for every family, fp32 on CPU.

One tiny model per family (its family record's debug flavour), the parity sample set (multi-turn with two images,
text-only, a video, one image) packed offline into two packs, 3 AdamW steps with the recipe's betas, eps, weight
decay groups, clipping and cosine schedule. qvl's side runs the recipe's fused cross-entropy, which qvl's training
loop makes its own (qvl.kernels.speed_cross_entropy); Megatron-Core's native one rounds the logits' gradient to bf16 even in
fp32 (a test below shows it and that the report names it). Then three deliberate breakages, each of which the check
must catch.

Qwen3.5-VL (dense and MoE): every tensor keeps the fp32 tolerances, the Gated DeltaNet decay-gate parameters too
(named apart in the report, qvl.training.parity.report): both sides run the delta rule token by token on CPU; the
slow test at the end shows on an fp64 run of the same steps that both sides' gate gradients are then within fp32
rounding of exact.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qvl.training.parity.report import TOLERANCES

# The families the parity check covers; a new family is one more name here (its record supplies everything else).
PARITY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl", "qwen3_5_vl_moe")
GATED_DELTA_FAMILIES = ("qwen3_5_vl", "qwen3_5_vl_moe")
STEPS = 3
SEQ_LENGTH = 200  # the four conversations (287 tokens with the tiny processors) make two packs
OPTIONS = {"seq_length": SEQ_LENGTH, "lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 1, "weight_decay": 0.1}


@pytest.fixture(scope="session")
def parity_inputs(tmp_path_factory):
    """family -> (tiny HF checkpoint, the parity dataset prepared with it)."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.training.parity.samples import prepare_parity_dataset

    root = tmp_path_factory.mktemp("parity")
    inputs = {}
    for family in PARITY_FAMILIES:
        hf = write_tiny_hf_checkpoint(root / family / "hf", family)
        inputs[family] = (hf, prepare_parity_dataset(hf, family, root / family, seq_length=SEQ_LENGTH))
    return inputs


def run(parity_inputs, tmp_path, family: str, *, steps: int = STEPS, options=None, batch_hook=None):
    from qvl.training.parity.run import ParitySpec, run_parity

    hf, data = parity_inputs[family]
    spec = ParitySpec(
        hf_path=hf,
        data=data,
        run_dir=tmp_path,
        steps=steps,
        options={**OPTIONS, "warmup_iters": min(1, steps - 1), **(options or {})},
        batch_hook=batch_hook,
    )
    return run_parity(spec)


@pytest.fixture(scope="session")
def reports(parity_inputs, tmp_path_factory):
    """family -> (exit status, JSON report, loss plot) of `qvl verify-training` on the family's tiny model."""
    from qvl.launchers.cli import main

    root = tmp_path_factory.mktemp("parity_runs")
    out = {}
    for family in PARITY_FAMILIES:
        hf, data = parity_inputs[family]
        report, plot = root / f"{family}.json", root / f"{family}.png"
        status = main(
            ["verify-training", str(hf), "--data", str(data), "--steps", str(STEPS), "--run-dir", str(root / family)]
            + ["--report", str(report), "--plot", str(plot), *[f"{k}={v}" for k, v in OPTIONS.items()]]
        )
        out[family] = (status, json.loads(report.read_text()), plot)
    return out


@pytest.mark.slow  # `qvl verify-training` of every family: ~35 s on 2 cores
@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_gradients_and_trajectory_match_transformers(reports, family):
    status, report, plot = reports[family]
    tol = TOLERANCES["fp32"]
    assert status == 0 and report["ok"], report["failures"]
    # The comparison covered what it claims: four conversations, their learned tokens, every tensor, every step.
    assert report["conversations"] == 4 and report["learned_tokens"] > 40
    assert report["tensors_compared"] > 50 and not report["mask_mismatches"]
    steps = report["steps"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert report["token_loss_max_diff"] <= tol.token_loss and report["grad_max_rel_diff"] <= tol.grad
    assert report["weight_max_diff"] <= tol.weight * report["peak_lr"]
    # Only the Gated DeltaNet decay gates (3 tensors per linear-attention layer) get the gate tolerance.
    gated = family in GATED_DELTA_FAMILIES
    assert (report["gate_tensors"] >= 6) if gated else (report["gate_tensors"] == 0)
    assert report["gate_grad_max_rel_diff"] <= tol.gate_grad
    assert report["gate_weight_max_diff"] <= tol.gate_weight * report["peak_lr"]
    assert any(note.startswith("gate parameters:") for note in report["deliberate"]) == gated
    # Qwen3.5's recipes train the checkpoint's multi-token-prediction head: both sides trained it, its loss was
    # compared at every step and its tensors by name.
    mtp_losses = [(r["mtp_loss_qvl"], r["mtp_loss_hf"]) for r in steps]
    if gated:
        assert report["mtp_tensors"] >= 10 and all(ours is not None and ref is not None for ours, ref in mtp_losses)
        assert max(r["mtp_loss_diff"] for r in steps) <= tol.step_loss and mtp_losses[-1][0] < mtp_losses[0][0]
        assert any(note.startswith("multi-token prediction: both sides") for note in report["deliberate"])
    else:
        assert report["mtp_tensors"] == 0 and mtp_losses == [(None, None)] * STEPS
    # The MoE families' load-balancing loss: its value as Megatron-Core's router logs it, at every step.
    balance = [(r["moe_aux_loss_qvl"], r["moe_aux_loss_hf"]) for r in steps]
    if family.endswith("_moe"):
        assert all(ours is not None and ref is not None and ref > 0 for ours, ref in balance), balance
        assert max(r["moe_aux_loss_rel_diff"] for r in steps) <= tol.step_loss
    else:
        assert balance == [(None, None)] * STEPS
    # The schedule: warm-up from 0 over one step, then cosine decay; both frameworks stepped at the same rates.
    assert [r["lr_qvl"] for r in steps] == pytest.approx([0.0, 1e-3, 5.5e-4])
    assert [r["lr_hf"] for r in steps] == pytest.approx([0.0, 1e-3, 5.5e-4])
    # The weights moved (lr > 0 from step 2), and the loss on the repeated batch fell.
    assert steps[-1]["loss_qvl"] < steps[0]["loss_qvl"]
    assert plot.stat().st_size > 1000


@pytest.mark.slow  # reads the `qvl verify-training` reports above
def test_report_names_the_deliberate_differences(reports):
    notes = " ".join(reports["qwen2_5_vl"][1]["deliberate"])
    # Qwen2.5-VL's vision blocks use RMSNorm modules named norm1/norm2: transformers' Trainer would decay them.
    assert "weight decay" in notes and "visual.blocks.0.norm1.weight" in notes
    assert "accepts_loss_kwargs=False" in notes and "calculate_per_token_loss=True" in notes
    assert "cross-entropy" not in notes  # the recipe's fused cross-entropy (qvl's) is exact in fp32
    # the MoE families: Megatron-Core's load-balancing loss on both sides, compared through the router gradients
    assert "both sides added Megatron-Core's aux_loss" in " ".join(reports["qwen3_vl_moe"][1]["deliberate"])
    assert "both sides added Megatron-Core's global_aux_loss" in " ".join(reports["qwen3_5_vl_moe"][1]["deliberate"])


def test_bad_input_is_one_error_line(tmp_path, capsys):
    from qvl.launchers.cli import main

    assert main(["verify-training", str(tmp_path / "nowhere"), "--data", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_native_fused_cross_entropy_rounds_the_logit_gradient_to_bf16(parity_inputs, tmp_path, monkeypatch):
    """Where qvl's cross-entropy does not replace it (Transformer Engine or Apex installed; here by hand),
    Megatron-Core's native fused cross-entropy casts dL/dlogits to bf16 even in fp32 training
    (megatron/core/fusions/fused_cross_entropy.py, calculate_gradients): the losses stay exact, every gradient is off
    by bf16 rounding (2^-9 relative), the fp32 check fails on it and the report names it. (Every other test here runs
    the recipe's fused cross-entropy as qvl trains it, and passes the fp32 tolerances.)"""
    from qvl.kernels import speed_cross_entropy
    from qvl.training.parity import run as parity_run

    monkeypatch.setattr(speed_cross_entropy, "lean_fused_cross_entropy", lambda original: original)
    monkeypatch.setattr(parity_run, "lean_cross_entropy", lambda device: False)
    report = run(parity_inputs, tmp_path, "qwen2_5_vl", steps=1, options={"model.cross_entropy_loss_fusion": True})
    assert report.token_loss_max_diff <= TOLERANCES["fp32"].token_loss
    assert report.steps[0].loss_diff <= TOLERANCES["fp32"].step_loss
    assert 1e-4 < report.grad_max_rel_diff < 1e-2
    assert any(f.startswith("gradient of") for f in report.failures)
    assert any("rounds the logits' gradient to bf16" in note for note in report.deliberate)


def _prompt_position(batch) -> int:
    """A prompt token of the first conversation (not learned) whose next token is not learned either."""
    learned = batch.loss_mask[0] > 0
    return int((~learned[:-1] & ~learned[1:]).nonzero()[3])


def unmask_a_prompt_token(batch, model):
    position = _prompt_position(batch)
    labels, loss_mask = batch.labels.clone(), batch.loss_mask.clone()
    labels[0, position], loss_mask[0, position] = batch.tokens[0, position + 1], 1.0
    return dataclasses.replace(batch, labels=labels, loss_mask=loss_mask)


def join_the_first_two_conversations(batch, model):
    cu = batch.cu_seqlens_q
    joined = torch.cat([cu[:1], cu[2:]])
    return dataclasses.replace(batch, cu_seqlens_q=joined, cu_seqlens_kv=joined.clone(), max_seqlen=int(cu[2]))


class ShiftOneImagesPositions:
    """The first image's mRoPE positions one higher in every dimension, where the language model turns them into
    rotary angles (Megatron-Core GPTModel calls `rotary_pos_emb(position_ids, mrope_section, ...)`)."""

    def __init__(self, image_token_id: int):
        self.image_token_id, self.span, self.hooked = image_token_id, None, False

    def __call__(self, batch, model):
        from megatron.core.utils import unwrap_model

        image = (batch.tokens[0] == self.image_token_id).nonzero().flatten()
        if len(image):
            grid = batch.image_grid_thw[0]
            self.span = (int(image[0]), int(image[0]) + int(grid.prod()) // 4)
        else:
            self.span = None
        if not self.hooked:
            unwrap_model(model).language_model.rotary_pos_emb.register_forward_pre_hook(self.shift)
            self.hooked = True
        return batch

    def shift(self, module, args):
        if self.span is None:
            return args
        positions = args[0].clone()  # [3, batch, tokens]
        positions[..., self.span[0] : self.span[1]] += 1
        return (positions, *args[1:])


@pytest.mark.parametrize(
    "family, breakage, failure",
    [
        ("qwen2_5_vl", "unmask", "learned tokens differ"),
        ("qwen2_5_vl", "positions", "per-token loss differs"),
        ("qwen2_5_vl", "crossing", "per-token loss differs"),
        # Gated DeltaNet: a conversation's recurrent state and conv window flowing into the next one
        ("qwen3_5_vl", "crossing", "per-token loss differs"),
    ],
)
def test_a_deliberate_breakage_fails_the_check(parity_inputs, tmp_path, family, breakage, failure):
    from qvl.foundation.families import TINY_TOKEN_IDS

    hooks = {
        "unmask": unmask_a_prompt_token,
        "positions": ShiftOneImagesPositions(TINY_TOKEN_IDS["image_token_id"]),
        "crossing": join_the_first_two_conversations,
    }
    report = run(parity_inputs, tmp_path, family, steps=1, batch_hook=hooks[breakage])
    assert not report.ok
    assert any(failure in f for f in report.failures), report.failures


def test_mtp_targets_one_token_early_fail_the_check(parity_inputs, tmp_path, monkeypatch):
    """The MTP head taught the next token (its targets left unshifted) instead of the one after: the check names the
    MTP loss."""
    import qvl.training.mtp

    monkeypatch.setattr(qvl.training.mtp, "shift_in_sequences", lambda tensor, cu_seqlens: tensor)
    report = run(parity_inputs, tmp_path, "qwen3_5_vl", steps=1)
    assert any("MTP loss differs" in f for f in report.failures), report.failures


def test_a_load_balancing_loss_twice_as_large_fails_the_check(parity_inputs, tmp_path, monkeypatch):
    """qvl's side with Megatron-Core's load-balancing loss doubled: the router gradients and the logged value give it
    away."""
    from megatron.core.transformer.moe import router

    upstream = router.switch_load_balancing_loss_func
    monkeypatch.setattr(router, "switch_load_balancing_loss_func", lambda *a, **k: 2 * upstream(*a, **k))
    report = run(parity_inputs, tmp_path, "qwen3_vl_moe", steps=1)
    assert any(f.startswith("gradient of") and "mlp.gate.weight" in f for f in report.failures), report.failures
    assert any(f == "step 1 load-balancing loss differs by 1 (rel)" for f in report.failures), report.failures


def test_grouped_experts_take_the_transformers_step(parity_inputs, tmp_path, monkeypatch):
    """With grouped_experts=true (patch group speed-grouped-experts) Qwen3-VL-MoE's experts run as two grouped GEMMs
    in every MoE layer, also where the MoE layers are recomputed in the backward (recompute_modules=moe: twice the
    grouped forwards), and its steps are still transformers' within the parity tolerances."""
    from qvl.kernels import speed_grouped_experts

    calls = []
    grouped = speed_grouped_experts.grouped_forward
    monkeypatch.setattr(speed_grouped_experts, "grouped_forward", lambda *a: calls.append(1) or grouped(*a))
    options = {"grouped_experts": True, "recompute": "selective", "recompute_modules": "moe"}
    report = run(parity_inputs, tmp_path, "qwen3_vl_moe", options=options)
    assert report.ok, report.failures
    assert len(calls) >= STEPS  # at least one MoE layer's forward per step ran grouped


def test_json_goes_alone_to_stdout(parity_inputs, tmp_path, capsys):
    """`--json` prints the report and nothing else on stdout (Megatron's and the Trainer's output go to stderr)."""
    from qvl.launchers.cli import main

    hf, data = parity_inputs["qwen2_5_vl"]
    args = [
        "verify-training",
        str(hf),
        "--data",
        str(data),
        "--steps",
        "1",
        "--json",
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert main([*args, "warmup_iters=0", "lr=1e-3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and len(report["steps"]) == 1 and (tmp_path / "p.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("family", GATED_DELTA_FAMILIES)
def test_gate_differences_are_fp32_error_alone(parity_inputs, tmp_path, family):
    """The run once more in fp64 (transformers' model, its fp32 casts made fp64, the exact delta-rule recurrence,
    AdamW in fp64 at the same learning rates): with the delta rule token by token on both sides, every tensor's
    step-1 gradient, the decay-gate parameters' included, is within fp32 rounding of fp64 on both sides (measured:
    ~5e-7 relative, where the chunked rule leaves ~1e-3 on the gates: docs/parity.md) and qvl within 1.1x
    transformers' error plus rounding; after 3 Adam steps both sides' weights are within 0.04 lr of fp64."""
    from qvl.training.parity import exact
    from qvl.training.parity.megatron_run import run_megatron
    from qvl.training.parity.report import is_gate_parameter
    from qvl.training.parity.run import ParitySpec, check_spec, qvl_run, reference_run

    hf_path, data = parity_inputs[family]
    # the language-model loss alone: the fp64 trajectory (qvl.training.parity.exact) has no multi-token-prediction
    # head and no load-balancing loss
    options = {**OPTIONS, "mtp": False, "model.moe_aux_loss_coeff": 0.0}
    spec = ParitySpec(hf_path=hf_path, data=data, run_dir=tmp_path, steps=STEPS, options=options)
    record, device = check_spec(spec)
    qvl, config = run_megatron(qvl_run(spec, record, device))
    hf, settings = reference_run(spec, record, qvl, config)
    lrs = [row.lr for row in hf.steps]
    truth, weights = exact.trajectory(exact.fp64_model(hf_path), _conversations(qvl, hf_path, record), settings, lrs)
    ours, theirs = exact.relative_errors(qvl.grads, truth), exact.relative_errors(hf.grads, truth)
    assert set(ours) == set(theirs) == set(truth)
    gates = [n for n in truth if is_gate_parameter(n)]
    assert len(gates) >= 6
    assert max(ours.values()) < 5e-6 and max(theirs.values()) < 5e-6, (max(ours.values()), max(theirs.values()))
    assert all(ours[n] <= 1.1 * theirs[n] + 2e-6 for n in gates), {n: (ours[n], theirs[n]) for n in gates}
    # final weights, in units of the peak lr: each fp32 side's distance to the fp64 run
    ours_w, theirs_w = (_weight_errors(w, weights, settings.lr) for w in (qvl.weights, hf.weights))
    assert (
        max(ours_w.values()) < TOLERANCES["fp32"].weight / 2 and max(theirs_w.values()) < TOLERANCES["fp32"].weight / 2
    )


def _weight_errors(weights, exact_weights, lr: float) -> dict[str, float]:
    return {n: float((weights[n].double() - w).abs().max()) / lr for n, w in exact_weights.items() if n in weights}


def _conversations(qvl, hf_path, record):
    from transformers import AutoConfig, AutoTokenizer

    from qvl.training.parity.transformers_run import samples_per_step

    config, tokenizer = AutoConfig.from_pretrained(str(hf_path)), AutoTokenizer.from_pretrained(str(hf_path))
    return samples_per_step(qvl, config, tokenizer, seconds_per_grid=record.video_positions_in_seconds)
