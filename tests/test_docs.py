"""The manual's commands work: every command line of a ```bash block in README.md and docs/*.md.

The convention (CONTRIBUTING.md, "The manual's commands"): a command ending in `# cheap` is run here from the
repository root and must exit 0 (`qvl` through its `main()` in this process, anything else in bash). Every other
command is checked without running it: a `qvl` command must parse with qvl's own parser and override grammar and name
a registered recipe, `nemo qvl` an entrypoint and a recipe, `make` a Makefile target, `python -m` an importable
module, `bash` a script that exists; and every argument that names a path inside the repository must exist.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from qvl.foundation import LAYERS
from qvl.foundation.errors import QvlError

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
CHEAP = "# cheap"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Paths a command may name inside the repository: they start with one of its tracked top-level folders. Anything
# else (`.demo/` from `make demo`, `runs/`, `/lustre/...`) is an input or output of the command, not checked.
REPO_FOLDERS = (*LAYERS, "docs", "tests", "benchmarks", "notebooks")
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", "(", ")", "$(", "$((", "))"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# `qvl` commands whose key=value pairs go through the override grammar (qvl.recipes.overrides).
OVERRIDE_COMMANDS = ("train", "plan", "launch", "verify-training", "reference")


@dataclass(frozen=True)
class Command:
    """One command line of a bash block: where it is, its text (continuations joined), whether it is run."""

    page: str
    line: int
    text: str

    @property
    def cheap(self) -> bool:
        return self.text.rstrip().endswith(CHEAP)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def documented_commands() -> list[Command]:
    """Every command line of every ```bash block of the manual, in page order."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        for block in BASH_BLOCK.finditer(text):
            first = text.count("\n", 0, block.start(1)) + 1
            pending, start = "", first
            for offset, line in enumerate(block.group(1).splitlines()):
                if not pending:
                    start = first + offset
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                full, pending = (pending + line).strip(), ""
                if full and not full.startswith("#"):
                    commands.append(Command(page=str(page.relative_to(ROOT)), line=start, text=full))
    return commands


def segments(text: str) -> list[list[str]]:
    """The simple commands of a line (split at pipes, `&&`, `;`, `&`, subshells), comments dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS or set(token) <= set("();&|"):
            parts.append([])
        else:
            parts[-1].append(token)
    return [part for part in parts if part]


def program_and_args(words: list[str]) -> tuple[str, list[str]]:
    """A simple command's program and arguments, after any leading `NAME=value` environment assignments."""
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    return (words[0], words[1:]) if words else ("", [])


def recipe_names() -> set[str]:
    """Every registered recipe's name, read from the `@recipe(...)` decorators without importing Megatron."""
    names = set()
    for path in (ROOT / "recipes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "recipe":
                    given = [k.value.value for k in decorator.keywords if k.arg == "name"]
                    names.add(given[0] if given else node.name)
    return names


def nemo_entrypoints() -> set[str]:
    """The `nemo qvl` subcommands: functions of launchers/nemo_cli.py decorated with `run.cli.entrypoint`."""
    tree = ast.parse((ROOT / "launchers" / "nemo_cli.py").read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any("entrypoint" in ast.unparse(d) for d in node.decorator_list)
    }


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def missing_repo_paths(args: list[str]) -> list[str]:
    """Arguments (or `--flag=`/`key=` values) that name a path inside the repository which does not exist."""
    missing = []
    for arg in args:
        value = arg.split("=", 1)[1] if "=" in arg else arg
        path = value.split("::", 1)[0]
        if path.split("/", 1)[0] in REPO_FOLDERS and "/" in path and not (ROOT / path).exists():
            missing.append(path)
    return missing


def qvl_problems(args: list[str], recipes: set[str]) -> list[str]:
    """What is wrong with `qvl ARGS` as qvl's `main()` would parse it: unknown command, option, choice or key."""
    from qvl.launchers.cli import build_parser
    from qvl.launchers.jobs import DEMO_JOB, DEMO_PARAMS
    from qvl.recipes.overrides import parse_overrides

    parser, errors = build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            namespace, extra = parser.parse_known_args(args)
    except SystemExit as stop:
        return [] if stop.code == 0 else [errors.getvalue().strip().splitlines()[-1]]
    if extra and not (hasattr(namespace, "overrides") and all("=" in e and not e.startswith("-") for e in extra)):
        return [f"unrecognized arguments: {' '.join(extra)}"]
    problems = []
    recipe = getattr(namespace, "recipe", None)
    demo = namespace.command == "launch" and recipe == DEMO_JOB
    if recipe is not None and recipe not in recipes and not demo:
        problems.append(f"no recipe {recipe!r}")
    if namespace.command in OVERRIDE_COMMANDS:
        pairs = [*getattr(namespace, "overrides", []), *extra]
        try:
            parse_overrides(pairs, executor=namespace.command == "launch", options=DEMO_PARAMS if demo else None)
        except QvlError as err:  # names the key and the closest known ones
            problems.append(str(err))
    return problems


def nemo_problems(args: list[str], recipes: set[str]) -> list[str]:
    """What is wrong with `nemo qvl ENTRYPOINT --factory RECIPE key=value ...`."""
    from qvl.launchers.jobs import DEMO_JOB, DEMO_PARAMS
    from qvl.recipes.options import option_names

    if args[:1] != ["qvl"] or len(args) < 2 or args[1] not in nemo_entrypoints():
        return [f"`nemo {' '.join(args[:2])}` is not one of nemo qvl's entrypoints {sorted(nemo_entrypoints())}"]
    factory = args[args.index("--factory") + 1] if "--factory" in args else None
    if factory is not None and factory not in recipes | {DEMO_JOB}:
        return [f"--factory {factory}: no such recipe"]
    known = DEMO_PARAMS if factory == DEMO_JOB else option_names()
    return [
        f"{arg}: {arg.split('=')[0].removeprefix('recipe.')!r} is not a recipe option"
        for arg in args
        if arg.startswith("recipe.") and arg.split("=")[0].removeprefix("recipe.") not in known
    ]


def command_problems(command: Command, recipes: set[str]) -> list[str]:
    """Everything the manual's reader would trip over in one command line, without running it."""
    problems = []
    for words in segments(command.text):
        program, args = program_and_args(words)
        problems += [f"{path} does not exist" for path in missing_repo_paths(args)]
        if program == "qvl" or program.endswith("/qvl"):
            problems += qvl_problems(args, recipes)
        elif program == "nemo":
            problems += nemo_problems(args, recipes)
        elif program == "make":
            problems += [f"no Makefile target {t!r}" for t in args if "=" not in t and t not in make_targets()]
        elif program.split("/")[-1].startswith("python") and "-m" in args:
            module = args[args.index("-m") + 1]
            if importlib.util.find_spec(module) is None:
                problems.append(f"no module {module}")
        elif program in ("bash", "sh") and args and not args[0].startswith("-"):
            problems += [] if (ROOT / args[0]).is_file() else [f"{args[0]} does not exist"]
    return problems


def test_the_manual_has_commands_and_runs_some():
    commands = documented_commands()
    assert len(commands) >= 20, [str(c) for c in commands]
    assert sum(c.cheap for c in commands) >= 3, "mark a few meaningful commands `# cheap` so that the test runs them"


