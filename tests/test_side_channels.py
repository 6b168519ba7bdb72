"""No module-global side channels: data reaches a forward (or any function) as an argument, never through a weak
dictionary or a module-level list or dict that one function fills and another reads back.

The scan reads every module of qvl's packages (as tests/test_layers.py does) and finds module-level names bound to a
weak container (`WeakKeyDictionary`, `WeakIdKeyDictionary`, `WeakValueDictionary`, `WeakSet`) or to a mutable list,
dict, set or deque that a function of the module then changes (item assignment or deletion, `append`, `update`, ...,
or a `global` rebinding). Constant tables (built once, never changed) pass. Process state that is not data, kept on
purpose, is listed in `ALLOWED` with the reason. Nor does a forward pre-hook add a module's inputs on the way in.
"""

from __future__ import annotations

import ast
from pathlib import Path

from qvl.foundation import LAYERS

ROOT = Path(__file__).resolve().parents[1]

WEAK_CONTAINERS = frozenset({"WeakKeyDictionary", "WeakIdKeyDictionary", "WeakValueDictionary", "WeakSet"})
MUTABLE_CALLS = frozenset({"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque"})
MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault", "add", "remove", "discard",
    "appendleft", "extendleft", "__setitem__", "__delitem__",
})  # fmt: skip
ALLOWED = {
    # The patch registry's record of which groups are applied now and the originals to restore: process state that
    # `applied(group)` keeps (upstream attributes are themselves process-global), not data passed to a function.
    ("foundation/patches.py", "_APPLIED"),
    # Registries filled by decorators at import (`@recipe`), read by name lookups: the code's own table.
    ("recipes/registry.py", "_RECIPES"),
    # A cache of what is derived once from a long-lived object (a recipe's typed NeMo-Run entry point), keyed by
    # that object; nothing of a batch goes through it.
    ("launchers/nemo_cli.py", "_TYPED_RECIPES"),
}


def _call_name(node: ast.expr) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    return getattr(func, "attr", None) or getattr(func, "id", "") if func is not None else ""


def _container_kind(value: ast.expr | None) -> str | None:
    """ "weak" or "mutable" for a weak container or a mutable list/dict/set/deque value; None for anything else."""
    if value is None:
        return None
    if _call_name(value) in WEAK_CONTAINERS:
        return "weak"
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return "mutable"
    if _call_name(value) in MUTABLE_CALLS:
        return "mutable"
    return None


def _module_containers(tree: ast.Module) -> dict[str, str]:
    """Module-level name -> "weak" / "mutable" for the names bound to such containers."""
    found = {}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        kind = _container_kind(getattr(node, "value", None))
        for target in targets:
            if kind and isinstance(target, ast.Name):
                found[target.id] = kind
    return found


def _changed_in_functions(tree: ast.Module) -> set[str]:
    """Names a function of the module changes in place or rebinds as a global."""
    changed = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                changed.update(node.names)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                changed.update(
                    t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                )
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if node.func.attr in MUTATING_METHODS and isinstance(owner, ast.Name):
                    changed.add(owner.id)
    return changed


def side_channels(root: Path) -> list[str]:
    """Each module-level weak container, and each module-level mutable container a function changes, outside
    `ALLOWED`."""
    problems = []
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            relative = path.relative_to(root).as_posix()
            changed = _changed_in_functions(tree)
            for name, kind in _module_containers(tree).items():
                if (relative, name) in ALLOWED or (kind == "mutable" and name not in changed):
                    continue
                what = "a weak container" if kind == "weak" else "a module-level container its functions change"
                problems.append(f"{relative}: {name} is {what}; pass the data as an argument instead")
    return problems


def test_no_module_global_side_channels():
    assert side_channels(ROOT) == []


def test_a_side_channel_is_caught(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "kernels" / "weak.py").write_text(
        "from torch.utils.weak import WeakIdKeyDictionary\n_NOTED = WeakIdKeyDictionary()\n"
    )
    (tmp_path / "training" / "pending.py").write_text(
        "_PENDING: list = []\n_TABLE = {'a': 1}\n_SEEN = {}\n\n"
        "def keep(x):\n    _PENDING.append(x)\n\ndef note(k, v):\n    _SEEN[k] = v\n"
    )
    problems = side_channels(tmp_path)
    assert [p.split(" is ")[0] for p in problems] == [
        "kernels/weak.py: _NOTED",
        "training/pending.py: _PENDING",
        "training/pending.py: _SEEN",
    ]  # the constant table _TABLE passes


def test_no_forward_pre_hook_hands_a_module_its_inputs():
    """Inputs reach a module's forward as its arguments: no forward pre-hook adds them on the way in."""
    hooked = [
        path.relative_to(ROOT).as_posix()
        for package in LAYERS
        for path in sorted((ROOT / package).rglob("*.py"))
        if "register_forward_pre_hook" in path.read_text()
    ]
    assert hooked == []
