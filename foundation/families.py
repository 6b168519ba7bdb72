"""One record per Qwen-VL model family, read by data, bridges, recipes and the planner.

A family is what shares one HF architecture class, one processor and one bridge: Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5-VL and Qwen3.5-VL-MoE. Its record says which transformers classes it uses, how its processor
resizes, normalises and times video, which of its behaviours differ from the others (as flags, so no code outside
this file compares family names), the tiny debug flavour every test and the demo build, and which qvl modules hold
its bridge and recipes. Sizes (2B, 7B, ...) are not families: they are rows of `qvl.recipes.architectures`.

Adding a family is one `Family(...)` below, plus its bridge module (if Megatron-Bridge has none or it needs fixes)
and its recipe module; see docs/recipes.md, "Adding a model family", for what Qwen3.5-VL, the last one added, took.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from qvl.foundation.errors import ConfigError

# Image normalisation of the HF image processors (class defaults, used when a checkpoint's config omits them).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

# Qwen's special tokens, first in the tiny tokenizer's vocabulary so their ids stay below any vocab_size.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _frozen(mapping: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(kw_only=True, slots=True, frozen=True)
class Release:
    """A later release of a family's architecture (Qwen3.6 and Qwen3.8 of Qwen3.5's): the same HF classes, bridge and
    recipe module; what differs is on disk or in its chat template. Its sizes are rows of `qvl.recipes.architectures`
    named "<release>-<size>" ("3.6-27b")."""

    name: str  # "3.6"
    title: str  # "Qwen3.6"
    packed_experts: bool = False  # MoE experts stored packed per layer (`experts.gate_up_proj` [E, 2I, H], gate first)
    chat_template: str | None = None  # the tiny tokenizer's (qvl.foundation.tiny_processor); None: the family's


@dataclass(kw_only=True, slots=True, frozen=True)
class Family:
    """Everything qvl knows about one model family."""

    name: str  # qvl's name, used on the command line and in dataset reports: "qwen2_5_vl"
    title: str  # "Qwen2.5-VL"
    hf_architecture: str  # config.json `architectures[0]`, the class Megatron-Bridge bridges are keyed on
    config_class: str  # transformers config class
    vision_config_class: str  # transformers class of `config.vision_config`
    hf_module: str  # transformers.models.<hf_module> holds the classes
    vision_tower_class: str  # the HF vision tower (incl. merger), built on meta by the planner to count parameters
    processor_class: str
    video_processor_class: str
    moe: bool = False
    # Qwen3-VL's vision tower is a Megatron module (TP-sharded, recomputable, deepstack outputs); Qwen2/2.5-VL's is
    # the HF module replicated on every tensor-parallel rank.
    megatron_vision_tower: bool = False
    vision_gated_mlp: bool = False  # Qwen2.5-VL's ViT MLP is SwiGLU; Qwen2-VL's and Qwen3-VL's are plain GELU MLPs
    # --- processor behaviour (transformers 5.12 defaults, used where a checkpoint's processor config is silent)
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    video_defaults: Mapping[str, Any]
    # Qwen3VLVideoProcessor's rules: frames sampled evenly (no rounding to the temporal patch), one pixel budget
    # for the whole clip, each frame pair its own t=1 grid preceded by "<t seconds>" text. Qwen2/2.5-VL resize
    # per frame and give one grid per video.
    video_frames_timestamped: bool = False
    # Qwen2.5-VL: temporal mRoPE positions advance by tokens_per_second x seconds per grid step.
    video_positions_in_seconds: bool = False
    # Qwen2.5-VL and Qwen3-VL place frames in time, so a frame folder without fps cannot be used.
    video_needs_fps: bool = True
    chat_template: str = "qwen2"  # which Qwen chat template the tiny tokenizer carries (qvl.foundation.tiny_processor)
    # --- debug flavour: a tiny random model with the family's real block structure
    tiny_text: Mapping[str, Any]
    tiny_vision: Mapping[str, Any]
    tiny_pixels: tuple[int, int]  # (min_pixels, max_pixels) of the tiny processor: a few dozen tokens per image
    # --- where the code lives
    bridge_module: str | None  # qvl module whose import registers the bridge; None: Megatron-Bridge's own
    recipe_module: str  # qvl module that registers the family's recipes
    # Checkpoint tensors qvl carries through conversion untouched instead of converting (qvl.bridges.unconverted).
    unconverted_prefixes: tuple[str, ...] = ()
    # The Megatron modules each adapter target (ADAPTER_TARGETS) means: Megatron-Bridge LoRA `target_modules` wildcards
    # over the built model's module names (qvl.bridges.adapters); () where the family has no such part.
    adapter_modules: Mapping[str, tuple[str, ...]]
    releases: Mapping[str, Release] = field(default_factory=lambda: _frozen({}))  # by name: "3.6"
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))

    @property
    def patch_size(self) -> int:
        """The vision tower's patch size (pixels)."""
        return int(self.tiny_vision["patch_size"])

    def release(self, name: str | None) -> Release | None:
        """The release called `name` (None: the family's first); the error lists the releases that exist."""
        if name is None:
            return None
        if name not in self.releases:
            known = ", ".join(self.releases) or "none"
            raise ConfigError(f"{self.title} has no release {name!r}; its later releases: {known}")
        return self.releases[name]