def test_every_documented_command_names_what_exists():
    recipes = recipe_names()
    assert len(recipes) >= 40, recipes  # the AST walk found the registry
    problems = [f"{command}\n    {p}" for command in documented_commands() for p in command_problems(command, recipes)]
    assert not problems, "\n".join(problems)


def test_every_qvl_command_is_in_the_readme_table():
    """The README's command table names every `qvl` subcommand (and its subcommands) the parser has."""
    from qvl.launchers.cli import build_parser

    def subcommands(parser, prefix: str) -> list[str]:
        found = []
        for action in parser._subparsers._group_actions if parser._subparsers else []:
            for name, child in action.choices.items():
                found += [f"{prefix} {name}"] + subcommands(child, f"{prefix} {name}")
        return found

    readme = (ROOT / "README.md").read_text()
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| `qvl"))
    commands = subcommands(build_parser(), "qvl")
    assert len(commands) >= 13, commands
    assert [c for c in commands if f"`{c}" not in table and f"{c} " not in table] == []


def test_every_recipe_option_is_documented():
    from qvl.recipes.options import option_names

    page = (ROOT / "docs" / "recipes.md").read_text()
    assert [name for name in option_names() if f"`{name}`" not in page] == []


def test_the_check_finds_what_a_reader_would_trip_over():
    """Each kind of mistake the convention promises to catch is caught (so the test above can fail)."""
    recipes = recipe_names()

    def check(text: str) -> list[str]:
        return command_problems(Command(page="x.md", line=1, text=text), recipes)

    assert check("qvl plan qwen2_5_vl_7b_sft --gpus 8 tensor_parallel=2") == []
    assert check("qvl plna qwen2_5_vl_7b_sft")  # no such command
    assert check("qvl plan qwen2_5_vl_7b_sft --gpu-count 8")  # no such option
    assert check("qvl plan qwen2_5_vl_9b_sft")  # no such recipe
    assert "did you mean tensor_parallel" in " ".join(check("qvl train qwen2_5_vl_3b_sft tensorparallel=2"))
    assert check("qvl convert import a b --dtype int8")  # a choice the option does not offer
    assert check("qvl launch qwen2_5_vl_3b_sft --executor-config docs/examples/missing.yaml")
    assert check("nemo qvl finetune --factory qwen2_5_vl_3b_sft recipe.tensorparallel=2")
    assert check("make tests") and check("python -m benchmarks.bench_nothing") and check("bash benchmarks/no.sh")
    assert check("FOO=1 qvl version && qvl doctor | tee doctor.txt") == []


def run_cheap(command: Command) -> None:
    """Run one `# cheap` command from the repository root; fail naming the page and line."""
    words = segments(command.text)
    program, args = program_and_args(words[0]) if len(words) == 1 else ("", [])
    if program == "qvl" and words[0][0] == "qvl":
        from tests.run_qvl import qvl_in_process

        try:
            qvl_in_process(*args)
        except SystemExit as stop:  # argparse's --help exits from main()
            assert stop.code in (0, None), f"{command}\nexit status {stop.code}"
        except AssertionError as err:
            pytest.fail(f"{command}\n{err}")
        return
    env = os.environ | {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(["bash", "-c", command.text], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\nexit status {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}"


@pytest.mark.slow
def test_cheap_commands_run(tmp_path, monkeypatch):
    """The `# cheap` commands, each as a reader would type it; NeMo-Run's experiments go to a scratch folder."""
    import nemo_run.config

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemo-home"))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(tmp_path / "nemo-home"))  # read at its import
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # NeMo-Run's Slurm packaging reads stdin through invoke
    for command in documented_commands():
        if command.cheap:
            run_cheap(command)
