"""Imported once by the forkserver that `start_ranks` forks its local ranks from: torch and Megatron-Bridge (with
qvl's stand-ins for what is missing), so that no rank spends its first ~15 s of CPU importing them again.

SIGUSR1 prints a rank's Python stacks (`start_ranks` sends it to the ranks still running when one has failed). It is
registered here, before any rank is forked, so a rank has it from its first instruction: registered in the rank
itself, a rank not yet that far when its peer failed was ended by the signal's default action, and the job reported
"process 0 terminated with signal SIGUSR1" instead of the peer's error."""

import faulthandler
import logging
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)

from qvl.foundation.megatron import import_megatron_bridge  # noqa: E402

# The forkserver writes where the process that started it does: Megatron-LM's training module gives the root logger a
# stdout handler at INFO when imported, and Megatron-Bridge then logs its optional-symbol probes (a traceback each)
# there, into a caller's `--json` output. Records at INFO and below are dropped while it imports (qvl's command line
# drops them too); the ranks forked later log as Megatron configured.
logging.disable(logging.INFO)
try:
    import_megatron_bridge()
finally:
    logging.disable(logging.NOTSET)
