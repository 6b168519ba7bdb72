"""`qvl doctor --patches`: every group of the registry with the switch's answer for a recipe and device, and
docs/upstream.md as the command writes it."""

from __future__ import annotations

import json

from qvl.foundation import forks, patches
from qvl.launchers import cli, upstream_report
from tests.test_layers import ROOT


def _doctor(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["doctor", "--patches", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_committed_docs_page_is_the_generated_table():
    committed = (ROOT / "docs" / "upstream.md").read_text()
    assert committed == upstream_report.markdown(), (
        f"docs/upstream.md is not what the registry generates: run `{upstream_report.MARKDOWN_COMMAND}`"
    )


def test_every_group_is_listed_with_its_kind_condition_and_entries(capsys):
    code, out, _ = _doctor(capsys, "--device", "cuda", "--json")
    content = json.loads(out)
    assert code == 0 and content["target"]["device"] == "cuda"
    groups = {g["group"]: g for g in content["groups"]}
    assert list(groups) == list(patches.GROUPS)
    for name, group in groups.items():
        entries = [p for p in patches.PATCHES if p.group == name]
        assert [e["target"] for e in group["entries"]] == [p.target for p in entries]
        assert all(e["why"] and e["version"] for e in group["entries"])
        assert group["kind"] == name.partition("-")[0] and group["condition"]
    assert groups["cpu-runtime"]["on"] is False and groups["fix-megatron-setup"]["on"] is True
    assert groups["speed-hf-vision"]["on"] is None  # no recipe: on or off with the model
    forked = {e["fork"] for g in content["groups"] for e in g["entries"]} - {None}
    assert "qvl.kernels.speed_hf_vision:lean_attention" in forked
    assert len(content["forks"]) == len(forks.FORKS) and len(content["stand_ins"]) == len(patches.STAND_INS)


def test_a_recipe_gets_the_answer_for_its_model(capsys):
    code, out, _ = _doctor(capsys, "--recipe", "qwen2_5_vl_3b_sft", "--device", "cpu", "--json")
    groups = {g["group"]: g["on"] for g in json.loads(out)["groups"]}
    assert code == 0
    assert groups["speed-hf-vision"] is True and groups["torch-qwen3-vl-vision"] is False
    assert groups["cpu-runtime"] is True and groups["torch-gated-delta"] is False


def test_the_table_and_the_misused_flags(capsys):
    code, out, _ = _doctor(capsys, "--device", "cpu")
    assert code == 0 and "speed-cross-entropy" in out and patches.MCORE in out
    assert cli.main(["doctor", "--json"]) == 2
    assert capsys.readouterr().err.strip() == "error: --json is an option of `qvl doctor --patches`; add --patches"
