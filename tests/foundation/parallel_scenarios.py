"""Megatron-Core scenarios run both in the test process (the TP=1/PP=1/DP=1 reference) and in two gloo
processes (TP=2, PP=2, DP=2), so the tests can compare them. Results are written with torch.save."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qvl.foundation import distributed, runtime
from tests import megatron_smoke as smoke

SHAPE = smoke.TinyGPT(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16)
MICRO_BATCH = 2
STEPS = 3


def fixed_batch() -> dict:
    return smoke.synthetic_batches(SHAPE, micro_batch_size=MICRO_BATCH, count=1, seed=7)[0]


def training_batches() -> list[dict]:
    """Two micro-batches per step: a single process takes both, data-parallel rank r takes the r-th."""
    return smoke.synthetic_batches(SHAPE, micro_batch_size=MICRO_BATCH, count=2 * STEPS, seed=11)


def load_full_weights(model, full_state: dict) -> None:
    """Copy full (unsharded, single-stage) weights into a model that may be split by TP and PP."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    layers = model.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0
    for name, param in model.named_parameters():
        key = name
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            key = f"decoder.layers.{int(index) + offset}.{rest}"
        full = full_state[key]
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            # A strided partition (SwiGLU's fc1: [gate; up]) gives each rank every tp_size-th chunk.
            stride = getattr(param, "partition_stride", 1)
            chunks = full.chunk(tp_size * stride, dim=param.partition_dim)
            full = torch.cat(chunks[tp_rank::tp_size], dim=param.partition_dim)
        if full.shape != param.shape:
            raise ValueError(f"{name}: expected {tuple(param.shape)}, reference has {tuple(full.shape)}")
        with torch.no_grad():
            param.copy_(full)


def forward_loss(model) -> float:
    """Mean LM loss of the fixed batch through Megatron's schedule (works for any PP size)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reduced = get_forward_backward_func()(
        forward_step_func=smoke.forward_step,
        data_iterator=iter([fixed_batch()]),
        model=[model],
        num_microbatches=1,
        seq_length=SHAPE.seq_length,
        micro_batch_size=MICRO_BATCH,
        forward_only=True,
    )
    loss = reduced[0]["lm loss"] if reduced else torch.zeros(())
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(loss, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    return float(loss)


def reference(out_dir: Path) -> dict:
    """Single process: full weights, forward loss, and the 3-step trajectory on both micro-batches."""
    distributed.init_distributed()
    try:
        model = smoke.build_model(SHAPE)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        torch.save(weights, out_dir / "reference_weights.pt")
        loss = forward_loss(model)
        trained = smoke.wrap_ddp(smoke.build_model(SHAPE))
        load_full_weights(trained.module, weights)
        losses, _ = smoke.train(
            [trained], training_batches(), shape=SHAPE, steps=STEPS, micro_batch_size=MICRO_BATCH, num_microbatches=2
        )
    finally:
        distributed.destroy_distributed()
    return {"forward_loss": loss, "trajectory": losses}


def two_process_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Entry of each spawned process: TP=2, PP=2, DP=2 and checkpoint scenarios, in turn."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    runtime.activate()
    out = Path(out_dir)
    full = torch.load(out / "reference_weights.pt")
    results = {}
    for name, parallel in (("tp2", {"tensor_parallel": 2}), ("pp2", {"pipeline_parallel": 2})):
        distributed.init_distributed(**parallel)
        model = smoke.build_model(SHAPE)
        load_full_weights(model, full)
        results[f"{name}_forward_loss"] = forward_loss(model)
        if name == "tp2":
            results["checkpoint"] = checkpoint_round_trip(model, out / "dist_ckpt")
        _reset_parallel_state()
    distributed.init_distributed()  # TP=1, PP=1: both processes are data-parallel ranks
    model = smoke.wrap_ddp(smoke.build_model(SHAPE))
    load_full_weights(model.module, full)
    mine = training_batches()[rank::world_size]
    results["dp2_trajectory"], _ = smoke.train(
        [model], mine, shape=SHAPE, steps=STEPS, micro_batch_size=MICRO_BATCH, num_microbatches=1
    )
    torch.save(results, out / f"rank{rank}.pt")
    distributed.destroy_distributed()


def checkpoint_round_trip(model, directory: Path) -> dict:
    """Save the model as a Megatron distributed checkpoint, load it into a fresh model, compare bits."""
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))
    fresh = smoke.build_model(SHAPE, smoke.transformer_config(SHAPE, init_method_std=0.5))
    before = _max_abs_diff(model, fresh)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(directory)))
    return {"differs_before_load": before > 0, "max_abs_diff_after_load": _max_abs_diff(model, fresh)}


def _max_abs_diff(a, b) -> float:
    pairs = zip(a.state_dict().items(), b.state_dict().items())
    return max(float((x - y).abs().max()) for (k, x), (_, y) in pairs if isinstance(x, torch.Tensor) and x.numel())


def _reset_parallel_state() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
