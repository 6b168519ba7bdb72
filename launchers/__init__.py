"""Launchers: the qvl CLI, NeMo-Run executors and entrypoints, and the CPU runtime for Megatron."""
