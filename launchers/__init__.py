"""Launchers: the `qvl` command line, `nemo qvl` entrypoints, NeMo-Run executors, launch and the demo."""
