"""Imports qvl's own bridge modules so that their `@MegatronModelBridge.register_bridge` decorators run."""

from qvl.bridges import qwen2_vl, qwen3_vl  # noqa: F401
