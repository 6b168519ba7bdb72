"""Training parity with transformers: a qvl training step against the step transformers' Trainer takes.

qvl trains offline packs through Megatron-Bridge's loop (qvl's forward step, loss masking, the recipe's optimizer
and schedule); the reference trains the same samples unpacked with transformers' `Trainer`. `run_parity` runs both
from one HF checkpoint and compares per-token losses, every parameter's gradient (by HF name, through the bridge's
own mapping), per-step losses and gradient norms, and the final weights (`qvl verify-training`, docs/parity.md).
"""
