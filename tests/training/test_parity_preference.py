"""`qvl verify-training --recipe <dpo recipe>` (qvl.training.parity.preference): qvl's preference step, on packed pairs
through Megatron-Bridge's loop with qvl's own reference pass, against TRL 1.16's DPOTrainer (CPOTrainer for SimPO) on
the same pairs unpacked, fp32 on CPU.

Every loss (sigmoid, IPO, hinge, RPO's NLL term, SimPO) on Qwen2.5-VL (HF vision tower), Qwen3.5-VL (Gated DeltaNet,
Megatron vision tower) and Qwen3-VL-MoE (Megatron-Core's load-balancing loss, weighed per pair on both sides), each
family with full fine-tuning and with LoRA (`*_dpo_peft`; peft on TRL's side, whose reference is the adapters
disabled). The check fails when qvl's side scores with another beta, or with each pair's sides swapped.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from qvl.training.parity.report import TOLERANCES

pytest.importorskip("trl", reason="TRL is the preference check's reference: pip install -e '.[verify]'")

STEPS = 2  # warmup_iters=0: two optimizer updates, so the final weights show Adam's state and the schedule
OPTIONS = {"seq_length": 256, "lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 0, "weight_decay": 0.1}
ADAPTERS = {"adapter_rank": 8, "adapter_alpha": 16}
RECIPES = {
    "qwen2_5_vl": ("qwen2_5_vl_3b_dpo", "qwen2_5_vl_3b_dpo_peft"),
    "qwen3_5_vl": ("qwen3_5_vl_9b_dpo", "qwen3_5_vl_9b_dpo_peft"),
    "qwen3_vl_moe": ("qwen3_vl_30b_a3b_dpo", "qwen3_vl_30b_a3b_dpo_peft"),
}
TARGETS = {
    "qwen2_5_vl": "language,vision,merger",
    "qwen3_5_vl": "language,vision,merger",
    "qwen3_vl_moe": "language,experts",
}
LOSSES = {
    "sigmoid": {},
    "ipo": {"dpo_loss": "ipo"},
    "hinge": {"dpo_loss": "hinge"},
    "rpo": {"dpo_nll_weight": 1.0},
    "simpo": {"dpo_loss": "simpo", "simpo_gamma": 0.5},
}
# Every loss on every family, each family with full fine-tuning and adapters (both references of an adapter recipe).
CASES = {
    "qwen2_5_vl-sigmoid-full": ("qwen2_5_vl", "sigmoid", "full"),
    "qwen2_5_vl-ipo-lora": ("qwen2_5_vl", "ipo", "adapters"),
    "qwen2_5_vl-hinge-full": ("qwen2_5_vl", "hinge", "full"),
    "qwen2_5_vl-rpo-lora": ("qwen2_5_vl", "rpo", "precomputed"),
    "qwen2_5_vl-simpo-full": ("qwen2_5_vl", "simpo", "full"),
    "qwen3_5_vl-sigmoid-lora": ("qwen3_5_vl", "sigmoid", "adapters"),
    "qwen3_5_vl-ipo-full": ("qwen3_5_vl", "ipo", "full"),
    "qwen3_5_vl-hinge-lora": ("qwen3_5_vl", "hinge", "precomputed"),
    "qwen3_5_vl-rpo-full": ("qwen3_5_vl", "rpo", "full"),
    "qwen3_5_vl-simpo-lora": ("qwen3_5_vl", "simpo", "adapters"),
    "qwen3_vl_moe-sigmoid-full": ("qwen3_vl_moe", "sigmoid", "full"),
    "qwen3_vl_moe-ipo-full": ("qwen3_vl_moe", "ipo", "full"),
    "qwen3_vl_moe-hinge-lora": ("qwen3_vl_moe", "hinge", "adapters"),
    "qwen3_vl_moe-rpo-lora": ("qwen3_vl_moe", "rpo", "precomputed"),
    "qwen3_vl_moe-simpo-full": ("qwen3_vl_moe", "simpo", "full"),
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class FamilyInputs:
    hf: Path
    data: Path
    megatron: Path  # the HF checkpoint imported (`qvl convert import`): where qvl's side starts
    reference: Path  # the reference pass's table, computed by the first full-model check and reused after


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[Path, Path]:
    """Four sample pairs (one image, two images, a multi-turn prompt) in TRL's format: (jsonl, images)."""
    from qvl.data.preference_samples import write_preference_samples

    return write_preference_samples(tmp_path_factory.mktemp("pairs"), format="trl", count=4, with_bad=False)


