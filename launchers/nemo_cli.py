"""`nemo qvl ...`: qvl's entrypoints in NeMo-Run's CLI (entry-point group `nemo_run.cli`, name `qvl`).

NeMo-Run imports this module when `nemo qvl` runs; each `@run.cli.entrypoint(namespace="qvl")`
function becomes a subcommand.
"""

from __future__ import annotations

import nemo_run as run


@run.cli.entrypoint(namespace="qvl", help="Print qvl and Megatron stack versions (same as `qvl version`).")
def version() -> None:
    """Print the versions `qvl version` prints."""
    from qvl.launchers.info import run_version

    run_version(None)
