"""The package layout (four top-level folders -> one `qvl` namespace), its entry points, and the
promise that installing qvl never replaces a NeMo container's Megatron stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from qvl.foundation import FOLDERS

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = FOLDERS  # every folder, the floor included: a wheel without qvl.foundation cannot import
# What a NeMo container provides and qvl must never pull in, upgrade or downgrade.
CONTAINER_STACK = {
    "torch",
    "megatron-core",
    "megatron-bridge",
    "transformer-engine",
    "transformers",
    "megatron-energon",
    "nemo-run",
    "apex",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO), "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("qvl-*.whl")
    return path


def test_wheel_maps_each_folder_to_a_qvl_subpackage(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for sub in SUBPACKAGES:
        assert f"qvl/{sub}/__init__.py" in names
    assert "qvl/launchers/requirements-stack.txt" in names  # doctor reads the pins from the package
    assert not any(n.startswith(("tests/", "qvl/tests/", "notebooks/", "benchmarks/")) for n in names)
    entry_points = next(zipfile.Path(wheel, n).read_text() for n in names if n.endswith("entry_points.txt"))
    assert "qvl = qvl.launchers.cli:main" in entry_points
    assert "[nemo_run.cli]" in entry_points and "qvl = qvl.launchers.nemo_cli" in entry_points


def test_pyproject_installs_exactly_the_folders_of_the_layer_list():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"qvl.{folder}": folder for folder in FOLDERS}
    assert {p for p in setuptools["packages"] if p.count(".") == 1} == {f"qvl.{folder}" for folder in FOLDERS}


def test_regular_install_imports_from_site_packages(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    # -S skips site-packages (and so the editable install's finder): only the wheel's files are visible.
    code = (
        "import importlib, importlib.resources; "
        f"print(*(importlib.import_module('qvl.' + sub).__file__ for sub in {SUBPACKAGES!r})); "
        "print(len(importlib.resources.files('qvl.launchers').joinpath('requirements-stack.txt').read_text()))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    files, size = out.stdout.split("\n")[:2]
    assert all(f.startswith(str(target)) for f in files.split())
    assert int(size) > 0


def test_editable_install_points_at_the_repository_folders():
    import qvl.bridges
    import qvl.launchers

    if not Path(qvl.launchers.__file__).resolve().is_relative_to(REPO):
        pytest.skip("qvl is installed as a regular package here, not editable")
    for sub in SUBPACKAGES:
        module = __import__(f"qvl.{sub}", fromlist=["_"])
        assert Path(module.__file__).resolve() == REPO / sub / "__init__.py"


def test_dependencies_never_touch_the_container_stack():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        declared += extra
    names = {d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower() for d in declared}
    assert not names & CONTAINER_STACK, f"qvl must not depend on {names & CONTAINER_STACK}"


def test_pip_install_in_a_provisioned_env_installs_only_qvl(tmp_path):
    """As in a NeMo container: with the stack present, `pip install .` resolves to qvl alone."""
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-build-isolation",
            "-q",
            "--report",
            str(report),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["qvl"]


def test_console_script_help_lists_the_command_groups():
    out = subprocess.run(
        [sys.executable, "-m", "qvl.launchers.cli", "--help"], capture_output=True, text=True, check=True
    )
    for group in ("version", "doctor", "convert", "data", "plan", "train", "launch"):
        assert group in out.stdout


def test_version_names_the_stack():
    out = subprocess.run(
        [sys.executable, "-m", "qvl.launchers.cli", "version"], capture_output=True, text=True, check=True
    )
    for name in (
        "qvl",
        "torch",
        "megatron-core",
        "megatron-bridge",
        "transformers",
        "megatron-energon",
        "nemo-run",
        "transformer-engine",
        "cuda",
    ):
        assert any(line.split()[0] == name for line in out.stdout.splitlines()), name
    assert f"megatron-core      {metadata.version('megatron-core')}" in out.stdout


def test_doctor_passes_here_and_names_the_fix_when_something_is_missing(monkeypatch):
    from qvl.launchers import info

    assert all(c.status != "fail" for c in info.doctor_checks()), [
        c for c in info.doctor_checks() if c.status == "fail"
    ]
    real = info.installed_version
    monkeypatch.setattr(info, "installed_version", lambda name: None if name == "megatron-bridge" else real(name))
    (check,) = [c for c in info.doctor_checks() if c.name == "megatron-bridge"]
    assert check.status == "fail" and check.fix == "pip install --no-deps 'megatron-bridge==0.6.2'"


def test_doctor_names_the_gpu_kernel_packages_at_their_pins(monkeypatch):
    """flash-linear-attention is optional (GPU machines, launchers/requirements-gpu.txt): fine absent on the CPU, a
    warning absent on a GPU, and a warning at another version than the one qvl's fp32 fix is written against."""
    from packaging.requirements import Requirement

    from qvl.launchers import info

    (check,) = [c for c in info.doctor_checks() if c.name == "flash-linear-attention"]
    assert check.status == "ok" and "torch kernels" in check.detail  # not installed on this CPU machine
    req = Requirement("flash-linear-attention==0.6.0")
    assert info._gpu_requirement_check(req, cuda=True).status == "warn"
    monkeypatch.setattr(info, "installed_version", lambda name: "0.4.1")
    other = info._gpu_requirement_check(req, cuda=True)
    assert (
        other.status == "warn"
        and "0.4.1" in other.detail
        and other.fix == "pip install 'flash-linear-attention==0.6.0'"
    )
    monkeypatch.setattr(info, "installed_version", lambda name: "0.6.0")
    assert info._gpu_requirement_check(req, cuda=True).status == "ok"


@pytest.mark.slow  # imports NeMo-Run's command line and Megatron-Bridge
def test_nemo_cli_namespace_is_registered():
    """NeMo-Run finds the `qvl` namespace through its entry point (the `nemo` script itself: tests/launchers/
    test_nemo_cli.py)."""
    from tests.launchers.test_nemo_cli import nemo_in_process

    (entry,) = [ep for ep in metadata.entry_points(group="nemo_run.cli") if ep.name == "qvl"]
    assert entry.value == "qvl.launchers.nemo_cli"
    code, out = nemo_in_process("--help")
    assert code == 0, out[-2000:]
    assert "version" in out and "finetune" in out
