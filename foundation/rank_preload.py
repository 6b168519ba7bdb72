"""Imported once by the forkserver that `run_on_ranks` forks its local ranks from: torch and Megatron-Bridge (with
qvl's stand-ins for what is missing), so that no rank spends its first ~15 s of CPU importing them again."""

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()
