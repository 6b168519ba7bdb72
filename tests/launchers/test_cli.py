"""The `qvl` command table: building it is cheap (every `qvl` call builds it, `qvl data prepare` on a CPU node too),
and the names it offers match the library's."""

from __future__ import annotations

import subprocess
import sys


def test_building_the_parser_imports_neither_torch_nor_transformers():
    code = "import sys; from qvl.launchers import cli; cli.build_parser(); print(sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_convert_dtype_choices_are_the_converters():
    from qvl.bridges.convert import DTYPES
    from qvl.launchers.commands.convert import DTYPE_NAMES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


def test_the_command_lines_log_handler_writes_to_stderr_as_it_is_now(monkeypatch):
    """`quiet_logging` (qvl, and nemo qvl on import) gives the root logger a handler: a record goes to sys.stderr as
    it is when logged, not to a stream that was sys.stderr when the handler was made and has been closed since."""
    import io
    import logging

    from qvl.launchers.cli import StderrNow

    then = io.StringIO()
    monkeypatch.setattr("sys.stderr", then)
    handler = StderrNow()
    then.close()
    now = io.StringIO()
    monkeypatch.setattr("sys.stderr", now)
    handler.handle(logging.LogRecord("megatron", logging.WARNING, __file__, 1, "a warning", None, None))
    assert now.getvalue() == "a warning\n"
