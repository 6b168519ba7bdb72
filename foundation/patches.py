"""Every change qvl makes to someone else's code, in one table, applied and undone through one context manager.

Four kinds of entry:
- `Patch`: an attribute of an upstream module or class replaced while a group is applied (`applied(group)`, or
  `apply(group)` / `undo(group)`). The replacement is named as "qvl.module:factory"; the factory receives the
  original and returns what goes in its place, so wrappers can call through. Nothing is applied at import.
- `StandIn`: an upstream module that imports an optional package unconditionally; `qvl.foundation.megatron`
  gives it a stand-in for the duration of that one import (see there).
- `KeptOut`: an installed package an upstream plugin loader would import with Megatron-Bridge, kept out of that one
  import (`qvl.foundation.megatron`) because qvl never uses the plugin.
- `PrivateRead`: a private name qvl reads or overrides without replacing it.
A fifth table, `qvl.foundation.forks.FORKS`, names every upstream function whose body qvl copies and changes (a
patch's replacement or a method of qvl's own model classes), with a hash of that upstream source.

The entry kinds and the kinds of group are defined in qvl.foundation.patch_entries. A group's name says its kind
first (`<kind>-<subject>`, `KINDS`): cpu- for the CPU runtime, torch- for a torch stand-in of a missing Transformer
Engine / Apex / flash-linear-attention piece, fix- for an upstream bug, speed- for a faster path. Which groups a run
uses is decided in one place, qvl.kernels.switch; `qvl doctor --patches` lists them, and docs/upstream.md is this
table as `qvl doctor --patches --markdown` writes it.

Each entry names the version it was written against, taken from the pinned stack (qvl.foundation.stack: the
requirement files are the one place a version is written); `tests/foundation/test_patches.py` checks at the pinned
versions that every target exists (with the parameters listed) and that every fork's upstream source is the one
hashed, so a version bump fails there, in one place, naming each fork to re-read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from qvl.foundation.patch_entries import KeptOut, Patch, PrivateRead, StandIn, load, owner_and_name
from qvl.foundation.stack import pinned

logger = logging.getLogger(__name__)

MCORE = pinned("megatron-core")
MBRIDGE = pinned("megatron-bridge")
TORCH = pinned("torch")
TRANSFORMERS = pinned("transformers")
NEMO_RUN = pinned("nemo-run")
MODELOPT = pinned("nvidia-modelopt")
FLA = pinned("fla-core")  # GPU machines only (launchers/requirements-gpu.txt): its entries are checked there
_RUNTIME = "qvl.foundation.runtime"
_GRAPHS = "qvl.foundation.graph_replay"
_CUDA_WHY = "Megatron calls torch.cuda process-state functions unconditionally around communication and timing"
_RNG_WHY = (
    "the model-parallel RNG tracker forks the CUDA generator; on CPU it must fork the CPU generator so dropout "
    "and initialisation still differ across TP ranks and repeat across DP ranks"
)


def _cuda(name: str, factory: str, why: str = _CUDA_WHY) -> Patch:
    return Patch(group="cpu-runtime", target=f"torch.cuda:{name}", replacement=f"{_RUNTIME}:{factory}", why=why,
                 version=TORCH)  # fmt: skip


# targets two groups replace, and their parameters
_ROUTER_ATTACH = "megatron.core.transformer.moe.router:TopKRouter.attach_and_log_load_balancing_loss"
_ROUTER_ATTACH_PARAMS = ("self", "activation", "aux_loss_coeff", "aux_loss", "aux_loss_name", "reduce_group")
_FORWARD_MLP_PARAMS = ("self", "hidden_states", "inference_context", "padding_mask", "packed_seq_params")


PATCHES: tuple[Patch, ...] = (
    # --- cpu-runtime: qvl.foundation.runtime.activate() (CPU only; a no-op where CUDA exists)
    _cuda("current_device", "answer_device_zero", "callers index devices; 0 is a CUDA ordinal the runtime maps to CPU"),
    *(_cuda(name, factory) for name, factory in (
        ("set_device", "no_op"), ("synchronize", "no_op"), ("empty_cache", "no_op"), ("Stream", "null_stream_class"),
        ("Event", "null_stream_class"), ("ExternalStream", "null_stream_class"),
        ("current_stream", "null_stream_factory"), ("default_stream", "null_stream_factory"),
        ("stream", "null_stream_context"), ("nvtx", "null_nvtx"))),
    _cuda("get_rng_state", "cpu_rng_state", _RNG_WHY),
    _cuda("set_rng_state", "set_cpu_rng_state", _RNG_WHY),
    _cuda("manual_seed", "seed_cpu_generator", "torch.manual_seed calls it; it must seed the CPU generator"),
    _cuda("manual_seed_all", "no_op", "torch.manual_seed calls it; the CPU generator is seeded already"),
    Patch(group="cpu-runtime", target="torch.cuda.random:get_rng_state", replacement=f"{_RUNTIME}:cpu_rng_state",
          why=_RNG_WHY, version=TORCH),
    Patch(group="cpu-runtime", target="torch.cuda.random:set_rng_state", replacement=f"{_RUNTIME}:set_cpu_rng_state",
          why=_RNG_WHY, version=TORCH),
    Patch(group="cpu-runtime", target="megatron.core.tensor_parallel.random:_get_cuda_rng_state",
          replacement=f"{_RUNTIME}:cpu_rng_state", why=_RNG_WHY, version=MCORE),
    Patch(group="cpu-runtime", target="megatron.core.tensor_parallel.random:_set_cuda_rng_state",
          replacement=f"{_RUNTIME}:set_cpu_rng_state", why=_RNG_WHY, version=MCORE, params=("new_state",)),
    # --- cpu-training: qvl.foundation.runtime.enable_bridge_training()
    Patch(group="cpu-training", target="megatron.bridge.training.initialize:initialize_megatron",
          replacement=f"{_RUNTIME}:allow_no_cuda", version=MBRIDGE, params=("cfg",),
          why="it asserts CUDA unless allow_no_cuda, which Megatron-Bridge's setup path never passes"),
    Patch(group="cpu-training", target="megatron.bridge.training.setup:initialize_megatron",
          replacement=f"{_RUNTIME}:allow_no_cuda", version=MBRIDGE, params=("cfg",),
          why="setup.py imported initialize_megatron by name; the same wrapper as initialize's"),
    Patch(group="cpu-training", target="megatron.bridge.training.initialize:_set_random_seed",
          replacement=f"{_RUNTIME}:seed_rng_tracker_too", version=MBRIDGE, params=("seed_",),
          why="it registers the model-parallel RNG tracker only when a CUDA device is counted"),
    Patch(group="cpu-training", target="megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
          replacement=f"{_RUNTIME}:split_sizes_as_numpy", version=MCORE, params=("tensor", "as_numpy", "record_stream"),
          why="the all-to-all token dispatcher makes its split sizes numpy only when they are CUDA tensors; on CPU they "
              "stay tensors, which torch.distributed.all_to_all_single refuses: every expert_parallel > 1 step failed"),
    # --- cpu-cuda-graphs: qvl.foundation.graph_replay.recorded_graphs() (CPU tests and smoke runs of graphed steps)
    *(Patch(group="cpu-cuda-graphs", target=f"torch.cuda:{name}", replacement=f"{_GRAPHS}:{factory}", why=why,
            version=TORCH) for name, factory, why in (
        ("CUDAGraph", "recorded_graph_class", "a graph needs a device: here a capture records the aten ops it runs "
                                              "and a replay runs them again on the same tensors"),
        ("graph", "recorded_capture_class", "its capture context synchronizes the device and sets a stream"),
        ("graph_pool_handle", "pool_handles", "a graph pool is device memory; a token stands for it"),
        ("is_current_stream_capturing", "capturing_here", "it asks the device's stream"),
        ("memory_stats", "empty_memory_stats", "Megatron-Core logs the allocator's figures around its captures"),
        ("set_stream", "no_op", "Megatron-Core moves its captures off the default stream"),
        ("_sleep", "no_op", "Megatron-Core puts a wait kernel on each side stream it joins to a capture"))),
    *(Patch(group="cpu-cuda-graphs", target=f"torch._C:{name}", replacement=f"{_GRAPHS}:no_op",
            why="Megatron-Core allocates its graphs' static buffers in the graph pool of the device",
            version=TORCH) for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool")),
    Patch(group="cpu-cuda-graphs", target="megatron.core.transformer.cuda_graphs:_ensure_generator_state_is_cudagraph_safe",
          replacement=f"{_GRAPHS}:generator_as_it_is", version=MCORE, params=("gen",),
          why="it reads each generator's graph-safe state, which only a device's generator has"),
    # --- fix-megatron-setup: around every Megatron-Bridge training loop qvl runs, on any device
    Patch(group="fix-megatron-setup", target="megatron.bridge.training.initialize:compile_helpers",
          replacement="qvl.foundation.megatron:prebuilt_dataset_helpers", version=MBRIDGE,
          why="it runs `make` in megatron/core/datasets, which the megatron-core wheel ships prebuilt and without a "
              "Makefile: every pip-installed training run exits there (seen on an H100); from source it still builds"),
    Patch(group="fix-megatron-setup", target="megatron.training.utils.log_utils:add_filter_to_all_loggers",
          replacement="qvl.foundation.megatron:filter_except_qvl", version=MCORE, params=("filter",),
          why="Megatron-Bridge's setup_logging adds a WARNING-dropping filter to every existing logger for the rest "
              "of the process: after an in-process training loop qvl's own warnings were silently dropped"),
    # --- fix-adam-resume: qvl.kernels.fix_adam_resume (any device without TE/Apex)
    Patch(group="fix-adam-resume",
          target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict",
          replacement="qvl.kernels.fix_adam_resume:state_dict_with_initial_steps", version=MCORE,
          params=("self",),
          why="with torch Adam it asserts one `step` value, and a fresh optimizer (the resume template) has none"),
    Patch(group="fix-adam-resume",
          target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
          replacement="qvl.kernels.fix_adam_resume:load_state_dict_with_own_steps", version=MCORE,
          params=("self", "state_dict"),
          why="it gives every parameter ONE shared `step` tensor, then overwrites it with the template's 0"),
    # --- fix-mtp-loss: qvl.kernels.fix_mtp_loss (any device; training and verify of a model with MTP layers)
    Patch(group="fix-mtp-loss", target="megatron.core.models.gpt.gpt_model:process_mtp_loss",
          replacement="qvl.kernels.fix_mtp_loss:keep_mtp_states", version=MCORE,
          params=("hidden_states", "labels", "loss_mask", "output_layer"),
          why="it weights MTP tokens per micro-batch (not token-weighted like the main loss), logs a per-micro-batch "
              "mean through a global tracker and reads packed bounds to the host; qvl.training.mtp computes the "
              "MTP loss from the states instead"),
    # --- fix-preference-moe-aux: qvl.kernels.fix_preference_moe_aux (around a preference step's forward of an MoE model)
    Patch(group="fix-preference-moe-aux", target=_ROUTER_ATTACH, params=_ROUTER_ATTACH_PARAMS,
          replacement="qvl.kernels.fix_preference_moe_aux:counted_in_pairs", version=MCORE,
          why="with calculate_per_token_loss it multiplies the balancing loss by the micro-batch's tokens, assuming the "
              "loss counts tokens; a preference loss counts pairs, so the balancing loss would weigh tokens/pairs "
              "times its SFT weight"),
    # --- fix-moe-pad-tokens: qvl.kernels.fix_moe_pad_tokens (training an MoE model whose packs are padded)
    Patch(group="fix-moe-pad-tokens", target="megatron.core.transformer.transformer_layer:TransformerLayer._forward_mlp",
          replacement="qvl.kernels.fix_moe_pad_tokens:masking_pad", version=MCORE, params=_FORWARD_MLP_PARAMS,
          why="Megatron-Bridge's Qwen3-VL language model passes no padding mask to its layers, so the router counts a "
              "padded pack's pad tokens in its load-balancing loss, z-loss and expert-bias counts; the step marks "
              "where the pad starts and the layer masks it"),
    Patch(group="fix-moe-pad-tokens",
          target="megatron.core.transformer.transformer_layer:MoETransformerLayer._forward_mlp",
          replacement="qvl.kernels.fix_moe_pad_tokens:masking_pad", version=MCORE, params=_FORWARD_MLP_PARAMS,
          why="qvl's MoE layers are MoETransformerLayers (qvl.kernels.local_specs), whose own _forward_mlp runs the "
              "router's CUDA graph without the base class's: the mask is made there, as one of that graph's inputs"),
    Patch(group="fix-moe-pad-tokens", target=_ROUTER_ATTACH, params=_ROUTER_ATTACH_PARAMS,
          replacement="qvl.kernels.fix_moe_pad_tokens:weighed_evenly", version=MCORE,
          why="with calculate_per_token_loss it scales a rank's balancing-loss share by the rank's token count, but "
              "with a padding mask that count is the reduce group's total (the all-reduce of the tokens per expert "
              "writes into the local counts): a masked pack's balancing loss weighed TP times too much; divided by "
              "the group's size"),
    # --- fix-qwen3-vl-deepstack-sp: qvl.kernels.fix_qwen3_vl_deepstack_sp (training a model with the Qwen3-VL tower)
    Patch(group="fix-qwen3-vl-deepstack-sp",
          target="megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model:split_deepstack_embs",
          replacement="qvl.kernels.fix_qwen3_vl_deepstack_sp:summed_over_ranks", version=MBRIDGE,
          params=("visual_pos_masks", "deepstack_visual_embeds", "tp_size", "tp_rank", "cp_size", "cp_rank",
                  "sequence_parallel"),
          why="under sequence parallelism each TP rank slices its visual tokens' rows out of the deepstack features, "
              "so the gradient reaching the tensor-parallel mergers and tower differs per rank and each rank's "
              "weight gradients cover its own tokens only"),
    # --- fix-expert-adapter-tp: qvl.kernels.fix_expert_adapter_tp (training adapters on MoE experts)
    Patch(group="fix-expert-adapter-tp", target="megatron.bridge.peft.utils:ParallelLinearAdapter.forward",
          replacement="qvl.kernels.fix_expert_adapter_tp:summed_over_expert_ranks", version=MBRIDGE,
          params=("self", "x"),
          why="where expert_tensor_parallel_size > 1 an expert adapter skips its TP communication as the expert's "
              "linears do: its bottleneck (linear_fc2) or the bottleneck's gradient (linear_fc1) is one rank's part"),
    # --- fix-empty-optimizer: qvl.kernels.fix_empty_optimizer (training adapters)
    Patch(group="fix-empty-optimizer", target="megatron.bridge.training.optim:get_megatron_optimizer",
          replacement="qvl.kernels.fix_empty_optimizer:dropping_empty_members", version=MBRIDGE,
          params=("config", "model_chunks", "config_overrides", "use_gloo_process_groups", "pg_collection"),
          why="with expert adapters alone the chain's dense optimizer trains nothing on any rank, and the first "
              "checkpoint save reads its param groups and state (None)"),
    # --- fix-peft-without-te: qvl.kernels.fix_peft_without_te.without_te() (around every PEFT transform, where TE is
    # absent: qvl.bridges.adapters' LoRA and DoRA apply it themselves)
    *(
        Patch(group="fix-peft-without-te", target=f"megatron.bridge.peft.{module}:{flag}",
              replacement="qvl.kernels.fix_peft_without_te:te_absent", version=MBRIDGE,
              why="without TE Megatron-Core's `te` is a MagicMock, so safe_import_from finds mock TE linears and the "
                  "flag says TE is there: every LoRA target then fails in isinstance() (utils.py:591); false, "
                  "Megatron-Bridge takes its plain Megatron-Core branches")
        for module, flag in (
            ("utils", "HAVE_TE"),
            ("module_matcher", "HAVE_TE_COL_LINEAR"),
            ("module_matcher", "HAVE_TE_LN_COL_LINEAR"),
            ("module_matcher", "HAVE_TE_ROW_LINEAR"),
        )
    ),
    # --- speed-grouped-experts: qvl.kernels.speed_grouped_experts (training an MoE model without TE)
    Patch(group="speed-grouped-experts", target="megatron.core.transformer.moe.experts:SequentialMLP.forward",
          replacement="qvl.kernels.speed_grouped_experts:grouped_experts", version=MCORE,
          params=("self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs"),
          why="without TE the experts run one after another (a host read per layer, a split, two GEMMs and the "
              "activation per expert); torch's grouped GEMM runs them as two"),
    # --- speed-moe-one-rank-dispatch: qvl.kernels.speed_moe_one_rank_dispatch (training an MoE model)
    Patch(group="speed-moe-one-rank-dispatch", target="megatron.core.transformer.moe.token_dispatcher:sort_chunks_by_idxs",
          replacement="qvl.kernels.speed_moe_one_rank_dispatch:skipping_identity", version=MCORE,
          params=("input", "split_sizes", "sorted_idxs", "probs", "fused"),
          why="with one EP and one expert-TP rank the dispatcher's sort by local expert is the identity, yet it "
              "splits the tokens at counts read to the host and concatenates them again"),
    Patch(group="speed-moe-one-rank-dispatch",
          target="megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
          replacement="qvl.kernels.speed_moe_one_rank_dispatch:counts_on_device", version=MCORE,
          params=("self", "point", "tokens_per_expert"),
          why="with one EP and one expert-TP rank (dropless) nothing is exchanged and the sort is the identity, yet "
              "the dispatcher copies its token counts to the host and makes the host wait for them in every layer"),
    # --- speed-optimizer: qvl.kernels.speed_optimizer (around every training loop, any device)
    Patch(group="speed-optimizer", target="megatron.core.optimizer.clip_grads:l2_norm_impl",
          replacement="qvl.kernels.speed_optimizer:foreach_l2_norm", version=MCORE,
          params=("chunk_size", "noop_flag", "tensor_lists", "per_tensor"),
          why="without TE/Apex the grad norm reads one scalar per parameter tensor to the host; one foreach norm"),
    Patch(group="speed-optimizer", target="megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
          replacement="qvl.kernels.speed_optimizer:foreach_scale", version=MCORE,
          params=("chunk_size", "noop_flag", "tensor_lists", "scale"),
          why="without TE/Apex the clip scale launches one multiply and one copy per parameter tensor"),
    Patch(group="speed-optimizer", target="megatron.core.optimizer.optimizer:multi_tensor_scale_impl",
          replacement="qvl.kernels.speed_optimizer:foreach_scale", version=MCORE,
          params=("chunk_size", "noop_flag", "tensor_lists", "scale"),
          why="the same fallback in the non-distributed optimizer's main/model copies"),
    Patch(group="speed-optimizer",
          target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_main_params_to_model_params",
          replacement="qvl.kernels.speed_optimizer:foreach_main_to_model_copy", version=MCORE, params=("self",),
          why="one copy kernel per parameter tensor and a view made each step; one foreach copy over cached views"),
    Patch(group="speed-optimizer",
          target="megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
          replacement="qvl.kernels.speed_optimizer:fused_adam", version=MCORE, params=("config", "model_chunks"),
          why="torch AdamW is built with foreach kernels (their temporaries hold a copy of the optimizer state); "
              "its fused kernel is one pass, where the device has it"),
    # --- speed-small-grads: qvl.kernels.speed_small_grads (around every training loop, any device)
    Patch(group="speed-small-grads",
          target="megatron.core.distributed.distributed_data_parallel:DistributedDataParallel._make_backward_post_hook",
          replacement="qvl.kernels.speed_small_grads:batched_hook", version=MCORE, params=("self", "param"),
          why="each bias and norm weight's gradient is added into main_grad by its own hook and kernel, per "
              "micro-batch (~13% of a Qwen-VL step's launches); kept until the backward ends and added by two "
              "foreach kernels"),
    # --- speed-rotary: qvl.kernels.speed_rotary (around every training loop, any device)
    Patch(group="speed-rotary", target="megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_thd",
          replacement="qvl.kernels.speed_rotary:packed_rotary", version=MCORE,
          params=("t", "cu_seqlens", "freqs", "rotary_interleaved", "mla_rotary_interleaved", "mscale", "cp_group"),
          why="packed rotary reads every sub-sequence's length and start to the host in every attention layer; with "
              "one CP rank and per-token frequencies the whole-pack rotary is bitwise the same"),
    Patch(group="speed-rotary",
          target="megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention:apply_rotary_pos_emb_absolute",
          replacement="qvl.kernels.speed_rotary:absolute_rotary", version=MBRIDGE,
          params=("t", "freqs", "config", "cu_seqlens"),
          why="Qwen3-VL's rotary (language model and vision tower) is about ten eager kernels each way per query or "
              "key; one compiled region where CUDA and Triton are"),
    # --- speed-sync-free: qvl.kernels.speed_sync_free (around every training loop, any device). The Qwen2/2.5-VL and
    # Qwen3-VL forwards without host reads are methods of qvl's own model classes (qvl.bridges.qwen2_5_vl, qwen3_vl)
    Patch(group="speed-sync-free", target="megatron.bridge.training.train:train_step",
          replacement="qvl.kernels.speed_sync_free:train_step_with_loss_check", version=MBRIDGE,
          params=("forward_step_func", "data_iterator", "model", "optimizer", "scheduler", "global_state"),
          why="the loss's NaN/Inf check reads every micro-batch's loss to the host (2 reads each); qvl's step keeps "
              "them and this reads them once, after the step"),
    # --- speed-jit-warmup: qvl.kernels.speed_jit_warmup (around every training loop)
    Patch(group="speed-jit-warmup", target="megatron.bridge.training.setup:set_jit_fusion_options",
          replacement="qvl.kernels.speed_jit_warmup:warm_up_what_is_used", version=MBRIDGE,
          params=("model_config", "micro_batch_size"),
          why="setup compiles the fused bias-activation and bias-dropout-add functions on sample tensors also where "
              "the config turns both fusions off and the model never calls them (every CPU run): ~7.7 s of CPU in "
              "each new process, in every rank"),
    # --- speed-sync-save: qvl.kernels.speed_sync_save (around every training loop that saves synchronously)
    Patch(group="speed-sync-save",
          target="megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue",
          replacement="qvl.kernels.speed_sync_save:in_process_results_queue", version=MCORE, params=("mp_mode",),
          why="a synchronous save's writer threads report through a multiprocessing manager that the first save of "
              "each process spawns (a new interpreter importing the training script again: ~6 s and ~5 s of CPU); "
              "the results never leave the process, so a queue.Queue carries them"),
    # --- speed-cross-entropy: qvl.kernels.speed_cross_entropy (around every training loop, any device without TE/Apex)
    Patch(group="speed-cross-entropy",
          target="megatron.core.models.common.language_module.language_module:fused_vocab_parallel_cross_entropy",
          replacement="qvl.kernels.speed_cross_entropy:lean_fused_cross_entropy", version=MCORE,
          params=("vocab_parallel_logits", "target", "tp_group"),
          why="the native fused cross-entropy keeps an fp32 softmax of the logits for backward (twice the bf16 "
              "logits), moves ~17 GB per 4k pack over Qwen's vocabulary and rounds the logits' gradient to bf16 in "
              "fp32 training; qvl's keeps the logits, recomputes the softmax (~4.7 GB) and keeps their dtype"),
    # --- speed-cuda-graphs: qvl.kernels.speed_cuda_graphs (around every training loop that asks for graphs)
    Patch(group="speed-cuda-graphs", target="megatron.bridge.training.setup:initialize_megatron",
          replacement="qvl.kernels.speed_cuda_graphs:with_layer_graphs", version=MBRIDGE, params=("cfg",),
          why="without TE the step is bound by the host (an H100 idle 31% of the step, ~17k launches); before "
              "Megatron is initialised the language model's config asks for Megatron-Core's own per-layer CUDA "
              "graphs (cuda_graph_impl='local'), so the RNG tracker is graph-safe and the layers build graph managers"),
    Patch(group="speed-cuda-graphs", target="megatron.bridge.models.gpt_provider:validate_cuda_graph_configuration",
          replacement="qvl.kernels.speed_cuda_graphs:allowing_layer_graphs", version=MBRIDGE, params=("config",),
          why="when it builds the language model it refuses cuda_graph_impl='local' except for full-iteration graphs "
              "(per-layer graphs only through TE): every run with cuda_graphs=true failed at its build (seen with the "
              "CPU's recorded graphs); Megatron-Core's schedules capture and replay the local per-layer graphs "
              "themselves, so the settings with_layer_graphs gave pass, any others are checked as upstream does"),
    Patch(group="speed-cuda-graphs", target="megatron.bridge.training.train:_delete_cuda_graphs",
          replacement="qvl.kernels.speed_cuda_graphs:deleting_layer_graphs", version=MBRIDGE,
          params=("cuda_graph_helper",),
          why="at the end of its loop it deletes full-iteration and TE graphs, not Megatron-Core's local per-layer "
              "ones: their memory outlived the run, and the next run in the process failed at its first graphed "
              "layer (the global record still said its graphs were made)"),
    Patch(group="speed-cuda-graphs", target="megatron.core.transformer.cuda_graphs:ArgMetadata",
          replacement="qvl.kernels.speed_cuda_graphs:keeping_whole_pack", version=MCORE, params=("arg",),
          why="the graphs' static input buffers are plain tensors and its type check (_check_supported_type) refuses "
              "tensor subclasses: qvl's WholePackCuSeqlens (the rotary's no-host-read path) would fail it, and a plain "
              "buffer would send the rotary to upstream's loop of host reads, which a capture cannot hold"),
    # --- torch-wgrad-accum: from building a model whose provider qvl fixed, any device without Apex (process-wide)
    Patch(group="torch-wgrad-accum", target="megatron.core.tensor_parallel.layers:_grad_accum_fusion_available",
          replacement="qvl.kernels.torch_wgrad_accum:available", version=MCORE,
          why="gradient_accumulation_fusion is refused unless Apex's fused_weight_gradient_mlp_cuda imports; torch's "
              "addmm (addmm.dtype_out for bf16 into fp32) does the same GEMM into main_grad"),
    Patch(group="torch-wgrad-accum", target="megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda",
          replacement="qvl.kernels.torch_wgrad_accum:torch_kernels", version=MCORE, absent_ok=True,
          why="the linears' backward calls its wgrad_gemm_accum_fp32/_fp16; torch stand-ins with the same arguments"),
    Patch(group="torch-wgrad-accum", target="megatron.core.tensor_parallel.layers:get_dummy_wgrad",
          replacement="qvl.kernels.torch_wgrad_accum:te_dummy_wgrad", version=MCORE, absent_ok=True,
          why="without TE the backward allocates its dummy weight gradient with device=torch.cuda.current_device(), "
              "which the CPU runtime cannot redirect inside a backward pass; TE's helper name, allocated as upstream "
              "does on this process's device"),
    Patch(group="torch-wgrad-accum", target="megatron.core.tensor_parallel.layers:F",
          replacement="qvl.kernels.torch_wgrad_accum:embedding_into_main_grad", version=MCORE,
          why="VocabParallelEmbedding's F.embedding writes a dense [vocab, hidden] weight gradient per micro-batch that "
              "DDP adds into main_grad (and autograd first adds a tied output layer's zeroed placeholder to it): ~6 GB "
              "of traffic per micro-batch for Qwen's vocabulary; a marked weight's rows go into main_grad instead"),
    Patch(group="torch-wgrad-accum", target="megatron.core.tensor_parallel.layers:HAVE_TE",
          replacement="qvl.kernels.torch_wgrad_accum:take_dummy_from_stand_in", version=MCORE,
          why="selects get_dummy_wgrad in the backward (and, under CPU offloading, which needs TE, marks inputs)"),
    # --- torch-sequence-parallel-norm: from building a model whose provider qvl fixed without TE (process-wide)
    Patch(group="torch-sequence-parallel-norm",
          target="megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
          replacement="qvl.kernels.torch_sequence_parallel_norm:sequence_parallel_norm", version=MCORE,
          params=("cls", "config", "hidden_size", "eps"),
          why="it refuses sequence_parallel, which every recipe turns on with tensor parallelism (and an MoE layer "
              "needs with it); the same norm with its parameters marked sequence_parallel, as TE's and Apex's are, "
              "so finalize_model_grads sums their gradients over the TP ranks"),
    # --- torch-checkpoint-without-output: from building a model whose provider qvl fixed without TE (process-wide)
    Patch(group="torch-checkpoint-without-output",
          target="megatron.core.tensor_parallel.random:CheckpointWithoutOutput.__init__",
          replacement="qvl.kernels.torch_checkpoint_without_output:without_fp8", version=MCORE, params=("self", "fp8"),
          why="its default fp8=False reads as FP8 on (`fp8 is not None`), and its forward then calls TE's "
              "FP8GlobalStateManager, a NameError without TE: selective recompute of the norms (layernorm), an "
              "expert's activation (moe_act) or Gated DeltaNet's output norm failed at the first forward"),
    Patch(group="torch-checkpoint-without-output",
          target="megatron.core.tensor_parallel.random:_get_share_storage",
          replacement="qvl.kernels.torch_checkpoint_without_output:without_extension", version=MCORE, params=(),
          why="the recompute restores the discarded output through a C++ extension built by load_inline in the "
              "first backward of every process: ninja and a compiler on every node, ~22 s the first time, and a "
              "build killed once leaves a lock that every later process waits on forever; qvl copies the "
              "recomputed bytes into the output's storage instead"),
    # --- torch-qwen3-vl-vision: while qvl.bridges.qwen3_vl.Qwen3VLModel.__init__ runs without TE
    *(
        Patch(group="torch-qwen3-vl-vision",
              target=f"megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model:{name}",
              replacement=f"qvl.kernels.torch_qwen3_vl_vision:{factory}", version=MBRIDGE,
              why="Qwen3VLModel.__init__ builds its vision tower from TE classes unconditionally")
        for name, factory in (
            ("get_vit_layer_with_transformer_engine_spec", "local_vit_layer_spec"),
            ("TENorm", "local_norm"),
            ("TEColumnParallelLinear", "local_column_parallel_linear"),
            ("TERowParallelLinear", "local_row_parallel_linear"),
        )
    ),
    # --- speed-aligned-widths: around qvl's conversions (qvl.bridges.convert); the padding itself is qvl.kernels.speed_aligned_widths
    Patch(group="speed-aligned-widths",
          target="megatron.bridge.models.conversion.param_mapping:ReplicatedMapping.hf_to_megatron",
          replacement="qvl.kernels.speed_aligned_widths:padding_hf_to_megatron", version=MBRIDGE,
          params=("self", "hf_weights", "megatron_module"),
          why="the replicated HF vision tower is built with its MLP width padded to a multiple of 64 (aligned GEMMs); "
              "the narrower HF tensor is zero-padded to its parameter"),
    Patch(group="speed-aligned-widths",
          target="megatron.bridge.models.conversion.param_mapping:ReplicatedMapping.megatron_to_hf",
          replacement="qvl.kernels.speed_aligned_widths:stripping_megatron_to_hf", version=MBRIDGE,
          params=("self", "megatron_weights", "megatron_module"),
          why="the padding is cut off again, so an exported or verified tensor is the checkpoint's own"),
    # --- speed-hf-vision: from building a model with an HF vision tower on, any device (lean_vision.use_lean_vision)
    Patch(group="speed-hf-vision",
          target="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VLRMSNorm.forward",
          replacement="qvl.kernels.speed_hf_vision:fused_rms_norm", version=TRANSFORMERS,
          params=("self", "hidden_states"),
          why="a Python composition in fp32 (8 kernels forward, 18 backward); torch's fused kernel, HF's numerics"),
    *(
        Patch(group="speed-hf-vision", target=f"transformers.models.{name}.modeling_{name}:apply_rotary_pos_emb_vision",
              replacement="qvl.kernels.speed_hf_vision:fused_rotary", version=TRANSFORMERS,
              params=("q", "k", "cos", "sin"),
              why="fp32 rotate-half in ~10 kernels per tensor; one compiled region on CUDA, the same math")
        for name in ("qwen2_vl", "qwen2_5_vl")
    ),
    *(
        Patch(group="speed-hf-vision", target=f"transformers.models.{name}.modeling_{name}:{attention}.forward",
              replacement="qvl.kernels.speed_hf_vision:lean_attention", version=TRANSFORMERS,
              params=("self", "hidden_states", "cu_seqlens", "position_embeddings"),
              why="it permutes q, k, v for the attention function and back, and computes the longest block on the "
                  "device in every call although qvl passes it from the host: ~14 views and 2 kernels each way")
        for name, attention in (("qwen2_vl", "VisionAttention"), ("qwen2_5_vl", "Qwen2_5_VLVisionAttention"))
    ),
    *(
        Patch(group="speed-hf-vision", target=f"transformers.models.{name}.modeling_{name}:{block}.forward",
              replacement="qvl.kernels.speed_hf_vision:lean_block", version=TRANSFORMERS,
              params=("self", "hidden_states", "cu_seqlens", "position_embeddings"),
              why="the first residual add and the second norm are an add and a norm forward, and a norm and "
                  "autograd's add of the residual stream's two gradients backward; one compiled region each way on "
                  "CUDA, the same math")
        for name, block in (("qwen2_vl", "Qwen2VLVisionBlock"), ("qwen2_5_vl", "Qwen2_5_VLVisionBlock"))
    ),
    Patch(group="speed-hf-vision", target="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VLMLP.forward",
          replacement="qvl.kernels.speed_hf_vision:lean_gated_mlp", version=TRANSFORMERS,
          params=("self", "hidden_state"),
          why="the gate's SiLU and the product are 2 kernels forward and 3 backward with the activation written and "
              "read back; one compiled region each way on CUDA, the same math"),
    Patch(group="speed-hf-vision", target="transformers.models.qwen2_vl.modeling_qwen2_vl:VisionMlp.forward",
          replacement="qvl.kernels.speed_hf_vision:lean_mlp", version=TRANSFORMERS, params=("self", "x"),
          why="QuickGELU is 3 kernels forward and more backward; one compiled region each way on CUDA, the same math"),
    # --- torch-gated-delta: while qvl.kernels.torch_gated_delta.GatedDeltaNet builds or runs where `fla` cannot run
    *(
        Patch(group="torch-gated-delta", target=f"megatron.core.ssm.gated_delta_net.{module}:{name}",
              replacement=f"qvl.kernels.torch_gated_delta:{factory}", version=MCORE,
              why="GatedDeltaNet takes its kernels from flash-linear-attention (Triton, GPU only) and raises without "
                  "it; with it installed but no GPU every kernel fails. qvl's torch kernels restart at every "
                  "cu_seqlens boundary as fla's do")
        for module, name, factory in (
            ("common", "HAVE_FLA", "fla_present"),
            ("common", "l2norm", "torch_l2norm"),
            ("gdn", "causal_conv1d", "torch_causal_conv1d"),
            ("gdn", "chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
        )
    ),
    # --- speed-gated-delta-sync-free: around a training loop of a model with Gated DeltaNet layers
    #     (qvl.kernels.speed_gated_delta_sync_free; the forward step gives a pack's bounds on the host)
    Patch(group="speed-gated-delta-sync-free",
          target="megatron.core.ssm.gated_delta_net.common:_GDNBase._resolve_cu_seqlens",
          replacement="qvl.kernels.speed_gated_delta_sync_free:checked_on_host", version=MCORE,
          params=("self", "cu_seqlens_padded", "cu_seqlens_actual", "total_seq_len", "name", "cp_size"),
          why="every Gated DeltaNet layer reads a pack's last bound and its lengths' divisibility back to the host, "
              "for the query's and the key's bounds (with torch.equal of the two: five waits for the GPU per layer "
              "and micro-batch); the same checks on the host values the step gives"),
    *(
        Patch(group="speed-gated-delta-sync-free", target=f"megatron.core.ssm.gated_delta_net.gdn:{name}",
              replacement="qvl.kernels.speed_gated_delta_sync_free:given_chunks", version=MCORE,
              why="fla lists a pack's 64-token chunks from its lengths on the device (a read back per micro-batch); "
                  "given the host bounds and the list made on the host (its cu_seqlens_cpu and chunk_indices)")
        for name in ("causal_conv1d", "chunk_gated_delta_rule")
    ),
    # --- speed-gated-delta-l2norm: around a training loop of a model with Gated DeltaNet layers on fla's kernels
    #     (qvl.kernels.speed_gated_delta_l2norm)
    Patch(group="speed-gated-delta-l2norm", target="megatron.core.ssm.gated_delta_net.common:l2norm",
          replacement="qvl.kernels.speed_gated_delta_l2norm:fused_l2norm", version=MCORE,
          why="fla 0.6 launches its l2norm through a torch.compiler.disable'd dispatch: inside the compiled "
              "_prepare_input_for_gated_delta_rule Dynamo breaks the region in two around it (two graphs and fla's "
              "kernel each way, q and k written and read back between them); torch's l2norm, fp32 inside as fla's, "
              "is fused into the region's one graph"),
    # --- fix-fla-tf32: around a training loop that asks for exact fp32 on CUDA with fla (qvl.kernels.fix_fla_tf32)
    Patch(group="fix-fla-tf32", target="fla.ops.gated_delta_rule.chunk_fwd:SOLVE_TRIL_DOT_PRECISION",
          replacement="qvl.kernels.fix_fla_tf32:ieee_dots", version=FLA,
          why="fla's gated delta rule solves each chunk's triangular system with TF32 dots on Ampere and later "
              "whatever its inputs' dtype, so an fp32 run rounds there to ~5e-4; IEEE fp32 dots where the run asks "
              "for exact fp32 (a parity check)"),
    # --- speed-import: while qvl imports Megatron-Bridge (qvl.foundation.megatron.import_megatron_bridge)
    Patch(group="speed-import", target="torch:compile", replacement="qvl.foundation.megatron:deferred_compile",
          version=TORCH, params=("model",), why="Megatron-Core's ~20 `@jit_fuser`/`@torch.compile` functions are "
          "made at their first call: making them at import loads TorchInductor's compile_fx (~2 CPU s a process); "
          "a CPU call runs eagerly (compiled, it built C++ in every process: ~3 s, ~30 s with a cold cache)"),
    # --- fix-kubeflow-v2.2: while qvl.launchers renders or submits a TrainJob
    Patch(group="fix-kubeflow-v2.2", target="nemo_run.core.execution.kubeflow:KubeflowExecutor.get_job_body",
          replacement="qvl.kernels.fix_kubeflow_v2_2:runtime_patches_job_body", version=NEMO_RUN,
          params=("self", "name", "command"),
          why="NeMo-Run renders pod settings (volumes, mounts, pull secrets) only as spec.podTemplateOverrides, "
              "Kubeflow Trainer v2.1's field; v2.2 replaced it with runtimePatches (kubeflow/trainer#3309) and a "
              "newer server drops the old field, so pods start without their volumes. Only an executor whose spec "
              "carries runtimePatches (trainer_api v2.2+) is rewritten"),
)  # fmt: skip

STAND_INS: tuple[StandIn, ...] = (
    StandIn(module="megatron.bridge.peft.lora_layers", package="transformer_engine",
            submodule="transformer_engine.pytorch", version=MBRIDGE,
            advice="use the local (non-TE) layer specs (qvl does where TE is absent), or a NeMo container with TE"),
    # Used only as a type annotation unless in-process restart is enabled. PyPI's newest nvidia-resiliency-ext for
    # this stack (0.4.1) lacks the `__version__` that megatron-core 0.19.2 reads, so qvl does not install it.
    StandIn(module="megatron.bridge.training.pretrain", package="nvidia_resiliency_ext",
            submodule="nvidia_resiliency_ext.inprocess", version=MBRIDGE,
            advice="leave in-process restart off, or install nvidia-resiliency-ext (NeMo containers have it)"),
)  # fmt: skip

KEPT_OUT: tuple[KeptOut, ...] = (
    KeptOut(package="trl", plugin_loader="modelopt.torch.quantization.plugins", version=MODELOPT,
            why="its TRL plugin quantizes TRL's trainers, which qvl never trains with; importing TRL there costs "
                "~4 s per process (qvl imports TRL itself only for `qvl verify-training` of a preference recipe)"),
)  # fmt: skip

PRIVATE_READS: tuple[PrivateRead, ...] = (
    *(PrivateRead(target="megatron.core:parallel_state", attribute=name, used_in="qvl.foundation.distributed",
                  version=MCORE, why="destroy_model_parallel() leaves these two groups set: qvl drops them after it, "
                  "so a destroyed group's store, port and threads go")
      for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO")),
    PrivateRead(target="megatron.bridge.models.conversion.auto_bridge:AutoBridge", attribute="_model_bridge",
                used_in="qvl.bridges.stream", version=MBRIDGE,
                why="the streamed import needs the model bridge's conversion tasks without materialising the model"),
    PrivateRead(target="megatron.bridge.models.qwen_vl.modelling_qwen3_vl.vision_model:Qwen3VLVisionModel",
                attribute="_uses_vision_cuda_graph", used_in="qvl.kernels.speed_qwen3_vl_tower", version=MBRIDGE,
                why="a tower padded for vision CUDA graphs has no packed blocks: it keeps upstream's forward"),
    PrivateRead(target="megatron.core.transformer:cuda_graphs", attribute="_CudagraphGlobalRecord",
                used_in="qvl.kernels.speed_cuda_graphs, benchmarks.train_run", version=MCORE,
                why="whether Megatron-Core made its local per-layer graphs (it keeps no public flag): they are deleted "
                    "when the loop ends only if made, and a benchmark run reports them"),
    PrivateRead(target="megatron.core.tensor_parallel:random", attribute="_CUDA_RNG_STATE_TRACKER_INITIALIZED",
                used_in="qvl.kernels.speed_cuda_graphs", version=MCORE,
                why="a tracker made earlier in the process is kept by later seeding: a graphed run makes it "
                    "graph-safe (anew where none is made yet or it is not) before Megatron-Bridge seeds it"),
    PrivateRead(target="torch._C", attribute="DisableTorchFunctionSubclass", used_in="qvl.kernels.speed_rotary",
                version=TORCH, why="a cu_seqlens tensor subclass that only marks a whole pack runs every op as a plain "
                                   "tensor (torch's documented pattern for a subclass's __torch_function__)"),
    *(PrivateRead(target=target, attribute=attribute, used_in="qvl.foundation.runtime", version=TORCH,
                  why="torch.autograd.grad's own steps after its torch-function check, run with a TorchFunctionMode "
                      "kept on for the backward (the CPU runtime's device redirection, a recorded graph's capture)")
      for target, attribute in (("torch:autograd", "_make_grads"), ("torch:autograd", "_tensor_or_tensors_to_tuple"),
                                ("torch.autograd:graph", "_engine_run_backward"))),
    PrivateRead(target="torch._C", attribute="DisableTorchFunction", used_in="benchmarks.step_kernels",
                version=TORCH, why="the census's attention stand-in reads its bounds for its FLOPs unseen by torch "
                                   "functions (its own count, a recorded graph's capture): the kernel reads nothing"),
    PrivateRead(target="torch.autograd.grad_mode", attribute="_unsafe_preserve_version_counter",
                used_in="qvl.foundation.graph_replay", version=TORCH,
                why="a recorded CUDA graph's replay writes the capture's tensors as a device's replay does, without "
                    "bumping their version counters"),
    PrivateRead(target="megatron.bridge.models.qwen_vl.qwen3_vl_provider:Qwen3VLModelProvider",
                attribute="_pg_collection", used_in="qvl.bridges.qwen3_vl", version=MBRIDGE,
                why="the provider's process groups, passed to the model as upstream's provide() does"),
    PrivateRead(target="megatron.core.models.gpt.gpt_model:GPTModel", attribute="_postprocess",
                used_in="qvl.bridges.qwen3_5_vl", version=MCORE,
                why="Qwen3.5's language model overrides it to hand its MTP layers the main decoder's input (vision "
                    "features merged, as vLLM feeds the MTP head: qvl.bridges.mtp_inputs); it spreads its "
                    "extra_block_kwargs into the MTP block, which hands its own to every MTP layer"),
    PrivateRead(target="megatron.core.transformer.multi_token_prediction:MultiTokenPredictionLayer",
                attribute="_get_embeddings", used_in="qvl.bridges.qwen3_5_vl", version=MCORE,
                why="qvl's MTP layer shifts a pack's next-token ids on the device; its `embedding(input_ids=, "
                    "position_ids=)` call is where the vision features come in (qvl.bridges.mtp_inputs)"),
    PrivateRead(target="transformers:PreTrainedModel", attribute="_from_config",
                used_in="qvl.bridges.qwen2_vl, qvl.recipes.planner", version=TRANSFORMERS,
                why="builds a vision tower from its sub-config (on meta in the planner) as transformers does itself"),
    PrivateRead(target="transformers:PreTrainedModel", attribute="_supports_flash_attn",
                used_in="qvl.kernels.varlen_attention", version=TRANSFORMERS,
                why="only towers whose attention hands cu_seqlens to a flash-type function get the varlen kernel"),
    PrivateRead(target="transformers:PretrainedConfig", attribute="_attn_implementation",
                used_in="qvl.kernels.varlen_attention", version=TRANSFORMERS,
                why="set on the HF vision tower's own config copy after build: transformers' build-time check would "
                    "treat the registered varlen function's name as a hub kernel to download"),
    PrivateRead(target="megatron.bridge.models.model_provider:ModelProviderMixin", attribute="_pre_wrap_hooks",
                used_in="qvl.recipes.base", version=MBRIDGE,
                why="a config validated twice (qvl train checks it before pretrain() does) registers its hook once"),
    PrivateRead(target="megatron.core.timers:Timers", attribute="_timers", used_in="benchmarks.step_anatomy",
                version=MCORE, why="bench_idle reads every timer of a step (Megatron keeps no public list of them)"),
    PrivateRead(target="megatron.core.timers:Timer", attribute="_started", used_in="benchmarks.step_anatomy",
                version=MCORE, why="a running timer (interval-time spans steps) is left alone when a step's are read"),
    PrivateRead(target="torch.library:Library", attribute="_destroy", used_in="qvl.kernels.torch_wgrad_accum",
                version=TORCH, why="a CPU kernel registered for the step census is removed again (no public undo)"),
    PrivateRead(target="nemo_run.cli.api:RunContext", attribute="_execute_task",
                used_in="qvl.launchers.nemo_cli", version=NEMO_RUN,
                why="`nemo qvl` checks the task (layout vs executor, overrides) before NeMo-Run executes it"),
    PrivateRead(target="nemo_run.run.experiment:Experiment", attribute="_exp_dir", used_in="qvl.launchers.jobs",
                version=NEMO_RUN, why="where the experiment keeps its files, shown to the user and removed on dry runs"),
    PrivateRead(target="nemo_run.run.experiment:Experiment", attribute="_id", used_in="qvl.launchers.jobs",
                version=NEMO_RUN, why="the experiment id for `nemo experiment status/logs/cancel`"),
    PrivateRead(target="nemo_run.run.job:Job", attribute="_dryrun_info", used_in="qvl.launchers.jobs",
                version=NEMO_RUN, why="the rendered sbatch script / manifest of a dry run"),
    PrivateRead(target="nemo_run.core.execution.kubeflow:KubeflowExecutor", attribute="_trainjob_name",
                used_in="qvl.launchers.jobs", version=NEMO_RUN, why="the TrainJob name launch() will use"),
)  # fmt: skip

GROUPS: tuple[str, ...] = tuple(dict.fromkeys(p.group for p in PATCHES))

_ABSENT = object()  # the original of an `absent_ok` attribute that was not there
# group -> [(owner, attribute, original)] for the groups applied now
_APPLIED: dict[str, list[tuple[Any, str, Any]]] = {}


def is_applied(group: str) -> bool:
    """Whether `group`'s patches are in place now."""
    return group in _APPLIED