@pytest.fixture(scope="module")
def family_inputs(pairs, tmp_path_factory):
    """family -> FamilyInputs, built on first use: the tiny checkpoint, the pairs prepared, the import."""
    built: dict[str, FamilyInputs] = {}

    def get(family: str) -> FamilyInputs:
        if family not in built:
            built[family] = _family_inputs(family, pairs, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def _family_inputs(family: str, pairs: tuple[Path, Path], root: Path) -> FamilyInputs:
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.prepare import PrepareConfig, prepare
    from tests.run_qvl import qvl_in_process

    hf = write_tiny_hf_checkpoint(root / "hf", family)
    jsonl, media = pairs
    config = PrepareConfig(
        input=jsonl, media_root=media, family=family, hf_path=hf, seq_length=256, output=root / "data"
    )
    prepare(config)
    qvl_in_process("convert", "import", str(hf), str(root / "megatron"), "--dtype", "fp32", "--device", "cpu")
    return FamilyInputs(hf=hf, data=root / "data", megatron=root / "megatron", reference=root / "reference")


def spec(inputs: FamilyInputs, run_dir: Path, recipe: str, *, steps: int = STEPS, **options):
    from qvl.training.parity.run import ParitySpec

    start = {"pretrained_checkpoint": str(inputs.megatron)}
    if options.get("dpo_loss") != "simpo" and not recipe.endswith("_peft"):
        start["reference"] = str(inputs.reference)
    return ParitySpec(
        hf_path=inputs.hf, data=inputs.data, run_dir=run_dir, recipe=recipe, steps=steps,
        options={**OPTIONS, **start, **options}, device="cpu",
    )  # fmt: skip


def case_options(family: str, loss: str, kind: str, inputs: FamilyInputs) -> tuple[str, dict]:
    full, peft = RECIPES[family]
    if kind == "full":
        return full, dict(LOSSES[loss])
    options = {**ADAPTERS, **LOSSES[loss], "adapter_targets": TARGETS[family]}
    if loss != "simpo":  # SimPO has no reference; else the adapters off, or qvl's pass over the import (the base)
        options["reference"] = "adapters" if kind == "adapters" else str(inputs.reference)
    return peft, options


@pytest.mark.slow  # 5-25 s each on 2 cores, the first of a family more (its inputs and reference pass)
@pytest.mark.parametrize("case", list(CASES))
def test_a_preference_step_is_trls(family_inputs, tmp_path, case):
    from qvl.training.parity.preference import run_preference_parity

    family, loss, kind = CASES[case]
    inputs = family_inputs(family)
    recipe, options = case_options(family, loss, kind, inputs)
    report = run_preference_parity(spec(inputs, tmp_path, recipe, **options))
    tol = TOLERANCES["fp32"]
    assert report.ok, report.failures
    # the comparison covered what it claims: 4 pairs (8 sides) per step, every side's learned tokens, every step
    assert report.pairs_per_step == 4 and report.conversations == 8 and report.learned_tokens > 30
    assert [r.step for r in report.steps] == [1, 2] and not report.mask_mismatches
    assert report.grad_max_rel_diff <= tol.grad and report.weight_max_diff <= tol.weight * report.peak_lr
    assert report.tensors_compared >= (20 if kind != "full" else 50)
    assert all(".lora_" in n for n in (report.grad_worst, report.weight_worst)) == (kind != "full")
    assert set(report.pair_max_diff) >= {"loss", "logp_chosen", "ref_logp_rejected", "reward_margin", "reward_accuracy"}
    assert max(report.pair_max_diff.values()) < 1e-4, report.pair_max_diff
    assert ("CPOTrainer" if loss == "simpo" else "DPOTrainer") in report.trainer
    # the policy moved between the steps (the second step's log-probs are not the first's) and the pairs were ranked
    first, second = report.step_rewards
    assert second["reward_margin_qvl"] != first["reward_margin_qvl"]
    if family.endswith("_moe"):  # Megatron-Core's load-balancing loss, per pair on both sides, compared every step
        assert all(r.moe_aux_loss_qvl and r.moe_aux_loss_rel_diff <= tol.step_loss for r in report.steps)
        assert any(note.startswith("MoE load balancing:") for note in report.deliberate)


def _twice_the_beta(monkeypatch):
    from qvl.training import preference

    scored = preference.pair_losses
    monkeypatch.setattr(preference, "pair_losses", lambda logps, config: scored(logps, dataclasses.replace(
        config, beta=2 * config.beta)))  # fmt: skip


def _sides_swapped(batch, model):
    return dataclasses.replace(batch, pairs=batch.pairs[:, [1, 0]])


@pytest.mark.slow  # ~10 s each after the module's first check (which builds the inputs: ~1 min on 2 cores)
@pytest.mark.parametrize("breakage", ["beta", "swapped"])
def test_a_changed_beta_or_swapped_sides_on_qvls_side_fail_the_check(family_inputs, tmp_path, monkeypatch, breakage):
    """qvl's step scoring with twice the recipe's beta, or with each pair's chosen and rejected sides swapped: step
    1's per-token log-probs still agree (the same model on the same tokens), the gradients and the pairs' rewards do
    not."""
    from qvl.training.parity.preference import run_preference_parity

    inputs = family_inputs("qwen2_5_vl")
    recipe = RECIPES["qwen2_5_vl"][0]
    parity = spec(inputs, tmp_path, recipe)
    if breakage == "beta":
        _twice_the_beta(monkeypatch)
    else:
        parity = dataclasses.replace(parity, batch_hook=_sides_swapped)
    report = run_preference_parity(parity)
    assert not report.ok and report.token_loss_max_diff <= TOLERANCES["fp32"].token_loss
    assert any(f.startswith("gradient of") for f in report.failures), report.failures
    # at step 1 the policy is the reference: every reward is 0 and every loss log 2 whatever beta is; from step 2 on
    # the rewards are beta x the log-ratios. Swapped sides show in every pair's log-probs at once.
    wrong = "step 2: reward_chosen " if breakage == "beta" else "step 1, pair \\d: logp_chosen "
    assert any(re.match(wrong, f) for f in report.failures), report.failures


def test_losses_trl_has_none_for_are_refused_before_anything_trains():
    from qvl.foundation.errors import ConfigError
    from qvl.recipes.preference import PreferenceConfig
    from qvl.training.parity.preference_trl import trl_loss

    assert trl_loss(PreferenceConfig()).fields["loss_type"] == ["sigmoid"]
    assert trl_loss(PreferenceConfig(logp="mean")).fields["loss_type"] == ["sigmoid_norm"]
    rpo = trl_loss(PreferenceConfig(loss="ipo", nll_weight=0.5)).fields
    assert rpo["loss_type"] == ["ipo", "sft"] and rpo["loss_weights"] == [1.0, 0.5]
    simpo = trl_loss(PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.3, reference="none"))
    assert simpo.trainer == "cpo" and simpo.fields["cpo_alpha"] == 0.0 and simpo.fields["simpo_gamma"] == 0.3
    with pytest.raises(ConfigError, match="has no label smoothing"):
        trl_loss(PreferenceConfig(label_smoothing=0.1))
    with pytest.raises(ConfigError, match="dpo_logp=mean with dpo_loss=hinge"):
        trl_loss(PreferenceConfig(loss="hinge", logp="mean"))


