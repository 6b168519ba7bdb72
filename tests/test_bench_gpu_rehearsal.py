"""`bash benchmarks/gpu.sh rehearse` (benchmarks/gpu_rehearsal.py): its cheap checks with gpu.sh's own lists and a
stand-in wheelhouse (the suite downloads and installs nothing), and that it fails where a GPU call would: a missing
or stale wheel, a wheelhouse or call over its limit, a stage argument the stage refuses, an import the GPU image
lacks."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from benchmarks import gpu_rehearsal

ROOT = pathlib.Path(__file__).resolve().parents[1]


def gpu_sh_wheels() -> list[str]:
    """gpu.sh's pinned specs (WHEELS and SDIST_ONLY), as bash reads them."""
    script = (
        'eval "$(sed -n "/^WHEELS=(/,/^)/p;/^SDIST_ONLY=/p" benchmarks/gpu.sh)"; echo "${WHEELS[@]} ${SDIST_ONLY[@]}"'
    )
    return subprocess.run(["bash", "-c", script], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()


def stand_in_wheelhouse(path: pathlib.Path, specs: list[str]) -> pathlib.Path:
    """Empty files named as `pip download` names the specs' wheels."""
    path.mkdir()
    for spec in specs:
        name, _, version = spec.partition("==")
        (path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
    return path


def test_the_wheelhouse_holds_each_pinned_wheel_and_nothing_else(tmp_path):
    specs = ["megatron-core==0.19.2", "pydantic_core==2.50.4", "rapidyaml==0.15.2"]
    whl = stand_in_wheelhouse(tmp_path / "whl", specs)
    assert all(c.ok for c in gpu_rehearsal.check_wheelhouse(whl, specs, limit_mib=60))
    (whl / "megatron_core-0.19.2-py3-none-any.whl").unlink()
    (whl / "megatron_core-0.18.0-py3-none-any.whl").write_bytes(b"x" * 2**20)  # a stale version
    missing, stale, size, travel = gpu_rehearsal.check_wheelhouse(whl, specs, limit_mib=0)
    assert not missing.ok and "megatron-core==0.19.2" in missing.detail
    assert not stale.ok and "megatron-core==0.18.0" in stale.detail
    assert not size.ok and travel.ok  # the repository and 1 MiB still travel
    (absent,) = gpu_rehearsal.check_wheelhouse(tmp_path / "none", specs, limit_mib=60)
    assert not absent.ok and "gpu.sh wheels" in absent.detail


def test_each_call_and_all_calls_stay_within_the_device_time():
    seconds = {"train": 380, "rotary": 60, "tests": 220}
    call_1, call_2, total = gpu_rehearsal.check_calls([["train"], ["rotary", "tests"]], seconds, setup_s=45)
    assert call_1.ok and call_2.ok and total.ok and total.detail == "750 s"
    over, *_ = gpu_rehearsal.check_calls([["train", "tests"]], seconds, setup_s=45)
    assert not over.ok and over.detail == "set-up 45 + train 380 + tests 220 = 645 s"


def test_imports_from_outside_the_wheelhouse_are_named_by_distribution(tmp_path):
    import torch

    site = tmp_path / "site"
    (site / "megatron").mkdir(parents=True)
    log = tmp_path / "imports.tsv"
    log.write_text(
        f"megatron\t{site}/megatron/core/__init__.py\ntorch\t{torch.__file__}\nyaml\t/x/site-packages/yaml/a.py\n"
    )
    found = gpu_rehearsal.imported_from_outside(log, site)
    assert found == {"torch", "pyyaml"} and found <= gpu_rehearsal.IMAGE_DISTS


def _rehearse(tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    whl = stand_in_wheelhouse(tmp_path / "whl", gpu_sh_wheels())
    env = {**os.environ, "REHEARSE": "cheap", "PYTHON": sys.executable, "WHL": str(whl), **env}
    return subprocess.run(["bash", "benchmarks/gpu.sh", "rehearse"], cwd=ROOT, env=env, capture_output=True, text=True)


def test_the_cheap_rehearsal_of_the_planned_calls_passes(tmp_path):
    done = _rehearse(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("rehearsal (cheap):") and not [line for line in lines if line.startswith("FAIL")]
    for stage in ("train", "rotary", "tests"):  # every stage of the planned calls, its own command
        assert any(line.startswith(f"ok   {stage}: ") for line in lines), lines


def test_the_rehearsal_fails_where_the_gpu_call_would(tmp_path):
    done = _rehearse(tmp_path, BENCH_TRAIN_ARGS="--variants 4096:packed:-speed-no-such-group", GPU_TESTS_SECONDS="900")
    assert done.returncode == 1
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert any("call 2 (rotary tests)" in line for line in failed), failed
    assert any(line.startswith("FAIL train:") and "no patch group speed-no-such-group" in line for line in failed)


def test_the_wheelhouse_carries_the_gpu_pins_the_registry_names():
    """launchers/requirements-gpu.txt pins the kernel packages a GPU machine installs (the patch registry's fla
    entries are written against them); the GPU call must install exactly those versions."""
    from qvl.foundation import stack

    wheels = set(gpu_sh_wheels())
    pins = stack.gpu_pins()
    assert pins and all(f"{name}=={version}" in wheels for name, version in pins.items()), (pins, sorted(wheels))


def gpu_sh_limit(stage: str, elapsed: int, gpu_seconds: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_SECONDS", "GPU_TESTS_SECONDS")}
    if gpu_seconds is not None:
        env["GPU_SECONDS"] = gpu_seconds
    return subprocess.run(
        ["bash", "benchmarks/gpu.sh", "limit", stage, str(elapsed)], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_a_call_given_the_device_time_left_cuts_its_stages_to_fit_it():
    # gpu.sh's own tests limit (250 s; GPU_TESTS_SECONDS unset here) and margin (30 s after each stage)
    assert gpu_sh_limit("tests", 100, None).stdout.split() == ["250"]  # no GPU_SECONDS: the stage's own limit
    assert gpu_sh_limit("tests", 100, "600").stdout.split() == ["250"]  # time enough
    assert gpu_sh_limit("tests", 100, "300").stdout.split() == ["170"]  # cut to what is left: 300 - 100 - 30
    assert gpu_sh_limit("tests", 100, "150").stdout.split() == ["0"]  # 20 s left: skipped
    bad = gpu_sh_limit("tests", 100, "9m")
    assert bad.returncode == 2 and "GPU_SECONDS='9m'" in bad.stderr and "e.g. GPU_SECONDS=540" in bad.stderr