# Tiny text model: Qwen2 / Qwen3 blocks at hidden 64, head_dim 16 (so mRoPE sections sum to 8). Token ids are the
# tiny tokenizer's (qvl.foundation.tiny_processor), whose special tokens are ids 0-6.
TINY_VOCAB_SIZE = 512
TINY_TOKEN_IDS = _frozen(
    {
        "vision_start_token_id": SPECIAL_TOKENS.index("<|vision_start|>"),
        "vision_end_token_id": SPECIAL_TOKENS.index("<|vision_end|>"),
        "image_token_id": SPECIAL_TOKENS.index("<|image_pad|>"),
        "video_token_id": SPECIAL_TOKENS.index("<|video_pad|>"),
    }
)
_TINY_TEXT = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
    pad_token_id=0,
)
_QWEN2_TINY_TEXT = dict(
    _TINY_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
)
_QWEN3_TINY_ROPE = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
_QWEN3_TINY_TEXT = dict(_TINY_TEXT, head_dim=16, rope_parameters=_QWEN3_TINY_ROPE)
_QWEN3_TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0],
)

# Video processor class defaults (transformers 5.12 Qwen2VLVideoProcessor / Qwen3VLVideoProcessor).
_QWEN2_VIDEO = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=128 * 28 * 28,
    max_pixels=28 * 28 * 768,
    fps=None,
    min_frames=4,
    max_frames=768,
    do_sample_frames=False,
)
_QWEN3_VIDEO = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=128 * 32 * 32,
    max_pixels=32 * 32 * 768,
    fps=2.0,
    min_frames=4,
    max_frames=768,
    do_sample_frames=True,
)

# What a PEFT recipe can adapt, by meaning (recipe option `adapter_targets`, default the language model alone). The
# language model's linears leave out its routed MoE experts ("experts") and any multi-token-prediction block.
ADAPTER_TARGETS = ("language", "vision", "merger", "experts")
_LM = "language_model.decoder.layers.*."
_LM_ATTENTION = (_LM + "self_attention.linear_qkv", _LM + "self_attention.linear_proj")
_LM_MLP = (_LM + "mlp.linear_fc1", _LM + "mlp.linear_fc2")
_LM_DELTANET = (_LM + "self_attention.in_proj", _LM + "self_attention.out_proj")  # Qwen3.5's Gated DeltaNet layers
_LM_SHARED_EXPERT = (_LM + "mlp.shared_experts.linear_fc1", _LM + "mlp.shared_experts.linear_fc2")
_LM_EXPERTS = (_LM + "mlp.experts.*.linear_fc1", _LM + "mlp.experts.*.linear_fc2")
_HF_MERGER = ("visual.merger.mlp.0", "visual.merger.mlp.2")  # the replicated HF tower's (Qwen2/2.5-VL)
_MEGATRON_VISION = tuple(
    f"vision_model.decoder.layers.*.{name}"
    for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
)
_MEGATRON_MERGER = ("vision_model.merger.linear_fc1", "vision_model.merger.linear_fc2")
_DEEPSTACK_MERGERS = (
    "vision_model.decoder.deepstack_merger_list.*.linear_fc1",
    "vision_model.decoder.deepstack_merger_list.*.linear_fc2",
)


def _adapter_modules(*, language: tuple[str, ...], vision: tuple[str, ...], merger: tuple[str, ...],
                     experts: tuple[str, ...] = ()) -> Mapping[str, tuple[str, ...]]:  # fmt: skip
    return _frozen(dict(language=language, vision=vision, merger=merger, experts=experts))


_QWEN3_COMMON = dict(
    hf_module="qwen3_vl",
    vision_tower_class="Qwen3VLVisionModel",
    processor_class="Qwen3VLProcessor",
    video_processor_class="Qwen3VLVideoProcessor",
    megatron_vision_tower=True,
    image_mean=HALF,
    image_std=HALF,
    video_defaults=_frozen(_QWEN3_VIDEO),
    video_frames_timestamped=True,
    chat_template="qwen3",
    tiny_vision=_frozen(_QWEN3_TINY_VISION),
    tiny_pixels=(64 * 64, 32 * 32 * 64),
    bridge_module="qvl.bridges.qwen3_vl",
    recipe_module="qvl.recipes.qwen3_vl",
    adapter_modules=_adapter_modules(
        language=_LM_ATTENTION + _LM_MLP, vision=_MEGATRON_VISION, merger=_MEGATRON_MERGER + _DEEPSTACK_MERGERS
    ),
)

