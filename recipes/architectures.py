"""The published Qwen-VL architectures, as transformers config kwargs, so recipes build offline.

Every row is copied from the model's `config.json` on the Hugging Face hub (the repo named in `hub_id`,
`text_config` / `vision_config` sections). `hf_config(family, size)` turns a row into a transformers
config object with `architectures` set, which `qvl.bridges.providers.provider_from_hf` accepts without
any download. A local checkpoint directory always wins over the table (`load_hf_config`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qvl.foundation.cost import shapes_from_hf_config
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import FAMILIES, Family, get_family

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class Architecture:
    """One published checkpoint: hub id, transformers config class, and its text/vision kwargs."""

    family: str  # a qvl.foundation.families name
    size: str
    hub_id: str
    text: dict[str, Any]
    vision: dict[str, Any]
    top: dict[str, Any] = field(default_factory=dict)

    @property
    def record(self) -> Family:
        """The family's record."""
        return get_family(self.family)

    @property
    def config_class(self) -> str:
        """The transformers config class."""
        return self.record.config_class

    @property
    def hf_architecture(self) -> str:
        """The `architectures[0]` name the bridges are registered under."""
        return self.record.hf_architecture


def _rope(theta: float, section: list[int], **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": section, **extra}


# --- Qwen2-VL: huggingface.co/Qwen/Qwen2-VL-{2B,7B,72B}-Instruct/config.json --------------------------
# The vision tower is the same 675M ViT for all sizes (embed_dim 1280, 32 blocks, QuickGELU MLP x4);
# its `hidden_size` is the merger's output width, i.e. the LM hidden size.
_Q2_ROPE = _rope(1_000_000.0, [16, 24, 24])
_Q2_VISION = dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")  # fmt: skip

# --- Qwen2.5-VL: huggingface.co/Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct/config.json --------------------
# Windowed ViT (112-pixel windows, full attention in blocks 7/15/23/31), SwiGLU MLP 3420 wide.
_Q25_ROPE = _rope(1_000_000.0, [16, 24, 24])
_Q25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                   tokens_per_second=2, hidden_act="silu")  # fmt: skip

# --- Qwen3-VL: huggingface.co/Qwen/Qwen3-VL-{2B,4B,8B,32B,30B-A3B,235B-A22B}-Instruct/config.json ---------
# Interleaved mRoPE (section 24/20/20, theta 5e6), 16-pixel patches, DeepStack features from 3 ViT blocks.
_Q3_ROPE = _rope(5_000_000.0, [24, 20, 20], mrope_interleaved=True)
_Q3_VISION_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3, patch_size=16,
                        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                        deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")  # fmt: skip
_Q3_VISION_LARGE = dict(_Q3_VISION_SMALL, depth=27, hidden_size=1152, intermediate_size=4304,
                        deepstack_visual_indexes=[8, 16, 24])  # fmt: skip


# --- Qwen3.5-VL: the hybrid LM (3 Gated DeltaNet : 1 gated attention; 248,320-token vocabulary, head_dim 256 of which
# a quarter rotates, theta 1e7, interleaved mRoPE 11/11/10) and a 27-block ViT without DeepStack. Figures:
# - 9B and 35B-A3B: transformers 5.12.1's Qwen3_5Config / Qwen3_5MoeConfig defaults, documented there as the
#   Qwen/Qwen3.5-9B and Qwen/Qwen3.5-35B-A3B configurations (models/qwen3_5*/configuration_qwen3_5*.py);
# - 27B and 397B-A17B: Megatron-Bridge 0.6.2's Qwen35VLModelProvider / Qwen35VLMoEModelProvider docstrings
#   (megatron/bridge/models/qwen_vl/qwen35_vl_provider.py); the 397B's shared expert width (1,024, "1 shared" of
#   "expert dim 1024") and both models' vision tower (transformers' Qwen3_5VisionConfig defaults) are read the same way.
_Q35_ROPE = _rope(10_000_000.0, [11, 11, 10], partial_rotary_factor=0.25, mrope_interleaved=True)
_Q35_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                   hidden_act="gelu_pytorch_tanh")  # fmt: skip


def _q35_text(hidden: int, layers: int, heads: int, kv: int, linear_v_heads: int, **ffn: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=256, linear_num_key_heads=16, linear_num_value_heads=linear_v_heads, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248_320, tie_word_embeddings=False,
                rope_parameters=_Q35_ROPE, max_position_embeddings=262_144, rms_norm_eps=1e-6,
                mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, **ffn)  # fmt: skip


