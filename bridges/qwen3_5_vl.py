"""Qwen3.5-VL (dense and MoE) <-> Megatron-Core without requiring Transformer Engine or flash-linear-attention.

Megatron-Bridge 0.6.2 ships `Qwen35VLBridge` / `Qwen35VLMoEBridge` (megatron/bridge/models/qwen_vl/qwen35_vl_bridge.py)
and their providers: a hybrid language model (three Gated DeltaNet layers per gated full-attention layer, as
Qwen3-Next) on its Qwen3-VL model class. Their mapping tables and forward pass are right; qvl keeps them and changes
what cannot run without TE or `fla`:
- the language block: upstream builds it with Megatron-Core's `get_transformer_block_with_experimental_attention_variant
  _spec`, which asserts `transformer_impl == "transformer_engine"`. Without TE, `local_hybrid_block_spec` builds the
  same layer pattern from Megatron-Core's local modules: SDPA core attention with Qwen3-VL's mRoPE attention for the
  full-attention layers, `GatedDeltaNet` for the others (qvl.kernels.torch_gated_delta: torch kernels where `fla` cannot
  run), and zero-centred RMSNorm everywhere (Megatron-Core's torch norm refuses `layernorm_zero_centered_gamma`);
- the vision tower: the TE-only Megatron Qwen3-VL tower, built from local modules by qvl's `Qwen3VLModel`
  (qvl.bridges.qwen3_vl), with HF's exact-GELU patch merger;
- the providers' fields: `mrope_section` and the token ids come from the checkpoint's config (upstream falls back to
  the released models' values, and reads `rope_scaling`, which transformers 5 leaves empty);
- the multi-token-prediction (MTP) block: upstream asks Megatron-Core for a TE MTP spec (`get_gpt_mtp_block_spec(...,
  use_transformer_engine=True)`), which fails without TE as soon as a config has `mtp_num_hidden_layers` (every
  released one). `local_mtp_block_spec` builds Megatron-Core's `MultiTokenPredictionLayer` from the same local
  full-attention layer as the decoder's, with zero-centred norms (`mtp.pre_fc_norm_*`, `mtp.norm` are Qwen3.5 norms).
Mapping tables: inherited from Megatron-Bridge's bridges. Local norms are separate modules named
`input_layernorm` / `pre_mlp_layernorm`, which Megatron-Bridge's registry maps to the same HF tensors as TE's fused
`layer_norm_weight` names. Its MoE MTP table names only grouped-GEMM experts (`experts.linear_fc1.weight*`); local
specs build per-expert modules (`experts.local_experts.N.linear_fc1.weight`), mapped here as its decoder table does.
"""

# ruff: noqa: E402  (Megatron-Bridge must be imported through import_megatron_bridge first, as in qwen3_vl.py)
from __future__ import annotations

import copy
import dataclasses
import types

from qvl.foundation.megatron import import_megatron_bridge

import_megatron_bridge()  # Megatron-Bridge imports TE / nvrx unconditionally: qvl gives them stand-ins

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    FusedExpertMapping,
    FusedGatedExpertMapping,
    GatedMLPMapping,
)
from megatron.bridge.models.qwen_vl import qwen35_vl_bridge as upstream_bridge
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention import Qwen3VLSelfAttention
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.text_model import Qwen3VLGPTModel
from megatron.bridge.models.qwen_vl.qwen35_vl_provider import Qwen35VLModelProvider, Qwen35VLMoEModelProvider
from megatron.core import parallel_state
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer import multi_token_prediction as upstream_mtp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import make_viewless_tensor
from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

