"""The fresh interpreter that checks qvl's import-time claims once for test_patches.py, test_runtime.py and
test_deferred_compile.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fresh_import.py")


@pytest.fixture(scope="session")
def fresh_import_report() -> dict:
    """Check name -> its JSON line (tests/foundation/fresh_import.py); "output" holds the process's stderr tail."""
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=SCRIPT.parents[2], capture_output=True, text=True)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')]
    return {line["check"]: line for line in lines} | {"output": f"exit {done.returncode}: {done.stderr[-3000:]}"}


def check_passed(report: dict, name: str) -> dict:
    """The line of check `name`, asserted to have run without an error."""
    assert name in report, f"{name} did not run: {report['output']}"
    assert report[name]["error"] is None, report[name]["error"]
    return report[name]
