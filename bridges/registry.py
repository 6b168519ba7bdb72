"""Registers qvl's bridges with Megatron-Bridge (import this module once before using AutoBridge).

- Importing the bridge modules runs their `@MegatronModelBridge.register_bridge` decorators.
- Megatron-Bridge re-creates providers from a checkpoint's run_config.yaml only for `_target_`s on an
  allowlist (megatron., torch., transformers., ...); qvl's providers and layer-spec functions are
  written there as `qvl.bridges...`, so the prefix is added.
"""

from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

from qvl.bridges import qwen2_vl, qwen3_vl  # noqa: F401

register_allowed_target_prefix("qvl.")