# Qwen3.5-VL: Qwen3-VL's processor and vision tower without DeepStack, and a hybrid LM: three Gated DeltaNet
# (linear attention) layers per gated full-attention layer, zero-centred RMSNorm, mRoPE over a quarter of head_dim
# (partial_rotary_factor 0.25: head_dim 32 rotates 8 dims, sections sum to 4). The tiny LM keeps the pattern
# (layers 0-2 DeltaNet, 3 full attention) and more value than key heads (4 vs 2), as the released models have.
_QWEN3_5_TINY_ROPE = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
_QWEN3_5_TINY_TEXT = dict(
    _TINY_TEXT,
    head_dim=32,
    rope_parameters=_QWEN3_5_TINY_ROPE,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    # As every released config: one multi-token-prediction layer sharing the main embedding (qvl.bridges.mtp_reference)
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
)
_QWEN3_5_COMMON = dict(
    _QWEN3_COMMON,
    tiny_vision=_frozen({k: v for k, v in _QWEN3_TINY_VISION.items() if k != "deepstack_visual_indexes"}),
    bridge_module="qvl.bridges.qwen3_5_vl",  # Megatron-Bridge's Qwen35VL bridges without TE or fla
    chat_template="qwen3_5",  # Qwen3-VL's with reasoning turns (<think> blocks, `enable_thinking`)
    # Released checkpoints carry multi-token-prediction weights: converted into Megatron-Core's MTP block, and also
    # kept aside at import so a run trained without MTP exports them unchanged.
    unconverted_prefixes=("mtp.",),
    # Qwen3.6 (2026-04) ships MoE experts packed, main layers and MTP alike (Megatron-Bridge's qwen35_vl_bridge reads
    # `mtp.layers.0.mlp.experts.gate_up_proj`); Qwen3.8 (2026-08) a chat template with `reasoning_effort`.
    releases=_frozen(
        {
            "3.6": Release(name="3.6", title="Qwen3.6", packed_experts=True),
            "3.8": Release(name="3.8", title="Qwen3.8", chat_template="qwen3_8"),
        }
    ),
    recipe_module="qvl.recipes.qwen3_5_vl",
    adapter_modules=_adapter_modules(
        language=_LM_ATTENTION + _LM_DELTANET + _LM_MLP, vision=_MEGATRON_VISION, merger=_MEGATRON_MERGER
    ),
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="qwen2_vl",
            title="Qwen2-VL",
            hf_architecture="Qwen2VLForConditionalGeneration",
            config_class="Qwen2VLConfig",
            vision_config_class="Qwen2VLVisionConfig",
            hf_module="qwen2_vl",
            vision_tower_class="Qwen2VisionTransformerPretrainedModel",
            processor_class="Qwen2VLProcessor",
            video_processor_class="Qwen2VLVideoProcessor",
            video_defaults=_frozen(_QWEN2_VIDEO),
            video_needs_fps=False,
            tiny_text=_frozen(_QWEN2_TINY_TEXT),
            # LayerNorm blocks and a non-gated (QuickGELU) MLP; embed_dim is the ViT width, hidden_size the LM's.
            tiny_vision=_frozen(
                dict(
                    depth=2,
                    embed_dim=32,
                    hidden_size=64,
                    num_heads=2,
                    mlp_ratio=2,
                    patch_size=14,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                )
            ),
            tiny_pixels=(56 * 56, 28 * 28 * 64),
            bridge_module="qvl.bridges.qwen2_vl",  # Megatron-Bridge 0.6.2 has no Qwen2-VL bridge
            recipe_module="qvl.recipes.qwen2_vl",
            adapter_modules=_adapter_modules(
                language=_LM_ATTENTION + _LM_MLP,
                vision=tuple(f"visual.blocks.*.{n}" for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")),
                merger=_HF_MERGER,
            ),
        ),
        Family(
            name="qwen2_5_vl",
            title="Qwen2.5-VL",
            hf_architecture="Qwen2_5_VLForConditionalGeneration",
            config_class="Qwen2_5_VLConfig",
            vision_config_class="Qwen2_5_VLVisionConfig",
            hf_module="qwen2_5_vl",
            vision_tower_class="Qwen2_5_VisionTransformerPretrainedModel",
            processor_class="Qwen2_5_VLProcessor",
            video_processor_class="Qwen2VLVideoProcessor",
            video_defaults=_frozen(_QWEN2_VIDEO),
            video_positions_in_seconds=True,
            vision_gated_mlp=True,
            tiny_text=_frozen(_QWEN2_TINY_TEXT),
            # Windowed attention (56-pixel windows) with full-attention blocks 1 and 3, SwiGLU MLP.
            tiny_vision=_frozen(
                dict(
                    depth=4,
                    hidden_size=32,
                    intermediate_size=64,
                    num_heads=2,
                    out_hidden_size=64,
                    patch_size=14,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                    window_size=56,
                    fullatt_block_indexes=[1, 3],
                    tokens_per_second=2,
                )
            ),
            tiny_pixels=(56 * 56, 28 * 28 * 64),
            bridge_module="qvl.bridges.qwen2_5_vl",  # Megatron-Bridge's bridge handing out qvl's model class
            recipe_module="qvl.recipes.qwen2_5_vl",
            adapter_modules=_adapter_modules(
                language=_LM_ATTENTION + _LM_MLP,
                vision=tuple(
                    f"visual.blocks.*.{n}"
                    for n in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
                ),
                merger=_HF_MERGER,
            ),
        ),
        Family(
            name="qwen3_vl",
            title="Qwen3-VL",
            hf_architecture="Qwen3VLForConditionalGeneration",
            config_class="Qwen3VLConfig",
            vision_config_class="Qwen3VLVisionConfig",
            tiny_text=_frozen(_QWEN3_TINY_TEXT),
            **_QWEN3_COMMON,
        ),
        Family(
            name="qwen3_vl_moe",
            title="Qwen3-VL-MoE",
            hf_architecture="Qwen3VLMoeForConditionalGeneration",
            config_class="Qwen3VLMoeConfig",
            vision_config_class="Qwen3VLMoeVisionConfig",
            moe=True,
            # moe_intermediate_size 24: the fused gate_up [E, 64, 48] is not square, so transformers can tell its
            # on-disk layout apart when loading (its Transpose(1, 2, check_dims=True) converter is ambiguous on
            # square tensors).
            tiny_text=_frozen(
                dict(
                    _QWEN3_TINY_TEXT,
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=24,
                    decoder_sparse_step=1,
                )
            ),
            **{
                **_QWEN3_COMMON,
                "hf_module": "qwen3_vl_moe",
                "vision_tower_class": "Qwen3VLMoeVisionModel",
                "adapter_modules": _adapter_modules(
                    language=_LM_ATTENTION,
                    vision=_MEGATRON_VISION,
                    merger=_MEGATRON_MERGER + _DEEPSTACK_MERGERS,
                    experts=_LM_EXPERTS,
                ),
            },
        ),
        Family(
            name="qwen3_5_vl",
            title="Qwen3.5-VL",
            hf_architecture="Qwen3_5ForConditionalGeneration",
            config_class="Qwen3_5Config",
            vision_config_class="Qwen3_5VisionConfig",
            tiny_text=_frozen(_QWEN3_5_TINY_TEXT),
            **{**_QWEN3_5_COMMON, "hf_module": "qwen3_5", "vision_tower_class": "Qwen3_5VisionModel"},
        ),
        Family(
            name="qwen3_5_vl_moe",
            title="Qwen3.5-VL-MoE",
            hf_architecture="Qwen3_5MoeForConditionalGeneration",
            config_class="Qwen3_5MoeConfig",
            vision_config_class="Qwen3_5MoeVisionConfig",
            moe=True,
            # Routed experts 24 wide (fused gate_up [E, 48, 64], not square, see Qwen3-VL-MoE) plus a gated shared
            # expert of another width, 40.
            tiny_text=_frozen(
                dict(
                    _QWEN3_5_TINY_TEXT,
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=24,
                    shared_expert_intermediate_size=40,
                )
            ),
            **{
                **_QWEN3_5_COMMON,
                "hf_module": "qwen3_5_moe",
                "vision_tower_class": "Qwen3_5MoeVisionModel",
                "adapter_modules": _adapter_modules(
                    language=_LM_ATTENTION + _LM_DELTANET + _LM_SHARED_EXPERT,
                    vision=_MEGATRON_VISION,
                    merger=_MEGATRON_MERGER,
                    experts=_LM_EXPERTS,
                ),
            },
        ),
    )
}


def get_family(name: str) -> Family:
    """The family called `name`; the error lists the families that exist."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_architecture(hf_architecture: str) -> Family | None:
    """The family whose HF class is `hf_architecture` (config.json `architectures[0]`), or None."""
    return next((f for f in FAMILIES.values() if f.hf_architecture == hf_architecture), None)


def family_of_vision_config(class_name: str) -> Family | None:
    """The family whose vision config class is called `class_name`, or None."""
    return next((f for f in FAMILIES.values() if f.vision_config_class == class_name), None)


def family_of_provider(provider: Any) -> Family | None:
    """The family of a Megatron-Bridge provider (or anything with a `vision_config`), from its HF vision config's
    class; None without one or for a class no family has."""
    vision = getattr(provider, "vision_config", None)
    return family_of_vision_config(type(vision).__name__) if vision is not None else None
