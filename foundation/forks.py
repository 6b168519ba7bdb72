"""Every upstream function whose body qvl copies and changes (a patch's replacement, or a method of qvl's own model
classes), with a hash of that upstream source: `tests/foundation/test_patches.py` fails on an upgrade that changes
one, naming the qvl function to re-read against it. The patches themselves are qvl.foundation.patches."""

from __future__ import annotations

from qvl.foundation.patch_entries import Fork
from qvl.foundation.patches import MBRIDGE, MCORE, TRANSFORMERS

_Q3 = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl"
_T2 = "transformers.models.qwen2_vl.modeling_qwen2_vl"
_T25 = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
FORKS: tuple[Fork, ...] = (
    Fork(upstream="megatron.bridge.models.qwen_vl.modeling_qwen25_vl:Qwen25VLModel.forward", copied_in="qvl.kernels.speed_sync_free:loader_positions_forward",
         source_sha256="11ecbd790ae57d43", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.model:Qwen3VLModel.forward", copied_in="qvl.kernels.speed_qwen3_vl_sync_free:indexed_forward",
         source_sha256="aa1829c3493ee242", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.transformer_block:Qwen3VLTransformerBlock._deepstack_process", copied_in="qvl.kernels.speed_qwen3_vl_sync_free:add_deepstack_at",
         source_sha256="4806df01487d500c", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.utils:reorganize_inputs", copied_in="qvl.kernels.vision_placement:vision_order",
         source_sha256="708944048a2f534c", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.vision_model:Qwen3VLVisionModel.forward", copied_in="qvl.kernels.speed_qwen3_vl_tower:prepared_tower_forward",
         source_sha256="adca71542056e011", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.vision_model:Qwen3VLVisionModel.fast_pos_embed_interpolate", copied_in="qvl.kernels.speed_qwen3_vl_tower:interpolated_pos_embed",
         source_sha256="c2b88af792b0c015", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.vision_model:Qwen3VLVisionModel.rot_pos_emb", copied_in="qvl.kernels.speed_qwen3_vl_tower:rotary_frequencies",
         source_sha256="3b0683bc80d5b20a", version=MBRIDGE),
    Fork(upstream=f"{_Q3}.attention:apply_rotary_pos_emb_absolute", copied_in="qvl.kernels.speed_rotary:rotary_absolute",
         source_sha256="2e338b98e8c0458f", version=MBRIDGE),
    Fork(upstream="megatron.core.transformer.multi_token_prediction:MultiTokenPredictionLayer._get_embeddings", copied_in="qvl.bridges.qwen3_5_vl:MultiTokenPredictionLayer._get_embeddings",
         source_sha256="0de994b5131c0a3d", version=MCORE),
    Fork(upstream="megatron.core.transformer.moe.experts:SequentialMLP.forward", copied_in="qvl.kernels.speed_grouped_experts:grouped_forward",
         source_sha256="2f6a645f4f9ce7d7", version=MCORE),
    Fork(upstream="megatron.core.transformer.mlp:MLP.forward", copied_in="qvl.kernels.speed_grouped_experts:activation",
         source_sha256="bce28c9dcc3a2555", version=MCORE),
    Fork(upstream="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_main_params_to_model_params", copied_in="qvl.kernels.speed_optimizer:foreach_main_to_model_copy",
         source_sha256="80e4f4d1fa99e747", version=MCORE),
    Fork(upstream="megatron.core.utils:local_multi_tensor_l2_norm", copied_in="qvl.kernels.speed_optimizer:foreach_l2_norm",
         source_sha256="01526c55444a73bd", version=MCORE),
    Fork(upstream="megatron.core.utils:local_multi_tensor_scale", copied_in="qvl.kernels.speed_optimizer:foreach_scale",
         source_sha256="a271d86b61250d2f", version=MCORE),
    Fork(upstream="megatron.core.tensor_parallel.cross_entropy:VocabParallelCrossEntropy", copied_in="qvl.kernels.speed_cross_entropy:vocab_parallel_cross_entropy",
         source_sha256="d1a9cef1503361d7", version=MCORE),
    Fork(upstream=f"{_T2}:VisionAttention.forward", copied_in="qvl.kernels.speed_hf_vision:lean_attention",
         source_sha256="846f2bb4f04f10e6", version=TRANSFORMERS),
    Fork(upstream=f"{_T25}:Qwen2_5_VLVisionAttention.forward", copied_in="qvl.kernels.speed_hf_vision:lean_attention",
         source_sha256="846f2bb4f04f10e6", version=TRANSFORMERS),
    Fork(upstream=f"{_T25}:Qwen2_5_VLRMSNorm.forward", copied_in="qvl.kernels.speed_hf_vision:rms_norm",
         source_sha256="790fa612e4fa57ac", version=TRANSFORMERS),
    Fork(upstream=f"{_T2}:apply_rotary_pos_emb_vision", copied_in="qvl.kernels.speed_hf_vision:rotary_fp32",
         source_sha256="961a1862d6808a5c", version=TRANSFORMERS),
    Fork(upstream=f"{_T2}:Qwen2VLVisionBlock.forward", copied_in="qvl.kernels.speed_hf_vision:lean_block",
         source_sha256="8e120700018939d7", version=TRANSFORMERS),
    Fork(upstream=f"{_T25}:Qwen2_5_VLVisionBlock.forward", copied_in="qvl.kernels.speed_hf_vision:lean_block",
         source_sha256="7410906a88cbdb3b", version=TRANSFORMERS),
    Fork(upstream=f"{_T25}:Qwen2_5_VLMLP.forward", copied_in="qvl.kernels.speed_hf_vision:lean_gated_mlp",
         source_sha256="1e1715d7e10e8420", version=TRANSFORMERS),
    Fork(upstream=f"{_T2}:VisionMlp.forward", copied_in="qvl.kernels.speed_hf_vision:lean_mlp",
         source_sha256="baf0390ea68c9e9d", version=TRANSFORMERS),
    Fork(upstream=f"{_T2}:Qwen2VisionTransformerPretrainedModel.rot_pos_emb", copied_in="qvl.kernels.tower_inputs:tower_inputs",
         source_sha256="5cca11b76acf4c85", version=TRANSFORMERS),
    Fork(upstream=f"{_T25}:Qwen2_5_VisionTransformerPretrainedModel.get_window_index", copied_in="qvl.kernels.tower_inputs:tower_inputs",
         source_sha256="a99a319b95b2c8d3", version=TRANSFORMERS),
    Fork(upstream=f"{_T2}:Qwen2VLModel.get_rope_index", copied_in="qvl.data.mrope:mrope_position_ids",
         source_sha256="2dfcc876ef0060f6", version=TRANSFORMERS),
    Fork(upstream=f"{_T25}:Qwen2_5_VLModel.get_rope_index", copied_in="qvl.data.mrope:mrope_position_ids",
         source_sha256="690e539be08514b7", version=TRANSFORMERS),
)  # fmt: skip
