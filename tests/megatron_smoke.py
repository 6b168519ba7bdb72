"""A tiny Megatron-Core GPT and a few real training steps: the smoke test of the stack on any device.

Used by the runtime's tests (forward/backward, TP/PP/DP parity, checkpoints) and by `qvl demo` until
the Qwen-VL recipes take over. Everything here is plain Megatron-Core: the DDP wrapper, the
distributed optimizer and the forward-backward schedules, on the local layer spec with SDPA attention.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from qvl.foundation import runtime


@dataclass(kw_only=True, slots=True)
class TinyGPT:
    """Shape of the tiny model: Qwen2's block structure (RMSNorm, SwiGLU, GQA, QKV bias) shrunk."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    seq_length: int = 32


def transformer_config(shape: TinyGPT, **overrides):
    """A TransformerConfig for `shape`, fp32, CPU-initialised, with CUDA-only fusions off."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # CPU initialisation builds each full weight from one seed and slices this rank's part, so a
        # TP=2 model is exactly the TP=1 model split in two.
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
    )
    if runtime.is_active():
        fields.update(runtime.cpu_safe_config_overrides())
    fields.update(overrides)
    config = TransformerConfig(**fields)
    if runtime.is_active():
        runtime.check_cpu_config(config)
    return config


def build_model(shape: TinyGPT, config=None):
    """The tiny GPTModel for this rank's pipeline stage, on the local spec with SDPA attention.

    On a GPU host (runtime off) the model is moved to the current CUDA device.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from qvl.kernels.varlen_attention import use_sdpa_attention

    config = config or transformer_config(shape)
    spec = use_sdpa_attention(get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return model if runtime.is_active() or not torch.cuda.is_available() else model.cuda()


def synthetic_batches(shape: TinyGPT, *, micro_batch_size: int, count: int, seed: int = 0) -> list[dict]:
    """Deterministic token batches with a learnable pattern (each token predicts the next of a cycle)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        start = torch.randint(0, shape.vocab_size, (micro_batch_size, 1), generator=gen)
        step = torch.randint(1, 4, (micro_batch_size, 1), generator=gen)
        tokens = (start + step * torch.arange(shape.seq_length + 1)) % shape.vocab_size
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return batches


def _loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    # clone: the schedule divides the returned loss in place by the number of micro-batches.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator[dict], model):
    """Megatron forward-step function: next batch through the model, returning per-token losses."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    positions = torch.arange(batch["tokens"].shape[1], device=device).expand_as(batch["tokens"])
    output = model(batch["tokens"], positions, attention_mask=None, labels=batch["labels"])
    return output, _loss_func


def train(
    model_chunks: list,
    batches: list[dict],
    *,
    shape: TinyGPT,
    steps: int,
    micro_batch_size: int,
    num_microbatches: int,
    lr: float = 1e-2,
    distributed_optimizer: bool = True,
) -> tuple[list[float], object]:
    """Run `steps` optimizer steps of Megatron-Core's training machinery; returns losses and optimizer.

    `batches` holds this data-parallel rank's micro-batches, consumed in order. `model_chunks` must
    already be wrapped in Megatron's DistributedDataParallel (see `wrap_ddp`).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, use_distributed_optimizer=distributed_optimizer, clip_grad=1.0, weight_decay=0.0
        ),
        model_chunks,
    )
    # The schedule reduces gradients across data-parallel ranks (and embedding/LayerNorm grads across
    # pipeline stages) only through this hook, which Megatron's own training loop installs.
    for chunk in model_chunks:
        chunk.config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    data = iter(batches)
    losses = []
    for _ in range(steps):
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model_chunks,
            num_microbatches=num_microbatches,
            seq_length=shape.seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        optimizer.step()
        losses.append(_mean_loss_across_data_parallel(reduced, parallel_state))
    return losses, optimizer


def _mean_loss_across_data_parallel(reduced: list[dict], parallel_state) -> float:
    """The step's loss as every rank sees it: mean over micro-batches, then over data-parallel ranks."""
    local = torch.stack([r["lm loss"] for r in reduced]).mean() if reduced else torch.zeros(())
    if parallel_state.is_pipeline_last_stage():
        torch.distributed.all_reduce(local, group=parallel_state.get_data_parallel_group())
        local /= parallel_state.get_data_parallel_world_size()
    # Non-last pipeline stages hold no loss: take it from the last stage.
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(local, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return float(local)


def wrap_ddp(model, *, distributed_optimizer: bool = True):
    """Wrap a model in Megatron-Core's DistributedDataParallel with a contiguous fp32 grad buffer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=False
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