# --- Qwen3.6 and Qwen3.8: the same Qwen3_5*ForConditionalGeneration classes (family records' `releases`). Qwen3.6-27B
# and Qwen3.6-35B-A3B: the model cards' figures (hidden 5120 / 2048, 64 / 40 layers, 24 / 16 query and 4 / 2 KV heads,
# 48 / 32 DeltaNet value heads, FFN 17408 / 256 experts of 512 with a 512 shared one, vocabulary 248,320, one MTP
# layer) equal Qwen3.5-27B's and -35B-A3B's. Qwen3.8-27B: no config.json was at hand offline; it is taken to be
# Qwen3.6-27B's shape (same classes, a new chat template), to be checked against the released config.
_Q36_27B = _q35_text(5120, 64, 24, 4, 48, intermediate_size=17408)
_Q36_35B_A3B = _q35_text(2048, 40, 16, 2, 32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                         shared_expert_intermediate_size=512)  # fmt: skip


def _text(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, tie: bool, rope: dict, **extra: Any):
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tie, rope_parameters=rope,
                max_position_embeddings=128_000, rms_norm_eps=1e-6, **extra)  # fmt: skip


def _arch(family: str, size: str, hub: str, text: dict, vision: dict) -> Architecture:
    return Architecture(family=family, size=size, hub_id=hub, text=text, vision=vision,
                        top={"tie_word_embeddings": text["tie_word_embeddings"]})  # fmt: skip


ARCHITECTURES: dict[tuple[str, str], Architecture] = {
    (a.family, a.size): a
    for a in [
        _arch("qwen2_vl", "2b", "Qwen/Qwen2-VL-2B-Instruct",
              _text(1536, 28, 12, 2, 8960, 151936, True, _Q2_ROPE), dict(_Q2_VISION, hidden_size=1536)),
        _arch("qwen2_vl", "7b", "Qwen/Qwen2-VL-7B-Instruct",
              _text(3584, 28, 28, 4, 18944, 152064, False, _Q2_ROPE), dict(_Q2_VISION, hidden_size=3584)),
        _arch("qwen2_vl", "72b", "Qwen/Qwen2-VL-72B-Instruct",
              _text(8192, 80, 64, 8, 29568, 152064, False, _Q2_ROPE), dict(_Q2_VISION, hidden_size=8192)),
        _arch("qwen2_5_vl", "3b", "Qwen/Qwen2.5-VL-3B-Instruct",
              _text(2048, 36, 16, 2, 11008, 151936, True, _Q25_ROPE), dict(_Q25_VISION, out_hidden_size=2048)),
        _arch("qwen2_5_vl", "7b", "Qwen/Qwen2.5-VL-7B-Instruct",
              _text(3584, 28, 28, 4, 18944, 152064, False, _Q25_ROPE), dict(_Q25_VISION, out_hidden_size=3584)),
        _arch("qwen2_5_vl", "32b", "Qwen/Qwen2.5-VL-32B-Instruct",
              _text(5120, 64, 40, 8, 27648, 152064, False, _Q25_ROPE), dict(_Q25_VISION, out_hidden_size=5120)),
        _arch("qwen2_5_vl", "72b", "Qwen/Qwen2.5-VL-72B-Instruct",
              _text(8192, 80, 64, 8, 29568, 152064, False, _Q25_ROPE), dict(_Q25_VISION, out_hidden_size=8192)),
        _arch("qwen3_vl", "2b", "Qwen/Qwen3-VL-2B-Instruct",
              _text(2048, 28, 16, 8, 6144, 151936, True, _Q3_ROPE, head_dim=128),
              dict(_Q3_VISION_SMALL, out_hidden_size=2048)),
        _arch("qwen3_vl", "4b", "Qwen/Qwen3-VL-4B-Instruct",
              _text(2560, 36, 32, 8, 9728, 151936, True, _Q3_ROPE, head_dim=128),
              dict(_Q3_VISION_SMALL, out_hidden_size=2560)),
        _arch("qwen3_vl", "8b", "Qwen/Qwen3-VL-8B-Instruct",
              _text(4096, 36, 32, 8, 12288, 151936, False, _Q3_ROPE, head_dim=128),
              dict(_Q3_VISION_LARGE, out_hidden_size=4096)),
        _arch("qwen3_vl", "32b", "Qwen/Qwen3-VL-32B-Instruct",
              _text(5120, 64, 64, 8, 25600, 151936, False, _Q3_ROPE, head_dim=128),
              dict(_Q3_VISION_LARGE, out_hidden_size=5120)),
        _arch("qwen3_vl_moe", "30b-a3b", "Qwen/Qwen3-VL-30B-A3B-Instruct",
              _text(2048, 48, 32, 4, 6144, 151936, False, _Q3_ROPE, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1),
              dict(_Q3_VISION_LARGE, out_hidden_size=2048)),
        _arch("qwen3_vl_moe", "235b-a22b", "Qwen/Qwen3-VL-235B-A22B-Instruct",
              _text(4096, 94, 64, 4, 12288, 151936, False, _Q3_ROPE, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, moe_intermediate_size=1536, decoder_sparse_step=1),
              dict(_Q3_VISION_LARGE, out_hidden_size=4096)),
        _arch("qwen3_5_vl", "9b", "Qwen/Qwen3.5-9B",
              _q35_text(4096, 32, 16, 4, 32, intermediate_size=12288), dict(_Q35_VISION, out_hidden_size=4096)),
        _arch("qwen3_5_vl", "27b", "Qwen/Qwen3.5-27B",
              _q35_text(5120, 64, 24, 4, 48, intermediate_size=17408), dict(_Q35_VISION, out_hidden_size=5120)),
        _arch("qwen3_5_vl_moe", "35b-a3b", "Qwen/Qwen3.5-35B-A3B",
              _q35_text(2048, 40, 16, 2, 32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512),
              dict(_Q35_VISION, out_hidden_size=2048)),
        _arch("qwen3_5_vl", "3.6-27b", "Qwen/Qwen3.6-27B", _Q36_27B, dict(_Q35_VISION, out_hidden_size=5120)),
        _arch("qwen3_5_vl_moe", "3.6-35b-a3b", "Qwen/Qwen3.6-35B-A3B", _Q36_35B_A3B,
              dict(_Q35_VISION, out_hidden_size=2048)),
        _arch("qwen3_5_vl", "3.8-27b", "Qwen/Qwen3.8-27B", _Q36_27B, dict(_Q35_VISION, out_hidden_size=5120)),
        _arch("qwen3_5_vl_moe", "397b-a17b", "Qwen/Qwen3.5-397B-A17B",
              _q35_text(4096, 60, 32, 2, 64, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
                        shared_expert_intermediate_size=1024),
              dict(_Q35_VISION, out_hidden_size=4096)),
    ]
}  # fmt: skip


