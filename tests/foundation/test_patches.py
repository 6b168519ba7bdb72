"""The registry of upstream patches: every target exists at the pinned versions, and every group undoes cleanly."""

from __future__ import annotations

import inspect

import pytest

from qvl.foundation import forks, patch_entries, patches
from qvl.foundation.megatron import import_megatron_bridge
from tests.foundation.conftest import check_passed


@pytest.fixture(scope="module", autouse=True)
def _megatron_bridge():
    import_megatron_bridge()  # some targets live in modules that need the TE / nvrx stand-ins to import


def installed_here(version: str) -> bool:
    """Whether an entry's package is installed here: every stack package is; a GPU-only one (flash-linear-attention,
    launchers/requirements-gpu.txt) is checked where a GPU machine installs it (tests/kernels/test_fix_fla_tf32.py)."""
    import importlib.metadata

    from qvl.foundation import stack

    distribution = version.split()[0]
    if not stack.gpu_only(distribution):
        return True
    try:
        return importlib.metadata.version(distribution) == version.split()[1]
    except importlib.metadata.PackageNotFoundError:
        return False


def check_patch_target(patch) -> None:
    """The target exists at the entry's version, with the parameters it lists, and the replacement loads."""
    owner, name = patch_entries.owner_and_name(patch.target)
    if patch.absent_ok and not hasattr(owner, name):  # an optional package's name: the module must still use it
        uses = inspect.getsource(owner).count(name)  # its import and at least one use
        assert uses >= 2, f"{patch.target} is no longer used ({patch.version} did)"
        return
    assert hasattr(owner, name), f"{patch.target} is gone ({patch.version} had it): {patch.why}"
    if patch.params is not None:
        names = patch_entries.signature_names(getattr(owner, name))
        assert names[: len(patch.params)] == patch.params, f"{patch.target} now takes {names}"
    assert callable(patch_entries.load(patch.replacement)), patch.replacement


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.target)
def test_every_patch_target_exists_with_its_parameters(patch):
    if not installed_here(patch.version):
        pytest.skip(
            f"{patch.version} is installed on GPU machines only; tests/kernels/test_fix_fla_tf32.py checks it there"
        )
    check_patch_target(patch)


@pytest.mark.parametrize("read", patches.PRIVATE_READS, ids=lambda r: f"{r.target}.{r.attribute}")
def test_every_private_read_exists(read):
    owner = patch_entries.load(read.target)
    found = hasattr(owner, read.attribute) or f"self.{read.attribute}" in inspect.getsource(owner)
    assert found, f"{read.target} has no {read.attribute} any more ({read.version}); used in {read.used_in}"


@pytest.mark.parametrize("stand_in", patches.STAND_INS, ids=lambda s: s.module)
def test_every_stand_in_module_still_imports_its_package(stand_in):
    import importlib

    source = inspect.getsource(importlib.import_module(stand_in.module))
    assert stand_in.submodule in source, f"{stand_in.module} no longer imports {stand_in.submodule}: drop the stand-in"


@pytest.mark.parametrize("group", patches.GROUPS)
def test_leaving_the_context_restores_every_patched_name(group):
    if not all(installed_here(p.version) for p in patches.PATCHES if p.group == group):
        pytest.skip(f"{group} patches a package installed on GPU machines only")
    targets = [p.target for p in patches.PATCHES if p.group == group]
    absent = object()
    was_applied = patches.is_applied(group)  # a session fixture's model build applies some for the process
    patches.undo(group)
    try:
        before = {t: getattr(*patch_entries.owner_and_name(t), absent) for t in targets}
        with patches.applied(group):
            assert patches.is_applied(group)
            changed = [t for t in targets if getattr(*patch_entries.owner_and_name(t), absent) is not before[t]]
            assert changed == targets
        assert not patches.is_applied(group)
        assert all(getattr(*patch_entries.owner_and_name(t), absent) is before[t] for t in targets)
    finally:
        if was_applied:
            patches.apply(group)


def test_apply_and_undo_are_idempotent_and_unknown_groups_are_refused(cpu_runtime_off):
    original = patch_entries.load("torch.cuda:current_device")
    patches.apply("cpu-runtime")
    patches.apply("cpu-runtime")
    assert patch_entries.load("torch.cuda:current_device")() == 0
    patches.undo("cpu-runtime")
    patches.undo("cpu-runtime")
    assert patch_entries.load("torch.cuda:current_device") is original
    with pytest.raises(ValueError, match="no patch group 'cpu'; groups: cpu-runtime"):
        patches.apply("cpu")


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_importing_every_qvl_module_switches_nothing_on(fresh_import_report):
    """In a fresh interpreter: no patch group, CPU runtime or import hook is left on by importing every module."""
    check_passed(fresh_import_report, "every_module_switches_nothing_on")