def test_the_verify_extra_pins_the_trl_the_check_was_written_against():
    import tomllib

    import trl

    from qvl.training.parity.preference_trl import TRL_VERSION

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["verify"] == [f"trl=={TRL_VERSION}"]
    assert "qvl[verify]" in extras["optional-dependencies"]["test"] and trl.__version__ == TRL_VERSION


def test_the_parity_modules_import_no_circle():
    """training/parity's modules import each other (at the top or inside functions) without a circle."""
    root = Path(__file__).parents[2] / "training" / "parity"
    graph = {}
    for path in root.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qvl.training.parity"):
                module = node.module.removeprefix("qvl.training.parity").lstrip(".")
                names |= {module} if module else {alias.name for alias in node.names}
        graph[path.stem] = names & {p.stem for p in root.glob("*.py")}
    circles = [(a, b) for a, targets in graph.items() for b in targets if a in _reachable(graph, b)]
    assert circles == [], circles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.slow
def test_the_command_checks_a_preference_recipe_against_trl(family_inputs, tmp_path, capsys):
    """`qvl verify-training --recipe qwen2_5_vl_3b_dpo`: the table with the pairs' rewards, the JSON report, the
    loss picture, exit 0."""
    from qvl.launchers.cli import main

    inputs = family_inputs("qwen2_5_vl")
    args = ["verify-training", str(inputs.hf), "--data", str(inputs.data), "--recipe", RECIPES["qwen2_5_vl"][0]]
    args += ["--steps", "1", "--device", "cpu", "--report", str(tmp_path / "r.json"), "--run-dir", str(tmp_path)]
    options = {**OPTIONS, "pretrained_checkpoint": inputs.megatron, "reference": inputs.reference}
    assert main([*args, *[f"{k}={v}" for k, v in options.items()]]) == 0
    out = capsys.readouterr().out
    assert "pairs: 4 per step against TRL's DPOTrainer" in out and out.rstrip().endswith("OK")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and report["pairs_per_step"] == 4
    assert report["steps"][0]["loss_hf"] == pytest.approx(0.6931471805599453)  # log 2: the policy is the reference
    assert (tmp_path / "parity_loss.png").stat().st_size > 1000
