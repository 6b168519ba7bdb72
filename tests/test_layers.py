"""The layers of qvl: every import between its folders points down, module names in strings too, and the code is
ruff-clean.

launchers/  (executors, launch, the command line)        layer 5
training/   (the loop, the forward step, parity)         layer 4
recipes/    (recipes, options, planner)                  layer 3
bridges/    data/                                        layer 2 (neither imports the other)
kernels/    (the speed and no-TE kit, one patch group each)  layer 1
foundation/ (runtime, patch registry, families, errors)  layer 0

Two tables name modules in strings: the patch registry (foundation/patches.py) names each replacement's factory, and
the family records (foundation/families.py) name each family's bridge and recipe module. A replacement lives in
foundation or kernels, never above; a family record's module lives in the folder its field names.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qvl.foundation import LAYERS, families, patches

ROOT = Path(__file__).resolve().parents[1]


def qvl_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported qvl package) for every import in `path`, at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, name.split(".")[1]) for name in names if name.startswith("qvl.") and name.count(".")]
    return found


def layer_violations(root: Path) -> list[str]:
    """Each import of a qvl package from the same or a higher layer (other than the module's own package)."""
    problems = []
    for package, layer in LAYERS.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, target in qvl_imports(path):
                if target != package and LAYERS.get(target, 99) >= layer:
                    problems.append(f"{path.relative_to(root)}:{line} ({package}, layer {layer}) imports "
                                    f"qvl.{target} (layer {LAYERS.get(target, '?')})")  # fmt: skip
    return problems


def test_every_import_points_down():
    assert layer_violations(ROOT) == []


def test_an_upward_import_is_caught(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "foundation" / "runtime.py").write_text("def f():\n    from qvl.launchers.cli import main\n")
    (tmp_path / "bridges" / "tiny_model.py").write_text("from qvl.data.samples import write_sample_dataset\n")
    (tmp_path / "recipes" / "base.py").write_text("from qvl.bridges.providers import provider_from_hf\n")
    problems = layer_violations(tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].startswith("foundation/runtime.py:2 (foundation, layer 0) imports qvl.launchers")
    assert problems[1].startswith("bridges/tiny_model.py:1 (bridges, layer 2) imports qvl.data")


@pytest.mark.skipif(shutil.which("ruff", path=str(Path(sys.executable).parent)) is None, reason="ruff not installed")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_clean(command):
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    result = subprocess.run([ruff, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _folder(module: str) -> str:
    return module.split(".")[1]


def test_every_replacement_lives_in_foundation_or_kernels():
    """The registry's factories sit on the floors below bridges, so applying a group imports nothing above them."""
    misplaced = [f"{p.group}: {p.replacement}" for p in patches.PATCHES
                 if LAYERS[_folder(p.replacement)] > LAYERS["kernels"]]  # fmt: skip
    assert misplaced == []


def test_each_kernels_group_lives_in_the_module_named_after_it():
    """One group, one module: the group "speed-rotary" is qvl.kernels.speed_rotary, and nothing else is there."""
    modules: dict[str, set[str]] = {}
    for p in patches.PATCHES:
        modules.setdefault(p.group, set()).add(p.replacement.partition(":")[0])
    for group, names in modules.items():
        assert len(names) == 1, f"group {group} spreads over {sorted(names)}"
        (module,) = names
        if _folder(module) == "kernels":
            assert module == "qvl.kernels." + group.replace("-", "_").replace(".", "_"), (group, module)


def test_family_records_name_modules_in_their_own_folders():
    for family in families.FAMILIES.values():
        assert _folder(family.recipe_module) == "recipes", family.recipe_module
        if family.bridge_module:
            assert _folder(family.bridge_module) == "bridges", family.bridge_module
