"""`qvl data prepare | stats` through the argparse group that `qvl` registers."""

from __future__ import annotations

import json

import pytest

from qvl.launchers.cli import main

from .conftest import save_image, write_jsonl


def _run(argv: list[str]) -> int:
    return main(argv)  # the `qvl` entry point: a QvlError becomes one `error:` line and exit 2


@pytest.fixture(scope="module")
def small_input(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_image(root / "a.png", 120, 80)
    records = [
        {
            "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Noise."}],
            "image": "a.png",
        },
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
        {"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "?"}], "image": "gone.png"},
    ]
    return write_jsonl(root / "in.jsonl", records), root


def _prepare_argv(small_input, hf_paths, output, *extra) -> list[str]:
    input_path, root = small_input
    return [
        "data",
        "prepare",
        "--input",
        str(input_path),
        "--media-root",
        str(root),
        "--family",
        "qwen2_vl",
        "--hf-path",
        str(hf_paths["qwen2_vl"]),
        "--seq-length",
        "256",
        "--output",
        str(output),
        *extra,
        *(() if "--workers" in extra else ("--workers", "1")),
    ]


def test_prepare_writes_outputs_and_strict_fails_on_quarantine(small_input, hf_paths, tmp_path):
    assert _run(_prepare_argv(small_input, hf_paths, tmp_path / "ok")) == 0
    assert [json.loads(line)["reason"] for line in (tmp_path / "ok" / "quarantine.jsonl").read_text().splitlines()] == [
        "image_missing"
    ]
    assert json.loads((tmp_path / "ok" / "report.json").read_text())["accepted"] == 2
    assert _run(_prepare_argv(small_input, hf_paths, tmp_path / "strict", "--strict")) == 1


def test_prepare_reports_a_missing_input_with_the_flag(small_input, hf_paths, tmp_path, capsys):
    argv = _prepare_argv(small_input, hf_paths, tmp_path / "x")
    argv[argv.index("--input") + 1] = str(tmp_path / "nope.jsonl")
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --input") and "Traceback" not in err
    assert _run(["-v", *argv]) == 2  # -v: the same line, after the traceback
    assert "Traceback" in capsys.readouterr().err


@pytest.fixture(scope="module")
def prepared_small(small_input, hf_paths, tmp_path_factory):
    output = tmp_path_factory.mktemp("stats") / "ds"
    assert _run(_prepare_argv(small_input, hf_paths, output)) == 0
    return output


def test_stats_prints_the_report(prepared_small, capsys):
    capsys.readouterr()
    assert _run(["data", "stats", str(prepared_small)]) == 0
    out = capsys.readouterr().out
    assert "packing efficiency" in out and "image_missing" in out


def test_stats_plot_writes_a_png(prepared_small, tmp_path):
    pytest.importorskip("matplotlib")
    assert _run(["data", "stats", str(prepared_small), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prepare_options_balance_truncate_header_only(small_input, hf_paths, tmp_path):
    from .test_balance import TINY_CONFIG

    model_config = tmp_path / "config.json"
    model_config.write_text(json.dumps(TINY_CONFIG))
    argv = _prepare_argv(
        small_input,
        hf_paths,
        tmp_path / "opts",
        "--balance-cost",
        "--model-config",
        str(model_config),
        "--truncate",
        "--no-decode-check",
        "--max-pixels",
        str(28 * 28 * 16),
        "--system-prompt",
        "Be terse.",
    )
    argv[argv.index("--seq-length") + 1] = "40"
    assert _run(argv) == 0
    report = json.loads((tmp_path / "opts" / "report.json").read_text())
    packs = [json.loads(line) for line in (tmp_path / "opts" / "packs.jsonl").read_text().splitlines()]
    assert all(sum(p["lengths"]) <= 40 for p in packs)
    assert report["accepted"] + report["quarantined"] == 3
    quarantine = [json.loads(line) for line in (tmp_path / "opts" / "quarantine.jsonl").read_text().splitlines()]
    too_long = [q for q in quarantine if q["reason"] == "too_long"]
    assert too_long and all("> seq_length 40" in q["detail"] for q in too_long)  # its length is reported


def test_stats_json_and_plain_columns_into_a_pipe(prepared_small, capsys):
    capsys.readouterr()
    assert _run(["data", "stats", str(prepared_small), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["accepted"] == 2 and report["quarantined_by_reason"] == {"image_missing": 1}
    assert _run(["data", "stats", str(prepared_small)]) == 0  # captured stdout is not a terminal
    lines = capsys.readouterr().out.splitlines()
    assert not any(c in "".join(lines) for c in "│┃━─") and any(line.startswith("packing efficiency") for line in lines)


def test_balance_cost_without_a_model_config_names_the_flag(small_input, hf_paths, tmp_path, capsys):
    assert _run(_prepare_argv(small_input, hf_paths, tmp_path / "b", "--balance-cost")) == 2
    assert "--model-config" in capsys.readouterr().err
