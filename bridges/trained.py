"""The model a run trained, loaded from its checkpoint the way `qvl train` resumes it: what every export is checked
against.

An export rebuilds the model its own way (qvl.bridges.convert.load_megatron through Megatron-Bridge's
`model_load_save`; qvl.bridges.adapter_export from HF_BASE's weights and the run's adapter tensors), so a defect there
(tensors skipped, two experts swapped, a sharded checkpoint read wrong) would leave the written files and the model
they were written from wrong the same way, and a comparison of the two would pass. Here the model is built from the
run's own run_config.yaml (the recipe's provider, with qvl's fixes, and its adapters) and loaded by Megatron-Bridge's
`load_checkpoint`, the function training calls at resume (megatron/bridge/training/setup.py): for a PEFT run the
pretrained checkpoint into the base model first, as its PEFT pre-wrap hook does, then the run's adapters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from qvl.bridges.checkpoints import check_megatron_checkpoint
from qvl.foundation.megatron import import_megatron_bridge
from qvl.kernels import speed_cuda_graphs

logger = logging.getLogger(__name__)

# Provider fields reset for a load at another layout, as Megatron-Bridge's own `load_megatron_model` resets them
# (megatron/bridge/training/model_load_save.py); the parallel sizes come from this process's groups.
_LOAD_SETTINGS = {
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "hierarchical_context_parallel_sizes": None,
    "expert_tensor_parallel_size": 1,
    "sequence_parallel": False,
    "overlap_moe_expert_parallel_comm": False,
    "delay_wgrad_compute": False,
    "perform_initialization": False,  # every weight comes from a checkpoint
    "params_dtype": torch.float32,  # the check compares fp32 logits
    "pipeline_dtype": torch.float32,
    "bf16": False,
    "fp16": False,
    **speed_cuda_graphs.eager_settings(),  # a run trained with CUDA graphs saved them in its config
}


def run_config_container(checkpoints: Path) -> Any:
    """Megatron-Bridge's ConfigContainer of the run_config.yaml the latest checkpoint in `checkpoints` was saved
    with, set to load that checkpoint as a resume does (no optimizer, no RNG state). qvl's own section and the dataset
    are left out: neither takes part in building or loading the model."""
    from megatron.bridge.training.utils.checkpoint_utils import read_run_config
    from megatron.bridge.utils.instantiate_utils import instantiate

    import qvl.bridges.registration  # noqa: F401  (qvl's providers and adapters may be instantiated)

    iteration = check_megatron_checkpoint(Path(checkpoints), "RUN")
    config = read_run_config(str(iteration / "run_config.yaml"))
    config["_target_"] = "megatron.bridge.training.config.ConfigContainer"
    config.pop("qvl", None)
    config.pop("dataset", None)
    container = instantiate(config, dataset=None)
    container.checkpoint.load = str(checkpoints)
    container.checkpoint.load_optim = container.checkpoint.load_rng = False
    container.checkpoint.finetune = False
    container.checkpoint.ckpt_step = None
    return container


def load_trained_model(checkpoints: Path) -> tuple[list[Any], Any]:
    """(model chunks, adapters or None): the run's trained model at this process's TP/PP/EP layout, fp32, in eval
    mode, loaded as `qvl train` resumes (collective: every rank of the layout calls it)."""
    import_megatron_bridge()
    from megatron.bridge.training.checkpointing import load_checkpoint
    from megatron.bridge.training.state import GlobalState
    from megatron.core import num_microbatches_calculator as microbatches
    from megatron.core import parallel_state

    from qvl.kernels import torch_wgrad_accum

    config = run_config_container(Path(checkpoints))
    provider = config.model
    for name, value in _LOAD_SETTINGS.items():
        if hasattr(provider, name):
            setattr(provider, name, value)
    provider.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    provider.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    provider.expert_model_parallel_size = parallel_state.get_expert_model_parallel_world_size()
    if provider.pipeline_model_parallel_size == 1:  # a saved stage layout means nothing on one stage
        provider.pipeline_model_parallel_layout = None
    provider.finalize()
    state = GlobalState()
    state.cfg = config
    adapters = config.peft
    if adapters is not None:
        provider.register_pre_wrap_hook(lambda chunks: _pretrained_then_adapters(state, chunks))
    torch_wgrad_accum.provide_kernels()  # a trained run's config has gradient_accumulation_fusion on
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    # A resume sets the step counters from the checkpoint's consumed samples (update_num_microbatches).
    train = config.train
    microbatches.destroy_num_microbatches_calculator()
    microbatches.init_num_microbatches_calculator(
        0, None, train.global_batch_size if train else 1, train.micro_batch_size if train else 1,
        parallel_state.get_data_parallel_world_size(),
    )  # fmt: skip
    try:
        load_checkpoint(state, model, None, None)
    finally:
        microbatches.destroy_num_microbatches_calculator()
    for chunk in model:
        chunk.eval()
    logger.info("loaded the trained model from %s as a resume does", checkpoints)
    return model, adapters


def _pretrained_then_adapters(state: Any, chunks: list[Any]) -> list[Any]:
    """Megatron-Bridge's PEFT pre-wrap hook: the pretrained checkpoint into the base model, then the adapters."""
    from megatron.bridge.training.checkpointing import load_checkpoint

    checkpoint = state.cfg.checkpoint
    resume = checkpoint.load
    checkpoint.load, checkpoint.finetune = checkpoint.pretrained_checkpoint, True
    try:
        load_checkpoint(state, chunks, None, None)
    finally:
        checkpoint.load, checkpoint.finetune = resume, False
    chunks = state.cfg.peft(chunks, training=True)
    state.cfg.peft.set_params_to_save(chunks)
    return chunks


def trained_logits(checkpoints: Path, inputs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits of the run's trained model, the same with its adapters off, None for a full model) on `inputs`, fp32;
    None on the ranks that do not hold the last pipeline stage (collective)."""
    from qvl.bridges import verify

    model, adapters = load_trained_model(Path(checkpoints))
    logits = verify.megatron_logits(model, inputs)
    without = None
    if adapters is not None:
        with adapters.disable_adapter(model):
            without = verify.megatron_logits(model, inputs)
    del model
    return logits, without
