"""`bash benchmarks/gpu.sh rehearse`: on a CPU machine, everything the planned GPU calls run except the GPU work,
so that a call fails here, not on the device, for any reason that is not the GPU.

gpu.sh passes its own lists (the wheels, the planned calls, each stage's time limit, the training stage's arguments,
the GPU test files); the rest of the environment is the stages' (`BENCH_ROTARY_ARGS`, `BENCH_VISION_ARGS`,
`BENCH_IDLE_ARGS`). Checks, each a line of the report (exit 1 if any fails):
1. the wheelhouse: a wheel for every pinned spec and nothing else, within its size limit, and what travels (the
   repository's files git does not ignore, plus .whl) within 64 MiB;
2. the planned calls: each call's stage limits plus the set-up under 9 minutes, all calls under 13;
3. each stage's own command with the arguments the call gives it: `--mode cheap` parses them (no download, install or
   training: the suite runs this), `--mode full` runs the stage at tiny shapes on the CPU (the GPU tests collected,
   the benchmarks' `--tiny` / `--rehearse` paths) with the stack gpu.sh installed into a scratch prefix first on the
   import path, as on the device, and Python 3.12 (the image's);
4. (full) every distribution a stage imported from outside the wheelhouse is one the GPU image holds (`IMAGE_DISTS`).
The image's torch (2.11) differs from the build machine's; only the device tells those apart.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAVEL_LIMIT_MIB = 64  # what a device call carries: the working tree and the carried paths
CALL_LIMIT_S = 540  # a device call runs at most 10 minutes; 9 for the stages leaves the start and the copy back
TOTAL_LIMIT_S = 780  # 15 minutes of device time for all calls, the machine's start (minutes) included
# Distributions the GPU image holds beyond the wheelhouse: those the stages imported from outside it when the same
# stages ran there (code 4e10502, H100, 2026-11-26: its tiny training run and the GPU tests' collection, replayed on
# a CPU with this logging), normalised. A stage importing anything else needs it in gpu.sh's WHEELS.
IMAGE_DISTS = frozenset(
    """absl-py accelerate anyio attrs av botocore certifi charset-normalizer click cloudpickle cuda-bindings
    cuda-pathfinder einops execnet filelock fsspec google-api-core google-auth googleapis-common-protos h11 httpcore
    httpx huggingface-hub hydra-core idna iniconfig backports-tarfile jaraco-context jaraco-functools jaraco-text jinja2 jmespath
    markupsafe more-itertools mpmath networkx numpy nvidia-ml-py packaging pandas peft pillow platformdirs pluggy
    protobuf psutil pyarrow pygments pytest pytest-xdist python-dateutil pyyaml regex requests rich safetensors scipy
    sentencepiece setuptools six sympy tabulate tensorboard torch torchvision tqdm triton trl typing-extensions
    urllib3 xxhash""".split()
)
# Logs every site-packages module a process (and each child: the variable is inherited) has loaded when it exits.
_IMPORT_LOGGER = """import atexit, os, sys
def _qvl_log_imports():
    with open(os.environ["QVL_IMPORT_LOG"], "a") as out:
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and "site-packages" in path:
                out.write(name.split(".")[0] + "\\t" + path + "\\n")