def apply(group: str) -> None:
    """Put every patch of `group` in place (idempotent)."""
    if group in _APPLIED:
        return
    patches = [p for p in PATCHES if p.group == group]
    if not patches:
        raise ValueError(f"no patch group {group!r}; groups: {', '.join(GROUPS)}")
    saved: list[tuple[Any, str, Any]] = []
    try:
        for patch in patches:
            owner, name = owner_and_name(patch.target)
            original = getattr(owner, name, _ABSENT) if patch.absent_ok else getattr(owner, name)
            setattr(owner, name, load(patch.replacement)(None if original is _ABSENT else original))
            saved.append((owner, name, original))
    except Exception:
        _restore(saved)
        raise
    _APPLIED[group] = saved
    logger.debug("patch group %s applied: %d targets", group, len(saved))


def undo(group: str) -> None:
    """Restore every attribute `group` replaced (a no-op when it is not applied)."""
    _restore(_APPLIED.pop(group, []))


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, original in reversed(saved):
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


@contextlib.contextmanager
def applied(*groups: str) -> Iterator[None]:
    """Apply `groups` for the duration of the block; groups that were already applied stay applied after it."""
    fresh = [g for g in groups if g not in _APPLIED]
    try:
        for group in fresh:
            apply(group)
        yield
    finally:
        for group in reversed(fresh):
            undo(group)
