"""Qwen2-VL <-> Megatron-Core: the bridge Megatron-Bridge 0.6.2 lacks ("not yet supported").

Qwen2-VL is Qwen2.5-VL's predecessor with the same language model (Qwen2 blocks, mRoPE) and the same
parameter names; only the vision tower differs (LayerNorm, non-gated GELU MLP, no window attention).
So the weight mapping table IS Qwen2.5-VL's (inherited from Megatron-Bridge's Qwen25VLBridge: a
QKV/gated-MLP table for the language model and `visual.**` replicated), the language model is
Megatron-Core's GPTModel, the model is qvl's Qwen2.5-VL model (its forward included, qvl.bridges.qwen2_5_vl), and
what is Qwen2-VL-specific lives here: the HF vision tower class, HF's Qwen2-VL rope/feature methods bound onto the
model, and a provider read strictly from the config.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # Megatron-Bridge imports TE / nvrx unconditionally: qvl gives them stand-ins

from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.transformers_compat import rope_theta_from_hf
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.qwen_vl.qwen25_vl_bridge import Qwen25VLBridge
from megatron.bridge.models.qwen_vl.qwen25_vl_provider import Qwen25VLModelProvider
from megatron.bridge.utils.common_utils import hook_hf_module_setattr_for_tp_grad_sync
from megatron.core.transformer.module import MegatronModule
from transformers import Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as HFQwen2VLModel

from qvl.bridges.fixes import mrope_section, set_token_ids
from qvl.bridges.providers import freeze_as_configured
from qvl.bridges.qwen2_5_vl import Qwen25VLModel

# HF Qwen2-VL methods the forward pass needs, bound onto the Megatron model (as Megatron-Bridge does
# for Qwen2.5-VL): rope index (3-D positions), vision features and the placeholder mask.
_HF_METHODS = (
    "get_placeholder_mask",
    "get_image_features",
    "get_video_features",
    "get_rope_index",
    "get_vision_position_ids",
)


class Qwen2VLModel(Qwen25VLModel):
    """Qwen2-VL on Megatron-Core: HF Qwen2-VL vision tower (replicated over TP) + Megatron GPT decoder; qvl's
    Qwen2.5-VL forward."""

    def __init__(
        self, config: GPTModelProvider, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
    ) -> None:
        MegatronModule.__init__(self, config=config)  # Qwen25VLModel.__init__ would build the 2.5 tower
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        if pre_process:
            self.visual = Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config)
            hook_hf_module_setattr_for_tp_grad_sync(self.visual)
        self.language_model = config.provide_language_model(
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        self.shared_embedding_or_output_weight = self.language_model.shared_embedding_or_output_weight
        for name in _HF_METHODS:
            setattr(self, name, types.MethodType(getattr(HFQwen2VLModel, name), self))


@dataclass
class Qwen2VLModelProvider(Qwen25VLModelProvider):
    """Provider for Qwen2-VL: Qwen2.5-VL's provider with the Qwen2-VL vision config and model class."""

    vision_config: Qwen2VLVisionConfig = field(default_factory=Qwen2VLVisionConfig)

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> Qwen2VLModel:
        model = Qwen2VLModel(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        return freeze_as_configured(model, self)


@MegatronModelBridge.register_bridge(
    source=Qwen2VLForConditionalGeneration, target=Qwen2VLModel, provider=Qwen2VLModelProvider, model_type="qwen2_vl"
)
class Qwen2VLBridge(Qwen25VLBridge):
    """HF Qwen2VLForConditionalGeneration <-> Megatron; the mapping table is Qwen2.5-VL's (inherited)."""

    def provider_bridge(self, hf_pretrained) -> Qwen2VLModelProvider:
        hf_config = hf_pretrained.config
        text_config = hf_config.text_config
        provider = Qwen2VLModelProvider(**self.hf_config_to_provider_kwargs(text_config))
        # Qwen2 blocks: RMSNorm, SwiGLU, bias on QKV only, no dropout.
        provider.normalization = "RMSNorm"
        provider.gated_linear_unit = True
        provider.add_qkv_bias = True
        provider.add_bias_linear = False
        provider.hidden_dropout = 0.0
        provider.rotary_base = rope_theta_from_hf(text_config)
        provider.position_embedding_type = "mrope"
        provider.mrope_section = mrope_section(text_config)
        provider.share_embeddings_and_output_weights = bool(getattr(hf_config, "tie_word_embeddings", False))
        provider.vision_config = hf_config.vision_config
        set_token_ids(provider, hf_config)
        provider.bos_token_id = text_config.bos_token_id
        provider.eos_token_id = text_config.eos_token_id
        return provider
