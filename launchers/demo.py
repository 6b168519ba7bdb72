"""`qvl demo`: the main job, end to end with a tiny model, on CPU (or a GPU where there is one).

Today it runs what exists: Megatron-Core's real training machinery (DDP, distributed optimizer,
forward-backward schedule) on a tiny GPT through qvl's CPU runtime and SDPA attention. The Qwen-VL
pipeline (prepare data -> convert -> plan -> train -> export -> verify) replaces it as issues #3, #4
and #6 land; the demo says which parts it ran.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run_demo(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from qvl.launchers import runtime, smoke

    console = Console()
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    on_cpu = args.device == "cpu" or not torch.cuda.is_available()
    if on_cpu:
        runtime.activate(force=True)
    device = "cpu (qvl CPU runtime)" if on_cpu else f"cuda ({torch.cuda.get_device_name(0)})"
    console.print(f"[bold]qvl demo[/] on {device}")
    console.print("Runs now: tiny Megatron-Core GPT, DDP + distributed optimizer, SDPA attention, "
                  f"{args.steps} steps.\nNot yet: the Qwen-VL pipeline (data #4, convert #3, recipes/train #6).")  # fmt: skip
    started = time.perf_counter()
    runtime.init_distributed()
    try:
        shape = smoke.TinyGPT()
        model = smoke.wrap_ddp(smoke.build_model(shape))
        batches = smoke.synthetic_batches(shape, micro_batch_size=2, count=2 * args.steps)
        losses, _ = smoke.train([model], batches, shape=shape, steps=args.steps, micro_batch_size=2, num_microbatches=2)
    finally:
        runtime.destroy_distributed()
    seconds = time.perf_counter() - started
    summary = {"device": device, "steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1],
               "losses": losses, "seconds": round(seconds, 2)}  # fmt: skip
    (out_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps in {seconds:.1f} s")
    console.print(f"summary: {out_dir / 'demo_summary.json'}")
    return 0 if losses[-1] < losses[0] else 1


def register(subparsers) -> None:
    """Add `qvl demo`."""
    demo = subparsers.add_parser("demo", help="run the pipeline end to end with a tiny model (CPU or GPU)")
    demo.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu forces the CPU runtime")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--output", default=".demo", help="where to write the summary (default .demo/)")
    demo.set_defaults(func=run_demo)