atexit.register(_qvl_log_imports)
"""


@dataclass(kw_only=True, slots=True, frozen=True)
class Check:
    """One line of the report."""

    what: str
    ok: bool
    detail: str = ""


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_versions(whl: pathlib.Path) -> dict[str, str]:
    """{distribution: version} of the wheels in a folder, from their file names."""
    return {normalise(f.name.split("-")[0]): f.name.split("-")[1] for f in sorted(whl.glob("*.whl"))}


def check_wheelhouse(whl: pathlib.Path, specs: list[str], limit_mib: int) -> list[Check]:
    """A wheel for every `name==version` spec and none other; the folder within `limit_mib`; what travels within
    64 MiB."""
    if not whl.is_dir():
        return [Check(what="wheelhouse", ok=False, detail=f"no {whl}; run `bash benchmarks/gpu.sh wheels` first")]
    have = wheel_versions(whl)
    wanted = {normalise(name): version for name, _, version in (spec.partition("==") for spec in specs)}
    missing = sorted(f"{n}=={v}" for n, v in wanted.items() if have.get(n) != v)
    stale = sorted(f"{n}=={v}" for n, v in have.items() if wanted.get(n) != v)
    mib = sum(f.stat().st_size for f in whl.iterdir() if f.is_file()) / 2**20
    travel = (travel_bytes(ROOT) + sum(f.stat().st_size for f in whl.iterdir() if f.is_file())) / 2**20
    return [
        Check(what="wheelhouse: a wheel for every pinned spec", ok=not missing,
              detail=f"{len(have)} wheels" + (f"; missing {missing} (bash benchmarks/gpu.sh wheels)" if missing else "")),
        Check(what="wheelhouse: no stale wheels", ok=not stale, detail=f"remove {stale}" if stale else ""),
        Check(what=f"wheelhouse within {limit_mib} MiB", ok=mib <= limit_mib, detail=f"{mib:.1f} MiB"),
        Check(what=f"what travels within {TRAVEL_LIMIT_MIB} MiB", ok=travel <= TRAVEL_LIMIT_MIB,
              detail=f"{travel:.1f} MiB (the repository's files and .whl)"),
    ]  # fmt: skip


def travel_bytes(root: pathlib.Path) -> int:
    """Bytes of the files a device call copies from the working tree: tracked, and untracked but not ignored."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")  # fmt: skip
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def check_calls(calls: list[list[str]], seconds: dict[str, int], setup_s: int) -> list[Check]:
    """Each planned call's stage limits plus the set-up within CALL_LIMIT_S."""
    out = []
    for index, stages in enumerate(calls, 1):
        total = setup_s + sum(seconds[s] for s in stages)
        parts = " + ".join(f"{s} {seconds[s]}" for s in stages)
        out.append(Check(what=f"call {index} ({' '.join(stages)}) within {CALL_LIMIT_S} s", ok=total <= CALL_LIMIT_S,
                         detail=f"set-up {setup_s} + {parts} = {total} s"))  # fmt: skip
    total = sum(setup_s + sum(seconds[s] for s in stages) for stages in calls)
    out.append(Check(what=f"all {len(calls)} calls within {TOTAL_LIMIT_S} s", ok=total <= TOTAL_LIMIT_S,
                     detail=f"{total} s"))  # fmt: skip
    return out