from qvl.bridges.fixes import mrope_section
from qvl.bridges.mtp_inputs import NextTokenInputs, VisionRowsLink, vision_rows_link
from qvl.bridges.providers import provider_as
from qvl.bridges.qwen3_vl import Qwen3VLModel
from qvl.bridges.unconverted import recorded_tensor_names
from qvl.foundation.errors import ConversionError
from qvl.foundation.megatron import have_transformer_engine
from qvl.kernels import compiled
from qvl.kernels.local_specs import GraphedMLPLayer, local_gpt_layer_spec
from qvl.kernels.packed_shift import shift_in_sequences
from qvl.kernels.torch_gated_delta import GatedDeltaNet


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNorm: normalised in fp32, scaled by (1 + weight), cast back, in its order of ops."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaled by (1 + weight), the weight initialised to zero: Megatron's `layernorm_zero_centered_gamma`
    and transformers' Qwen3_5RMSNorm, computed in fp32 in the same order as the latter.

    Eagerly that is 10 kernels forward and more backward, each reading and writing the fp32 activation (the step
    census of Qwen3.5-VL: most of its language model's eager launches); it runs as one of qvl's compiled regions
    (qvl.kernels.compiled: one kernel each way on CUDA, the eager function elsewhere and inside an enclosing
    compile)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if getattr(config, "sequence_parallel", False):
            self.weight.sequence_parallel = True  # its gradient is reduced over the TP group like TE's norms'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(x, self.weight)

    def _scaled(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return compiled.region(zero_centred_rms_norm, x)(x, weight, self.eps)


class GatedDeltaOutNorm(ZeroCenteredRMSNorm):
    """The Gated DeltaNet's output norm (per value head, one weight for all heads). Under tensor parallelism each
    rank normalises its own value heads, so its weight's gradient is that rank's part: summed over the TP group in
    backward here. Megatron-Core 0.19.2 sums the q/k norms' partial gradients in finalize_model_grads, matched by
    name, but not this one (megatron/core/distributed/finalize_model_grads.py ~452): at TP=2 its gradient was half
    off (the parity check at TP=2, tests/training/test_parity_parallel.py). It normalises whole sequences (the
    Gated DeltaNet's input projection gathers them under sequence parallelism), so it is not marked
    `sequence_parallel`: that would sum its gradient over the group a second time.

    The TP group is taken when the layer is built. Megatron-Core compiles the norm's caller (`_apply_gated_norm`,
    `@jit_fuser`), and without a group `copy_to_tensor_model_parallel_region` warns on rank 0 at every call; Dynamo
    cannot trace `warnings.warn`, so the region broke into two graphs there (the step census's compiled regions, for
    Qwen3.5-VL). On one TP rank there is nothing to sum, and the weight is used as it is."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__(config, hidden_size, eps, **kwargs)
        self.weight.sequence_parallel = False
        self.tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        self.summed = self.tp_group is None or self.tp_group.size() > 1  # decided here, not in the compiled region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.summed:
            return self._scaled(x, self.weight)
        # identity; all-reduce in backward (no group when built before Megatron's groups: the default one, then)
        return self._scaled(x, copy_to_tensor_model_parallel_region(self.weight, group=self.tp_group))


def _zero_centred_norms(layer: ModuleSpec) -> ModuleSpec:
    """The layer spec with every norm (input, pre-MLP, q/k) a ZeroCenteredRMSNorm."""
    layer.submodules.input_layernorm = ZeroCenteredRMSNorm
    layer.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention = layer.submodules.self_attention.submodules
    attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
    return layer


def _gated_delta_layer(attention_layer: ModuleSpec) -> ModuleSpec:
    """The full-attention layer spec with its attention replaced by a Gated DeltaNet (same norms and MLP)."""
    layer = copy.deepcopy(attention_layer)
    if layer.module is TransformerLayer:  # dense: its MLP graphed alone (a MoE layer's graphs hold no Gated DeltaNet)
        layer.module = GraphedMLPLayer
    layer.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedDeltaOutNorm, out_proj=RowParallelLinear
        ),
    )
    return layer


def _attention_layer(config, vp_stage: int | None) -> ModuleSpec:
    """The gated full-attention layer (mRoPE, zero-centred norms, the config's dense or MoE MLP)."""
    layer = _zero_centred_norms(local_gpt_layer_spec(config, vp_stage=vp_stage))
    layer.submodules.self_attention.module = Qwen3VLSelfAttention  # mRoPE
    return layer


def local_hybrid_block_spec(config, vp_stage: int | None = None, pp_rank: int | None = None):
    """The Qwen3.5 language block from local modules: this pipeline stage's slice of the layer pattern
    (`linear_attention_freq`) with a zero-centred final norm; mirrors Megatron-Core's TE-only
    get_transformer_block_with_experimental_attention_variant_spec."""
    attention_layer = _attention_layer(config, vp_stage)
    delta_layer = _gated_delta_layer(attention_layer)
    pattern = get_linear_attention_pattern(config)  # 1 = Gated DeltaNet, 0 = full attention
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = [delta_layer if pattern[i] else attention_layer for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)


class MultiTokenPredictionLayer(upstream_mtp.MultiTokenPredictionLayer):
    """Megatron-Core's MTP layer, which takes the next token's input as served: given the main decoder's input
    (`main_decoder_input`, from `Qwen35VLGPTModel`), the vision features where the token ahead is an image or video
    placeholder, not the placeholder's embedding (qvl.bridges.mtp_inputs). In a packed (THD) micro-batch on one
    context-parallel rank its next-token ids and positions are shifted inside each sample on the device
    (qvl.kernels.packed_shift) instead of by upstream's `roll_tensor`, which reads every sample's bounds back to the
    host, twice per micro-batch. The same tensors (tests/training/test_mtp.py)."""

    def forward(self, *args, embedding=None, main_decoder_input: torch.Tensor | None = None, **kwargs):
        """Upstream's forward, the next tokens embedded by `NextTokenInputs` where the main input is given."""
        if main_decoder_input is not None:
            embedding = NextTokenInputs(
                embedding,
                main_decoder_input,
                depth=self.layer_number,  # the k-th MTP layer reads the tokens k ahead
                vision_token_ids=(self.config.image_token_id, self.config.video_token_id),
                sequence_parallel_group=self.tp_group if self.config.sequence_parallel else None,
            )
        return super().forward(*args, embedding=embedding, **kwargs)

    def _get_embeddings(
        self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None, padding_mask=None
    ):
        cp = self.cp_group.size() if self.cp_group is not None else 1
        if packed_seq_params is None or padding_mask is not None or cp > 1:
            return super()._get_embeddings(
                input_ids, position_ids, embedding, hidden_states, packed_seq_params, padding_mask
            )
        # upstream's body with the shift replaced (megatron/core/transformer/multi_token_prediction.py ~1109-1160)
        cu_seqlens = packed_seq_params.cu_seqlens_q
        input_ids, position_ids = (
            shift_in_sequences(input_ids, cu_seqlens),
            shift_in_sequences(position_ids, cu_seqlens),
        )
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if self.config.mtp_detach_heads:
            decoder_input = decoder_input.detach()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not hidden_states.requires_grad:  # after a detach (mtp_detach_heads), as upstream keeps the graph
            hidden_states.requires_grad_(True)
        return input_ids, position_ids, padding_mask, decoder_input, hidden_states


def local_mtp_block_spec(config, vp_stage: int | None = None) -> MultiTokenPredictionBlockSubmodules | None:
    """Megatron-Core's MTP block from local modules (None where this stage builds no MTP layer): per depth, the
    published head (`fc` = eh_proj, `pre_fc_norm_embedding` = enorm, `pre_fc_norm_hidden` = hnorm, `norm` =
    final_layernorm) around one full-attention layer like the decoder's (qvl.bridges.mtp_reference); mirrors
    Megatron-Core's get_gpt_mtp_block_spec, whose norms would not be zero-centred."""
    if not config.mtp_num_layers or get_mtp_num_layers_to_build(config, vp_stage=vp_stage) == 0:
        return None
    if config.mtp_use_repeated_layer and config.mtp_num_layers > 1:  # one layer at every depth: no depth to read
        raise ConversionError("mtp_use_repeated_layer=True is not supported for Qwen3.5 MTP; set it to False")
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=ZeroCenteredRMSNorm,
            hnorm=ZeroCenteredRMSNorm,
            eh_proj=ColumnParallelLinear,
            mtp_model_layer=_attention_layer(config, vp_stage),
            layer_norm=ZeroCenteredRMSNorm,
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)


class Qwen35VLGPTModel(Qwen3VLGPTModel):
    """Megatron-Bridge's Qwen3-VL language model whose MTP layers read the main decoder's input, vision features
    merged (qvl.bridges.mtp_inputs): as an argument where this stage has it, else sent from the first pipeline stage
    over `mtp_vision_link` (set where pipeline_parallel > 1)."""

    mtp_vision_link: VisionRowsLink | None = None

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, **kwargs):
        """Upstream's forward; on the first of several pipeline stages, the vision rows sent to the MTP stage."""
        if self.mtp_vision_link is not None and self.pre_process and decoder_input is not None:
            decoder_input = self.mtp_vision_link.send(
                decoder_input,
                input_ids,
                dtype=self.config.params_dtype,
                vision_token_ids=self._vision_token_ids(),
                sequence_parallel_group=self._sequence_parallel_group(),
            )
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, **kwargs)

    def _postprocess(self, hidden_states, *args, input_ids=None, decoder_input=None, extra_block_kwargs=None, **kw):
        # GPTModel._postprocess spreads `extra_block_kwargs` into the MTP block's arguments, and the block hands its
        # own `extra_block_kwargs` to every MTP layer (megatron/core/transformer/multi_token_prediction.py ~1826)
        if self.mtp_process:
            main = self._main_input(decoder_input, input_ids, hidden_states)
            if main is not None:
                extra_block_kwargs = {**(extra_block_kwargs or {}), "extra_block_kwargs": {"main_decoder_input": main}}
        return super()._postprocess(hidden_states, *args, input_ids=input_ids, decoder_input=decoder_input,
                                    extra_block_kwargs=extra_block_kwargs, **kw)  # fmt: skip

    def _main_input(self, decoder_input, input_ids, hidden_states) -> torch.Tensor | None:
        """The main decoder's input [s, b, h], whole over sequence-parallel ranks: this stage's, or the vision rows
        the first stage sent (zeros elsewhere: the MTP layer reads only those)."""
        if decoder_input is not None:
            group = self._sequence_parallel_group()
            if group is None:
                return decoder_input
            return gather_from_sequence_parallel_region(decoder_input, tensor_parallel_output_grad=False, group=group)
        if self.mtp_vision_link is None or input_ids is None:
            return None
        like = hidden_states.new_empty(0, hidden_states.shape[-1], dtype=self.config.params_dtype)  # [0, h]
        return self.mtp_vision_link.receive(input_ids, like, self._vision_token_ids())

    def _vision_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def _sequence_parallel_group(self):
        return self.pg_collection.tp if self.config.sequence_parallel else None


