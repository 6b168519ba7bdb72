"""The `qvl` command from a test: in a new interpreter where the process is what a test checks (its output, exit
status, environment, launcher), else through the same `main()` in the test's own process."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys


def qvl(*args: str) -> str:
    """`qvl ARGS` in a new interpreter, for tests about the command's process: its output, exit and environment."""
    out = subprocess.run([sys.executable, "-m", "qvl.launchers.cli", *args], capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


def qvl_in_process(*args: str) -> str:
    """`qvl ARGS` through the same `main()` in this process, for runs whose process is not what a test checks:
    no new interpreter importing torch, Megatron and transformers again (most of a tiny run's time on 2 cores).
    Returns what it printed and logged (records with their tracebacks), as `qvl` would show it."""
    from qvl.launchers.cli import main

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(list(args))
    finally:
        logging.getLogger().removeHandler(handler)
    assert code == 0, out.getvalue()[-4000:]
    return out.getvalue()
