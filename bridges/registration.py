"""Registers qvl's bridges with Megatron-Bridge (import this module once before using AutoBridge).

- Importing the bridge module each family record names runs its `@MegatronModelBridge.register_bridge` decorators.
- Megatron-Bridge re-creates providers from a checkpoint's run_config.yaml only for `_target_`s on an
  allowlist (megatron., torch., transformers., ...); qvl's providers and layer-spec functions are
  written there as `qvl.bridges...`, so the prefix is added.
"""

import importlib

from qvl.foundation.families import FAMILIES
from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # before the first megatron.bridge import: TE / nvrx stand-ins where they are absent

from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

for _module in dict.fromkeys(f.bridge_module for f in FAMILIES.values() if f.bridge_module):
    importlib.import_module(_module)  # runs the module's @MegatronModelBridge.register_bridge decorators
register_allowed_target_prefix("qvl.")
