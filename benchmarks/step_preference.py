"""The DPO step's census figure: vision tower passes per pair (issue 39's goal: 1, a pair's sides sharing one pass).

`python -m benchmarks.step_preference [--out .bench]` (part of bench_step, so of `make bench`). In a child process:
the shipped sample pairs prepared for the tiny Qwen2.5-VL, every pack through the preference loader
(qvl.data.preference_encode) and qvl's step (`model_inputs`, `host_batch`, the model's forward and backward), once as
loaded (each distinct image of a micro-batch encoded once) and once with the loader's de-duplication off; the
patches the vision tower encodes are counted at its forward. Passes per pair = 2 x encoded / encoded without
de-duplication (there every pair's images are encoded for each side).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

FAMILY = "qwen2_5_vl"
GOAL_TOWER_PASSES_PER_PAIR = 1.0


def census(out_dir: pathlib.Path) -> dict:
    """The figure and its check, counted in a child process (Megatron's global state stays out of this one)."""
    run_dir = out_dir / "step-dpo"
    run_dir.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "benchmarks.step_preference", "--out", str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=root)
    (run_dir / "log.txt").write_text(done.stdout + done.stderr)
    result = run_dir / "dpo_census.json"
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"the DPO census failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def _patches_encoded(model, batches) -> int:
    """The patches the vision tower encodes in qvl's step (forward and backward) over `batches`."""
    import torch

    from qvl.training.step import host_batch, model_inputs

    seen = []
    handle = model.visual.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        for batch in batches:
            kwargs, loss_mask = model_inputs(batch, torch.device("cpu"))
            model.zero_grad(set_to_none=True)
            losses = model(**kwargs, host_batch=host_batch(model, batch, kwargs, torch.device("cpu")))
            (losses * loss_mask).sum().backward()
    finally:
        handle.remove()
    return sum(seen)


def _tiny_model(hf: pathlib.Path):
    """The tiny Qwen2.5-VL as training builds it (random weights, fp32, CPU)."""
    from transformers import AutoConfig

    from qvl.bridges.providers import apply_provider_fixes, auto_bridge

    hf_config = AutoConfig.from_pretrained(str(hf))
    provider = auto_bridge(hf_config).to_megatron_provider(load_weights=False)
    apply_provider_fixes(provider, hf_config)
    provider.gradient_accumulation_fusion = False  # no DDP wrapper, so no main_grad
    provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)[0]


def worker(out: pathlib.Path) -> int:
    """Prepare the pairs, count the tower's patches with and without de-duplication, write dpo_census.json."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.planned import PackMicroBatches
    from qvl.data.preference_encode import PreferenceTaskEncoder
    from qvl.data.preference_samples import write_preference_samples
    from qvl.data.prepare import PrepareConfig, prepare
    from qvl.foundation import distributed, runtime

    hf = write_tiny_hf_checkpoint(out / "hf", FAMILY)
    jsonl, media = write_preference_samples(out / "pairs", format="trl", count=12, with_bad=False)
    data = out / "data"
    prepare(PrepareConfig(input=jsonl, media_root=media, family=FAMILY, hf_path=hf, seq_length=512, output=data))
    packs = [(row["pack"], row["shard"]) for row in map(json.loads, (data / "packs.jsonl").read_text().splitlines())]
    runtime.activate(force=True)
    distributed.init_distributed()
    try:
        model = _tiny_model(hf)
        encoded = {}
        for deduplicate in (True, False):
            encoder = PreferenceTaskEncoder(hf_path=hf, family=FAMILY, deduplicate_vision=deduplicate)
            batches = PackMicroBatches(data, encoder, packs, 1)
            encoded[deduplicate] = _patches_encoded(model, (batches[i] for i in range(len(batches))))
    finally:
        distributed.destroy_distributed()
    passes = round(2 * encoded[True] / encoded[False], 3)
    result = {
        "packs": len(packs),
        "patches_encoded": encoded[True],
        "patches_encoded_without_deduplication": encoded[False],
        "vision_tower_passes_per_pair": passes,
        "checks": [
            {
                "figure": "DPO: vision tower passes per pair",
                "value": passes,
                "goal": f"<= {GOAL_TOWER_PASSES_PER_PAIR:g}",
                "met": passes <= GOAL_TOWER_PASSES_PER_PAIR,
            }
        ],
    }
    (out / "dpo_census.json").write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: the census in this process (the child `census` starts)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".bench/step-dpo"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    code = worker(args.out)
    print(json.dumps(json.loads((args.out / "dpo_census.json").read_text()), indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
