"""The shapes of the step census: the configs it counts, their tiny-width HF models, and synthetic LLaVA-like packs.

Tiny widths keep the run cheap on CPU; each maps back to one real width (benchmarks.op_costs.WidthMap), so GEMM
FLOPs, row pitches and elementwise bytes are those of the real model. Packs have the real lengths and image sizes.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class StepConfig:
    """One census: a published architecture at `layers` LM layers, `packs` packs of `seq_length` per step."""

    name: str
    family: str
    size: str
    recipe: str
    layers: int | None = None  # None: the published depth
    vision_depth: int | None = None  # None: the published depth (tests shrink it)
    packs: int = 8
    seq_length: int = 4096
    samples_per_pack: int = 5
    image_grid: tuple[int, int, int] = (1, 44, 44)  # 1,936 patches: LLaVA-like images at Qwen's pixel budget
    text_tokens: int = 296  # per sample, besides its image's tokens (780 in all at a 44 x 44 grid)
    vision_recompute: bool = True
    # A MoE model: its experts on one GPU, the published count split by the layout's expert parallelism (each GPU
    # routes its tokens to all of them and gets as many token-expert rows back as it sends, so its expert work is
    # that of one rank with `local_experts` experts at the published top-k); None: the published count. The router's
    # logits are `local_experts` wide (a few bytes per token). `grouped_experts`: the recipe option of that name.
    local_experts: int | None = None
    grouped_experts: bool = False


CONFIGS = {
    c.name: c
    for c in (
        # the RESULTS.md configuration as `bench_train` runs it at 4k on an H100 or H200: no vision recompute, as its
        # plan there chooses (benchmarks/train_plan.py: vision_recompute_from_plan); with it, as the H100 measured it
        # before the speed groups (the step model's calibration, `results/census-before.json`)
        StepConfig(name="qwen2_5_vl_3b_12l", family="qwen2_5_vl", size="3b", recipe="qwen2_5_vl_3b_pretrain", layers=12,
                   vision_recompute=False),
        StepConfig(name="qwen2_5_vl_3b_12l_recompute", family="qwen2_5_vl", size="3b", recipe="qwen2_5_vl_3b_pretrain",
                   layers=12),
        StepConfig(name="qwen2_5_vl_3b", family="qwen2_5_vl", size="3b", recipe="qwen2_5_vl_3b_pretrain"),
        StepConfig(name="qwen2_vl_2b", family="qwen2_vl", size="2b", recipe="qwen2_vl_2b_pretrain"),
        StepConfig(name="qwen3_vl_4b", family="qwen3_vl", size="4b", recipe="qwen3_vl_4b_pretrain",
                   vision_recompute=False),
        # Qwen3-VL-30B-A3B, one GPU of expert parallelism 8 (16 of the 128 experts): its experts one after another
        # (Megatron-Core's SequentialMLP, the default without TE), and as two grouped GEMMs (`grouped_experts`)
        StepConfig(name="qwen3_vl_30b_a3b_ep8", family="qwen3_vl_moe", size="30b-a3b",
                   recipe="qwen3_vl_30b_a3b_pretrain", vision_recompute=False, local_experts=16),
        StepConfig(name="qwen3_vl_30b_a3b_ep8_grouped", family="qwen3_vl_moe", size="30b-a3b",
                   recipe="qwen3_vl_30b_a3b_pretrain", vision_recompute=False, local_experts=16,
                   grouped_experts=True),
        # tests: the RESULTS.md configuration with one pack per step (counts per pack); its structure (12 LM layers,
        # the whole ViT, 5 samples with an image each) in one short pack of small images, whose GEMM counts per pack
        # are the same (the counts follow layers, blocks and samples, not lengths); and that structure at 2 LM layers,
        # 4 ViT blocks, 2 short packs
        StepConfig(name="results_one_pack", family="qwen2_5_vl", size="3b", recipe="qwen2_5_vl_3b_pretrain",
                   layers=12, packs=1),
        StepConfig(name="results_structure", family="qwen2_5_vl", size="3b", recipe="qwen2_5_vl_3b_pretrain",
                   layers=12, packs=1, seq_length=1024, image_grid=(1, 16, 16), text_tokens=120),
        StepConfig(name="tiny", family="qwen2_5_vl", size="3b", recipe="qwen2_5_vl_3b_pretrain", layers=2,
                   vision_depth=4, packs=2, seq_length=512, samples_per_pack=2, image_grid=(1, 6, 10),
                   text_tokens=60),
        # Qwen3.5-VL-9B at 8 LM layers (two of its periods: 3 Gated DeltaNet layers, then gated attention) on one GPU
        StepConfig(name="qwen3_5_vl_9b_8l", family="qwen3_5_vl", size="9b", recipe="qwen3_5_vl_9b_pretrain", layers=8,
                   vision_recompute=False),
        # tests: that hybrid at one period, 4 ViT blocks, 2 short packs
        StepConfig(name="tiny_hybrid", family="qwen3_5_vl", size="9b", recipe="qwen3_5_vl_9b_pretrain", layers=4,
                   vision_depth=4, packs=2, seq_length=512, samples_per_pack=2, image_grid=(1, 6, 10),
                   text_tokens=60, vision_recompute=False),
        # tests: Qwen3.5-VL-MoE (35B-A3B) at one period, 16 local experts grouped on one rank
        StepConfig(name="tiny_hybrid_moe", family="qwen3_5_vl_moe", size="35b-a3b",
                   recipe="qwen3_5_vl_35b_a3b_pretrain", layers=4, vision_depth=4, packs=2, seq_length=512,
                   samples_per_pack=2, image_grid=(1, 6, 10), text_tokens=60, vision_recompute=False,
                   local_experts=16, grouped_experts=True),
        # tests: the Qwen3-VL-MoE census at that size (16 local experts), one after another and grouped
        StepConfig(name="tiny_moe", family="qwen3_vl_moe", size="30b-a3b", recipe="qwen3_vl_30b_a3b_pretrain",
                   layers=2, vision_depth=4, packs=2, seq_length=512, samples_per_pack=2, image_grid=(1, 6, 10),
                   text_tokens=60, vision_recompute=False, local_experts=16),
        StepConfig(name="tiny_moe_grouped", family="qwen3_vl_moe", size="30b-a3b", recipe="qwen3_vl_30b_a3b_pretrain",
                   layers=2, vision_depth=4, packs=2, seq_length=512, samples_per_pack=2, image_grid=(1, 6, 10),
                   text_tokens=60, vision_recompute=False, local_experts=16, grouped_experts=True),
    )
}  # fmt: skip
RESULTS_CONFIG = "qwen2_5_vl_3b_12l"
MEASURED_CONFIG = "qwen2_5_vl_3b_12l_recompute"  # the configuration of the H100 runs and profile in RESULTS.md
DEFAULT_CONFIGS = ("qwen2_5_vl_3b_12l", "qwen2_5_vl_3b", "qwen2_vl_2b", "qwen3_vl_4b", "qwen3_5_vl_9b_8l")

# Tiny widths: every one maps to one real width and none equals a dimension the model keeps (heads, KV heads, patch
# sizes, merge units) or a product of them a tensor has (Megatron's fused qkv is 3 x the head dim per head: with a
# head dim of 12 it was 36, the vision FFN's tiny width, and the census read the qkv split's backward `cat` as 21x
# its size), so shapes map back unambiguously. Head dims stay even (rotary; Qwen3-VL's vision halves stay even too),
# mRoPE sections sum to half.
TINY_LM_HEAD_DIM = 10
# Qwen3.5's attention rotates a quarter of its head (partial_rotary_factor 0.25): a head of 40 rotates 10, mRoPE
# sections [2, 2, 1]
TINY_PARTIAL_ROTARY_HEAD_DIM = 40
TINY_DELTANET_HEAD_DIM = 20  # Gated DeltaNet's key and value heads (128 each in every Qwen3.5)
TINY_VOCAB = 608
TINY_FFN = 44
TINY_VISION_HEAD_DIM = {
    "qwen2_vl": 8,
    "qwen2_5_vl": 8,
    "qwen3_vl": 28,
    "qwen3_vl_moe": 28,
    "qwen3_5_vl": 28,
    "qwen3_5_vl_moe": 28,
}
TINY_VISION_FFN = 36
TINY_QWEN3_HIDDEN = 144
TINY_EXPERT_FFN = 56  # rows of 112 bytes in bf16: 16-byte aligned, as grouped_mm needs


def gated_deltanet(config: StepConfig) -> bool:
    """Whether `config`'s language model is Qwen3.5's hybrid: Gated DeltaNet layers, and attention that gates its
    output."""
    from qvl.recipes.architectures import get_architecture

    return "linear_key_head_dim" in get_architecture(config.family, config.size).text


def graphs_estimated(config: StepConfig) -> bool:
    """Whether the census estimates `config`'s graphed host launches: dense layers graphed whole, or MoE layers whose
    whole MoE block is a graph (grouped experts on one rank: qvl.kernels.moe_block_graphs). A MoE layer with
    sequential experts replays its attention, router and combine and runs its experts between them, and a Gated
    DeltaNet layer replays its MLP alone: `--recorded-graphs` counts those steps instead."""
    from qvl.foundation.families import get_family

    return (not get_family(config.family).moe or config.grouped_experts) and not gated_deltanet(config)


def scaled_hf_config(config: StepConfig):
    """(HF config with tiny widths and the real depths, WidthMap tiny -> real) for `config`."""
    import transformers

    from benchmarks.op_costs import WidthMap
    from qvl.foundation.families import TINY_TOKEN_IDS, get_family
    from qvl.kernels.speed_aligned_widths import aligned
    from qvl.recipes.architectures import get_architecture

    arch = get_architecture(config.family, config.size)
    text, vision = dict(arch.text), dict(arch.vision)
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    real_head_dim = text.get("head_dim", text["hidden_size"] // heads)
    partial = text["rope_parameters"].get("partial_rotary_factor", 1.0) < 1
    hd = TINY_PARTIAL_ROTARY_HEAD_DIM if partial else TINY_LM_HEAD_DIM
    hidden = TINY_QWEN3_HIDDEN if "head_dim" in text else heads * hd
    rope = dict(text["rope_parameters"], mrope_section=[2, 2, 1] if partial else [1, 2, 2])  # sums to the rotated / 2
    # the attention's widths in heads: query, key and value, all three, one head, Megatron's qkv per KV group; with
    # Qwen3.5's gated attention also a gate as wide as the query, in the qkv projection
    hybrid = gated_deltanet(config)
    in_heads = [heads, kv, heads + 2 * kv, 1, heads // kv + 2]
    if hybrid:
        in_heads += [2 * heads, 2 * heads + 2 * kv, 2 * heads // kv + 2]
    dims = _Widths([(hidden, text["hidden_size"]), (TINY_VOCAB, text["vocab_size"])]
                   + [(n * hd, n * real_head_dim) for n in in_heads])  # fmt: skip
    if "intermediate_size" in text:  # a dense MLP (Qwen3.5-MoE's layers have none)
        dims |= {TINY_FFN: text["intermediate_size"], 2 * TINY_FFN: 2 * text["intermediate_size"]}
        text["intermediate_size"] = TINY_FFN
    if hybrid:
        dims |= _deltanet_widths(text)
        text.update(linear_key_head_dim=TINY_DELTANET_HEAD_DIM, linear_value_head_dim=TINY_DELTANET_HEAD_DIM)
    text.update(hidden_size=hidden, vocab_size=TINY_VOCAB, rope_parameters=rope)
    if "moe_intermediate_size" in text:
        dims |= {TINY_EXPERT_FFN: text["moe_intermediate_size"], 2 * TINY_EXPERT_FFN: 2 * text["moe_intermediate_size"]}
        if "shared_expert_intermediate_size" in text:  # Qwen3.5-MoE's shared expert: a routed one's width
            if text["shared_expert_intermediate_size"] != text["moe_intermediate_size"]:
                raise ValueError(f"{config.name}: a shared expert of another width than the routed ones needs a "
                                 "tiny width of its own in benchmarks/step_shapes.py")  # fmt: skip
            text["shared_expert_intermediate_size"] = TINY_EXPERT_FFN
        text["moe_intermediate_size"] = TINY_EXPERT_FFN
        text["num_experts"] = config.local_experts or text["num_experts"]
    if "head_dim" in text:
        text["head_dim"] = hd
    if config.layers:
        text["num_hidden_layers"] = config.layers
    vhd = TINY_VISION_HEAD_DIM[config.family]
    width_key = "embed_dim" if "embed_dim" in vision else "hidden_size"
    real_width, vheads = vision[width_key], vision["num_heads"]
    vwidth = vheads * vhd
    dims |= {vwidth: real_width, 3 * vwidth: 3 * real_width, vhd: real_width // vheads, 4 * vwidth: 4 * real_width}
    if get_family(config.family).megatron_vision_tower:  # Megatron's qkv per head: [tokens, 1, heads, 3 x head dim]
        dims[3 * vhd] = 3 * (real_width // vheads)
    vision[width_key] = vwidth
    if "intermediate_size" in vision:
        dims[TINY_VISION_FFN] = vision["intermediate_size"]
        if not get_family(
            config.family
        ).megatron_vision_tower:  # qvl.kernels.speed_aligned_widths pads the HF tower's width
            dims.setdefault(aligned(TINY_VISION_FFN), aligned(vision["intermediate_size"]))
        vision["intermediate_size"] = TINY_VISION_FFN
    if width_key == "embed_dim":  # Qwen2-VL: hidden_size is the merger's output, the LM width
        vision["hidden_size"] = hidden
    else:
        vision["out_hidden_size"] = hidden
    if config.vision_depth:
        vision["depth"] = config.vision_depth
        if "fullatt_block_indexes" in vision:
            vision["fullatt_block_indexes"] = [config.vision_depth // 2 - 1, config.vision_depth - 1]
        if "deepstack_visual_indexes" in vision:
            vision["deepstack_visual_indexes"] = [0, config.vision_depth // 2]
    config_class = getattr(transformers, arch.config_class)
    hf = config_class(text_config=text, vision_config=vision, architectures=[arch.hf_architecture], **arch.top)
    for name, value in TINY_TOKEN_IDS.items():
        setattr(hf, name, value)
    return hf, WidthMap(dims=dict(dims))


class _Widths(dict):
    """Tiny width -> real width, refusing a tiny width that would stand for two real ones (the census could not map
    it back)."""

    def __init__(self, pairs: list[tuple[int, int]]):
        super().__init__()
        self |= pairs

    def __setitem__(self, tiny: int, real: int) -> None:
        if self.get(tiny, real) != real:
            raise ValueError(f"tiny width {tiny} stands for both {self[tiny]} and {real}: choose other tiny widths")
        super().__setitem__(tiny, real)

    def __ior__(self, pairs):
        for tiny, real in pairs.items() if isinstance(pairs, dict) else pairs:
            self[tiny] = real
        return self

    def setdefault(self, tiny: int, real: int) -> int:
        if tiny not in self:
            self[tiny] = real
        return self[tiny]


def _deltanet_widths(text: dict) -> list[tuple[int, int]]:
    """(tiny, real) widths of Megatron-Core's Gated DeltaNet at TINY_DELTANET_HEAD_DIM (its heads keep their counts):
    a head, the query (and key) and value widths, both together, the convolved qkv, and the input projection (qkv,
    output gate z, beta, alpha)."""
    key_heads, value_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    tiny = TINY_DELTANET_HEAD_DIM
    real_qk, real_v = key_heads * text["linear_key_head_dim"], value_heads * text["linear_value_head_dim"]
    qk, v = key_heads * tiny, value_heads * tiny
    return [(tiny, text["linear_key_head_dim"]), (tiny, text["linear_value_head_dim"]), (qk, real_qk), (v, real_v),
            (2 * qk, 2 * real_qk), (2 * qk + v, 2 * real_qk + real_v),
            (2 * qk + 2 * v + 2 * value_heads, 2 * real_qk + 2 * real_v + 2 * value_heads)]  # fmt: skip


def write_model_dir(path: pathlib.Path, config: StepConfig) -> tuple[pathlib.Path, dict[int, int]]:
    """An HF directory (config, tiny tokenizer, processor) of the scaled model; returns it and the width map."""
    from qvl.foundation.tiny_processor import write_tiny_hf_processor_dir

    hf, widths = scaled_hf_config(config)
    hf.save_pretrained(path)
    write_tiny_hf_processor_dir(path, config.family)
    return path, widths.dims


# --- synthetic packs ----------------------------------------------------------------------------------------------


def synthetic_batches(config: StepConfig, hf_config, *, seed: int = 0, tower_inputs: bool = True):
    """Endless LLaVA-like packed micro-batches (qvl.data.encode.PackedBatch) of `config`'s composition: each sample
    text, one image, text; positions from qvl.data.mrope and (`tower_inputs`, HF towers) the tower's inputs from
    qvl.kernels.tower_inputs, as the loader computes them."""
    from qvl.data.count import IGNORE_INDEX
    from qvl.data.encode import PackedBatch
    from qvl.data.mrope import RopeConfig, packed_position_ids
    from qvl.kernels.tower_inputs import tower_inputs_for_config

    rng = np.random.default_rng(seed)
    vision = hf_config.vision_config
    merge = vision.spatial_merge_size
    patch_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    rope = RopeConfig(family=config.family, spatial_merge_size=merge, image_pad_id=hf_config.image_token_id,
                      video_pad_id=hf_config.video_token_id, tokens_per_second=getattr(vision, "tokens_per_second", 2))  # fmt: skip
    grid = config.image_grid
    image_tokens = math.prod(grid) // merge**2
    first = TINY_VOCAB // 8  # ordinary text ids: past the tiny tokenizer's special tokens
    while True:
        subs, media = [], []
        for _ in range(config.samples_per_pack):
            head = rng.integers(first, TINY_VOCAB, config.text_tokens // 3)
            tail = rng.integers(first, TINY_VOCAB, config.text_tokens - len(head) - 2)
            ids = np.r_[head, hf_config.vision_start_token_id, np.full(image_tokens, hf_config.image_token_id),
                        hf_config.vision_end_token_id, tail]  # fmt: skip
            subs.append(ids.astype(np.int64))
            media.append({"image_grid_thw": [list(grid)], "video_grid_thw": []})
        ids = np.concatenate(subs)
        lengths = [len(s) for s in subs]
        labels = np.r_[ids[1:], IGNORE_INDEX]
        learned = np.zeros(len(ids), dtype=bool)
        for end in np.cumsum(lengths):
            learned[end - len(tail) : end - 1] = True  # the answer: the sample's closing text
        labels[~learned] = IGNORE_INDEX
        patches = config.samples_per_pack * math.prod(grid)
        grids = torch.tensor([list(grid)] * config.samples_per_pack, dtype=torch.long)
        yield PackedBatch(
            __key__=["synthetic"],
            __restore_key__=("synthetic",),
            tokens=torch.from_numpy(ids)[None],
            labels=torch.from_numpy(labels)[None],
            loss_mask=torch.from_numpy(learned.astype(np.float32))[None],
            position_ids=torch.from_numpy(np.ascontiguousarray(packed_position_ids(subs, media, rope)))[:, None],
            cu_seqlens_q=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
            max_seqlen=max(lengths),
            pixel_values=torch.randn(patches, patch_width),
            image_grid_thw=grids,
            # every family's tower takes the loader's inputs (HF towers: qvl.kernels.speed_hf_vision; Megatron-Bridge's
            # Qwen3-VL tower: qvl.kernels.speed_qwen3_vl_tower), as qvl.data.encode computes them
            image_tower_inputs=tower_inputs_for_config(grids, vision) if tower_inputs else None,
            pixel_values_videos=None,
            video_grid_thw=torch.zeros(0, 3, dtype=torch.long),
            second_per_grid_ts=torch.zeros(0),
            source_indices=[[]],
        )
