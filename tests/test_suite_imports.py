"""Every helper one test file imports from another exists there, also where the import sits inside a test (imported
only when that test runs, so a slow test's stale import would pass the fast loop and fail the full suite)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def defined_names(path: pathlib.Path) -> set[str]:
    """The names a module defines or imports anywhere in its text (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def stale_imports(root: pathlib.Path) -> list[str]:
    """`file: from module import name` for each name a test file imports from `tests.*` that is not there (neither
    defined in the module nor a module of that package)."""
    stale = []
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests"):
                continue
            package = root.joinpath(*node.module.split("."))
            module = package.with_suffix(".py") if package.with_suffix(".py").exists() else package / "__init__.py"
            if not module.exists():
                stale.append(f"{path.relative_to(root)}: from {node.module} (no such module)")
                continue
            names = defined_names(module)
            for alias in node.names:
                if alias.name not in names and not (package / f"{alias.name}.py").exists():
                    stale.append(f"{path.relative_to(root)}: from {node.module} import {alias.name}")
    return stale


def test_every_helper_a_test_imports_from_another_test_file_exists():
    assert stale_imports(ROOT) == []


def test_a_helper_moved_away_is_found_even_when_imported_inside_a_test(tmp_path):
    (tmp_path / "tests" / "kernels").mkdir(parents=True)
    (tmp_path / "tests" / "kernels" / "test_a.py").write_text("def helper():\n    pass\n")
    (tmp_path / "tests" / "kernels" / "test_b.py").write_text(
        "from tests.kernels.test_a import helper\n\n\ndef test_b():\n    from tests.kernels.test_a import moved\n"
    )
    assert stale_imports(tmp_path) == ["tests/kernels/test_b.py: from tests.kernels.test_a import moved"]