def stage_commands(stage: str, mode: str, args: argparse.Namespace, tmp: pathlib.Path) -> list[list[str]]:
    """The commands that rehearse a stage: its own command and arguments, tiny (full) or parsed only (cheap)."""
    env = os.environ.get
    tiny = mode == "full"
    if stage == "tests":  # cheap: the files are there (collecting them imports Megatron-Bridge)
        if not tiny:
            return [["-c", f"import pathlib; assert all(pathlib.Path(f).is_file() for f in {args.test_files!r})"]]
        return [["-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *args.test_files]]
    if stage == "rotary":
        extra = ["--tiny", "--repeats", "1"] if tiny else []
        return [["-m", "benchmarks.bench_rotary_gpu", *env("BENCH_ROTARY_ARGS", "").split(), *extra, "--out", str(tmp)]]
    if stage == "attention":  # no arguments; its CPU branch, then what its GPU path imports
        imports = "import benchmarks.bench_attention, megatron.core.transformer, qvl.kernels.varlen_attention"
        return (
            [["-m", "benchmarks.bench_attention"], ["-c", imports]]
            if tiny
            else [["-c", "import benchmarks.bench_attention"]]
        )
    if stage == "vision":
        extra = ["--tiny", "--packs", "1", "--repeats", "1"] if tiny else []
        return [["-m", "benchmarks.bench_vision_gpu", *env("BENCH_VISION_ARGS", "").split(), *extra, "--out", str(tmp)]]
    if stage == "train":
        extra = ["--rehearse"] if tiny else []
        return [["-m", "benchmarks.bench_train", "--out", str(tmp), *args.train_args.split(), *extra]]
    if stage == "idle":
        extra = ["--model", "tiny"] if tiny else []
        return [["-m", "benchmarks.bench_idle", "--out", str(tmp), *env("BENCH_IDLE_ARGS", "").split(), *extra]]
    if stage.startswith("py:"):
        return [["-m", "py_compile", stage.removeprefix("py:")]]
    raise SystemExit(f"error: unknown stage {stage!r}; stages: rotary tests attention vision train idle py:SCRIPT")


def run_stage(stage: str, mode: str, args: argparse.Namespace) -> list[Check]:
    """Rehearse one stage in child processes; in full mode its imports are logged and held to the image's."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"rehearse-{stage.replace(':', '-')}-", dir=args.scratch))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    path = [str(ROOT)]
    if mode == "full":
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(_IMPORT_LOGGER)
        path = [str(tmp / "hook"), str(args.scratch / "src"), str(args.scratch / "site"), str(ROOT)]
        env["QVL_IMPORT_LOG"] = str(tmp / "imports.tsv")
    env["PYTHONPATH"] = os.pathsep.join(path)
    out, start = [], time.perf_counter()
    for command in stage_commands(stage, mode, args, tmp):
        parse_only = mode == "cheap" and command[0] == "-m"  # the module's own parser, stopped after it parsed
        argv = [sys.executable, *(["-c", PARSE_ONLY, *command[1:]] if parse_only else command)]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        last = ((done.stdout + done.stderr).strip().splitlines() or [""])[-1]  # the error line, or a traceback's
        out.append(Check(what=f"{stage}: {' '.join(command)[:100]}", ok=done.returncode == 0,
                         detail=f"exit {done.returncode}" + (": " + last[:600] if done.returncode else "")))  # fmt: skip
    seconds = time.perf_counter() - start
    if mode == "full" and (tmp / "imports.tsv").is_file():
        foreign = imported_from_outside(tmp / "imports.tsv", args.scratch / "site") - IMAGE_DISTS
        out.append(Check(what=f"{stage}: imports the wheelhouse or the GPU image holds", ok=not foreign,
                         detail=f"not on the image: {sorted(foreign)}; add them to WHEELS in benchmarks/gpu.sh"
                         if foreign else f"{seconds:.0f} s on this CPU"))  # fmt: skip
    return out


# `python -c PARSE_ONLY MODULE ARGS`: the module run as `-m` would, its argparse stopping after a successful parse
# (exit 0) or failing as it would (exit 2).
PARSE_ONLY = """import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def imported_from_outside(log: pathlib.Path, site: pathlib.Path) -> set[str]:
    """The distributions of the site-packages modules in an import log that did not come from `site`: the one whose
    RECORD lists the module's file, else the one that provides its top-level name."""
    owners = importlib.metadata.packages_distributions()
    by_file = _distribution_files()
    site = os.path.realpath(site)
    found = set()
    for line in log.read_text().splitlines():
        top, _, path = line.partition("\t")
        path = os.path.realpath(path)
        if path.startswith(site):
            continue
        owner = by_file.get(path)
        found |= (
            {owner} if owner else {normalise(d) for d in owners.get(top, [top]) if not d.startswith("__editable__")}
        )
    return found - {"qvl", *map(normalise, ("__main__", "__mp_main__"))}  # qvl travels as the repository


def _distribution_files() -> dict[str, str]:
    """{real path of an installed file: its distribution}, for every distribution this interpreter sees."""
    files = {}
    for dist in importlib.metadata.distributions():
        name = normalise(dist.metadata["Name"] or "")
        for file in dist.files or ():
            files[os.path.realpath(dist.locate_file(file))] = name
    return files


def main(argv: list[str] | None = None) -> int:
    """The report; exit 1 if a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cheap", "full"), default="cheap")
    parser.add_argument("--scratch", type=pathlib.Path, required=True, help="gpu.sh's install_stack prefix (full)")
    parser.add_argument("--limit-mib", type=int, required=True)
    parser.add_argument("--setup-seconds", type=int, required=True)
    parser.add_argument("--seconds", nargs="+", required=True, metavar="STAGE=S")
    parser.add_argument("--calls", nargs="+", required=True, help="each call's stages, space-separated")
    parser.add_argument("--wheels", nargs="+", required=True, metavar="NAME==VERSION")
    parser.add_argument("--train-args", default="")
    parser.add_argument("--test-files", nargs="+", required=True)
    parser.add_argument("--whl", type=pathlib.Path, default=ROOT / ".whl", help="the wheelhouse")
    args = parser.parse_args(argv)
    seconds = {stage: int(s) for stage, _, s in (item.partition("=") for item in args.seconds)}
    calls = [call.split() for call in args.calls]
    checks = [
        *check_wheelhouse(args.whl, args.wheels, args.limit_mib),
        *check_calls(calls, seconds, args.setup_seconds),
    ]
    if args.mode == "full" and sys.version_info[:2] != (3, 12):
        checks.append(Check(what="Python 3.12 (the GPU image's)", ok=False, detail=sys.version.split()[0]))
    if args.mode == "full" and not (args.scratch / "site").is_dir():
        checks.append(Check(what="the stack installed", ok=False, detail=f"no {args.scratch / 'site'}"))
    else:
        for stage in dict.fromkeys(stage for call in calls for stage in call):
            checks += run_stage(stage, args.mode, args)
    for check in checks:
        print(f"{'ok  ' if check.ok else 'FAIL'} {check.what}" + (f": {check.detail}" if check.detail else ""))
    failed = sum(not c.ok for c in checks)
    print(f"rehearsal ({args.mode}): {len(checks) - failed} of {len(checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