def _with_mtp_inputs(model: Qwen3VLModel, link: VisionRowsLink | None) -> Qwen3VLModel:
    """`model` with its language model a `Qwen35VLGPTModel` (a subclass adding methods only, as
    qvl.bridges.qwen3_vl._adopt does) and, on the stage with the vision tower and the stage with the MTP layers when
    they differ, `link` between the two (`vision_rows_link`)."""
    language = model.language_model
    language.__class__ = Qwen35VLGPTModel
    if model.pre_process or language.mtp_process:
        language.mtp_vision_link = link
    return model


def _mtp_vision_link(model: Qwen3VLModel) -> VisionRowsLink | None:
    """The link between the vision tower's and the MTP layers' pipeline stages (None without MTP, without pipeline
    parallelism, and on the stages between); made by every rank (`vision_rows_link`)."""
    pp = model.language_model.pg_collection.pp
    return vision_rows_link(pp) if model.language_model.config.mtp_num_layers and pp.size() > 1 else None


class _LocalLanguageSpec:
    """Provider mix-in: the language and MTP blocks from local modules where TE is absent, and qvl's Qwen3VLModel."""

    def build_language_spec(self, vp_stage=None, pp_rank=None):
        if have_transformer_engine():
            return super().build_language_spec(vp_stage=vp_stage, pp_rank=pp_rank)
        return local_hybrid_block_spec(self, vp_stage=vp_stage, pp_rank=pp_rank)

    def build_mtp_spec(self, vp_stage=None):
        if have_transformer_engine():
            return super().build_mtp_spec(vp_stage=vp_stage)
        return local_mtp_block_spec(self, vp_stage=vp_stage)

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> Qwen3VLModel:
        self.vision_config.torch_dtype = self.params_dtype
        model = Qwen3VLModel(
            language_transformer_config=self,
            language_transformer_layer_spec=self.build_language_spec(vp_stage=vp_stage),
            vision_transformer_config=self.vision_config,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self._pg_collection,
            mtp_block_spec=self.build_mtp_spec(vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        if self.freeze_language_model or self.freeze_vision_model or self.freeze_vision_projection:
            model.freeze(
                freeze_language_model=self.freeze_language_model,
                freeze_vision_model=self.freeze_vision_model,
                freeze_vision_projection=self.freeze_vision_projection,
            )
        if vp_stage in (None, 0):  # once per build, on every rank: the link's groups are made by all ranks
            self._mtp_vision_link = _mtp_vision_link(model)
        return _with_mtp_inputs(model, self._mtp_vision_link)


@dataclasses.dataclass
class QvlQwen35VLModelProvider(_LocalLanguageSpec, Qwen35VLModelProvider):
    """Qwen3.5-VL dense provider that builds with or without TE and `fla`."""


@dataclasses.dataclass
class QvlQwen35VLMoEModelProvider(_LocalLanguageSpec, Qwen35VLMoEModelProvider):
    """Qwen3.5-VL MoE provider that builds with or without TE and `fla`."""


def _from_checkpoint(provider, hf_config):
    """The fields upstream reads with fallbacks to the released models' values, read from the checkpoint."""
    text_config = hf_config.text_config
    provider.mrope_section = mrope_section(text_config)
    provider.bos_token_id, provider.eos_token_id = text_config.bos_token_id, text_config.eos_token_id
    return provider


@MegatronModelBridge.register_bridge(
    source=Qwen3_5ForConditionalGeneration, target=Qwen3VLModel, provider=QvlQwen35VLModelProvider, model_type="qwen3_5"
)
class Qwen35VLBridge(upstream_bridge.Qwen35VLBridge):
    """Megatron-Bridge's Qwen3.5-VL dense bridge, handing out qvl's provider; mappings inherited, plus the MTP
    layer's norms under local-spec names."""

    def provider_bridge(self, hf_pretrained) -> QvlQwen35VLModelProvider:
        provider = provider_as(QvlQwen35VLModelProvider, super().provider_bridge(hf_pretrained))
        return _from_checkpoint(provider, hf_pretrained.config)

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*super().mapping_registry().get_all_mappings(), *mtp_local_norms())


@MegatronModelBridge.register_bridge(
    source=Qwen3_5MoeForConditionalGeneration,
    target=Qwen3VLModel,
    provider=QvlQwen35VLMoEModelProvider,
    model_type="qwen3_5_moe",
)
class Qwen35VLMoEBridge(upstream_bridge.Qwen35VLMoEBridge):
    """Megatron-Bridge's Qwen3.5-VL MoE bridge, handing out qvl's provider; mappings inherited, plus the MTP
    layer's per-expert (local-spec) experts."""

    def provider_bridge(self, hf_pretrained) -> QvlQwen35VLMoEModelProvider:
        provider = provider_as(QvlQwen35VLMoEModelProvider, super().provider_bridge(hf_pretrained))
        return _from_checkpoint(provider, hf_pretrained.config)

    def mapping_registry(self) -> MegatronMappingRegistry:
        # Upstream picks packed or per-expert tables from a loaded checkpoint's keys; a config-only bridge (export)
        # reads the names `qvl convert import` recorded, so a Qwen3.6 checkpoint exports packed as it came.
        hf_pretrained = getattr(self, "hf_pretrained", None)
        keys = checkpoint_keys(hf_pretrained)
        self.hf_pretrained = _KeysView(hf_pretrained, keys) if keys is not None else hf_pretrained
        try:
            upstream = super().mapping_registry()
        finally:
            self.hf_pretrained = hf_pretrained
        experts = mtp_local_expert_mappings(keys or [])
        return MegatronMappingRegistry(*upstream.get_all_mappings(), *mtp_local_norms(), *experts)


def checkpoint_keys(hf_pretrained) -> list[str] | None:
    """The HF checkpoint's tensor names: a loaded checkpoint's, else those recorded at import, else None."""
    source = getattr(getattr(hf_pretrained, "state", None), "source", None)
    if source is not None:
        return list(source.get_all_keys())
    return recorded_tensor_names(getattr(hf_pretrained, "config", hf_pretrained))


class _KeysView:
    """An HF model wrapper or config that answers `.state.source.get_all_keys()` with `keys`, as a loaded
    checkpoint does (what Megatron-Bridge's `moe_experts_stored_packed` and MTP table read)."""

    def __init__(self, wrapped, keys: list[str]):
        self._wrapped = wrapped
        self.state = types.SimpleNamespace(source=types.SimpleNamespace(get_all_keys=lambda: keys))

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


# Megatron-Bridge aliases TE's fused norm names to local ones only for `*.`-patterns; its MTP table is literal
# (`mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight`), so the local names are mapped here.
_MTP_LAYER = "language_model.mtp.layers.*.mtp_model_layer"


# New mappings per registry: a conversion records its process groups on the mappings it runs (Megatron-Bridge's
# `pp_group`, `_tp_group`, ...), so module-level ones would keep a finished conversion's groups, threads and all.
def mtp_local_norms() -> list:
    return [
        AutoMapping(megatron_param=f"{_MTP_LAYER}.input_layernorm.weight", hf_param="mtp.layers.*.input_layernorm.weight"),
        AutoMapping(megatron_param=f"{_MTP_LAYER}.pre_mlp_layernorm.weight", hf_param="mtp.layers.*.post_attention_layernorm.weight"),
    ]  # fmt: skip


def mtp_local_expert_mappings(keys: list[str]) -> list:
    """The MTP layer's routed experts as local specs build them (SequentialMLP), per-expert or packed on the HF
    side as the checkpoint (its tensor names `keys`) stores them (Megatron-Bridge's own test:
    `mtp.layers.0.mlp.experts.gate_up_proj`)."""
    megatron = f"{_MTP_LAYER}.mlp.experts.local_experts.*"
    if "mtp.layers.0.mlp.experts.gate_up_proj" in keys:
        return [
            FusedGatedExpertMapping(megatron_param=f"{megatron}.linear_fc1.weight", hf_param="mtp.layers.*.mlp.experts.gate_up_proj"),
            FusedExpertMapping(megatron_param=f"{megatron}.linear_fc2.weight", hf_param="mtp.layers.*.mlp.experts.down_proj"),
        ]  # fmt: skip
    return [
        GatedMLPMapping(
            megatron_param=f"{megatron}.linear_fc1.weight",
            gate="mtp.layers.*.mlp.experts.*.gate_proj.weight",
            up="mtp.layers.*.mlp.experts.*.up_proj.weight",
        ),
        AutoMapping(megatron_param=f"{megatron}.linear_fc2.weight", hf_param="mtp.layers.*.mlp.experts.*.down_proj.weight"),
    ]  # fmt: skip