def test_dataset_helpers_are_built_only_where_the_wheel_did_not_ship_them(monkeypatch):
    """fix-megatron-setup: Megatron-Bridge's `make` of the dataset helpers runs only where `helpers_cpp` is missing
    (a source checkout); the pip-installed wheel ships it built and has no Makefile."""
    import importlib.util

    from qvl.foundation.megatron import prebuilt_dataset_helpers

    builds = []
    compile_helpers = prebuilt_dataset_helpers(lambda: builds.append("make"))
    assert importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None  # this install's wheel
    compile_helpers()
    assert builds == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # as in a fresh source checkout
    compile_helpers()
    assert builds == ["make"]


def test_megatron_logging_setup_leaves_qvl_warnings_alone(caplog):
    """fix-megatron-setup: Megatron-Bridge's `setup_logging` (every training loop) filters WARNING records out of every
    logger that exists, for the rest of the process; qvl's loggers keep theirs, the others are filtered as before.
    (The suite's autouse fixture removes the filters again afterwards.)"""
    import logging

    from qvl.foundation import megatron, patches

    megatron.import_megatron_bridge()
    from megatron.bridge.training.utils.log_utils import setup_logging

    ours, theirs = logging.getLogger("qvl.recipes.some_module"), logging.getLogger("some_library.module")
    with patches.applied("fix-megatron-setup"):
        setup_logging(logging_level=logging.INFO, filter_warning=True)
    with caplog.at_level(logging.INFO):
        ours.warning("kept")
        theirs.warning("dropped")
        theirs.error("errors pass")
    names = (ours.name, theirs.name)
    assert [r.getMessage() for r in caplog.records if r.name in names] == ["kept", "errors pass"]


@pytest.mark.slow  # 10-30 s: with the slow tests, out of the fast loop
def test_the_bridge_registration_imports_first_in_a_fresh_process(fresh_import_report):
    # It must give Megatron-Bridge its Transformer Engine stand-ins itself, not rely on a caller having done so.
    check_passed(fresh_import_report, "registration_first")


ENTRIES = (*patches.PATCHES, *patches.STAND_INS, *patches.KEPT_OUT, *patches.PRIVATE_READS, *forks.FORKS)


def test_every_version_is_a_pin_of_the_stack_and_installed_here():
    """The registry's versions come from the requirement files (one place a version is written); the tests above
    check the targets at exactly those versions. An entry typed by hand, or a pin the registry disagrees with, fails."""
    import importlib.metadata

    from qvl.foundation import stack

    versions = {entry.version for entry in ENTRIES}
    for version in versions:
        distribution = version.split()[0]
        assert version == stack.pinned(distribution), f"{version!r}: the stack pins {stack.pinned(distribution)!r}"
        if not installed_here(version):
            continue  # a GPU-only package: checked where it is installed
        installed = importlib.metadata.version(distribution)
        assert version.split()[1] == installed, (
            f"{distribution} {installed} is installed; the registry is for {version}"
        )
    with pytest.raises(stack.UnpinnedPackage, match="rich is not pinned with == in requirements-stack.txt"):
        stack.pinned("rich")  # `rich>=13`: a range, no version to write an entry against


def test_every_group_names_its_kind_first():
    assert set(patch_entries.KINDS) == {"cpu", "torch", "fix", "speed"}
    odd = [g for g in patches.GROUPS if patch_entries.kind_of(g) not in patch_entries.KINDS]
    assert not odd, f"groups not named <kind>-<subject> with a kind of {sorted(patch_entries.KINDS)}: {odd}"
    assert all(p.kind == patch_entries.kind_of(p.group) for p in patches.PATCHES)
    assert all(s.kind == "torch" for s in patches.STAND_INS)
    assert all(k.kind == "speed" for k in patches.KEPT_OUT)


@pytest.mark.parametrize("entry", patches.KEPT_OUT, ids=lambda k: k.package)
def test_every_kept_out_package_is_one_its_loader_imports_as_an_optional_plugin(entry):
    """The loader still imports the package as a plugin it skips when the import fails (modelopt's
    `with import_plugin(...)`): otherwise keeping it out would break the import, or keep nothing out."""
    import importlib.util

    source = open(importlib.util.find_spec(entry.plugin_loader).origin).read()
    assert f'import_plugin("{entry.package}")' in source, f"{entry.plugin_loader} no longer imports {entry.package}"


@pytest.mark.parametrize("fork", forks.FORKS, ids=lambda f: f.upstream)
def test_every_fork_copies_the_upstream_source_it_was_written_against(fork):
    """A stack upgrade that changes an upstream body qvl copies names the copy to re-read (then update the hash)."""
    import hashlib

    source = inspect.getsource(patch_entries.load(fork.upstream))
    found = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert found == fork.source_sha256, (
        f"{fork.upstream} changed since {fork.version} (source sha256 {found}, was {fork.source_sha256}): re-read "
        f"{fork.copied_in} against it, then set source_sha256={found!r} in qvl.foundation.forks.FORKS"
    )
    assert callable(patch_entries.load(fork.copied_in)), fork.copied_in