def get_architecture(family: str, size: str) -> Architecture:
    """The published architecture of `family` at `size`; the error lists the sizes that exist."""
    if (family, size) not in ARCHITECTURES:
        sizes = sorted(s for f, s in ARCHITECTURES if f == family)
        raise KeyError(f"no published {family!r} of size {size!r}; sizes: {', '.join(sizes) or 'none'} "
                       f"(families: {', '.join(FAMILIES)})")  # fmt: skip
    return ARCHITECTURES[family, size]


def hf_config(arch: Architecture, **text_overrides: Any) -> Any:
    """A transformers config object for `arch` (no download), with optional text-config overrides."""
    import transformers

    config_class = getattr(transformers, arch.config_class)
    text = {**copy.deepcopy(arch.text), **text_overrides}
    return config_class(text_config=text, vision_config=copy.deepcopy(arch.vision),
                        architectures=[arch.hf_architecture], **arch.top)  # fmt: skip


def cost_shapes(family: str, size: str) -> tuple[Any, Any]:
    """qvl.foundation.cost's (LMShape, VisionShape) of a published model, from its config in this table."""

    return shapes_from_hf_config(hf_config(get_architecture(family, size)).to_dict())


def load_hf_config(hf_path: str | Path | None, arch: Architecture) -> Any:
    """The checkpoint's own config when `hf_path` is a local directory with config.json, else the table's."""
    if hf_path is not None and (Path(hf_path) / "config.json").is_file():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(hf_path), trust_remote_code=False)
        found = (getattr(config, "architectures", None) or ["?"])[0]
        if found != arch.hf_architecture:
            raise ConfigError(f"{hf_path}/config.json is a {found}, but the recipe is for {arch.family} "
                             f"({arch.hf_architecture}); pick a {found} recipe or another hf_path")  # fmt: skip
        return config
    return hf_config(arch)
