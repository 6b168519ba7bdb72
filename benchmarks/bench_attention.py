"""Packed (THD) attention on a GPU: torch's varlen kernel (one call per pack) against one SDPA call per sub-sequence.

An 8k-token pack of 40 sub-sequences, forward + backward in bf16, at two shapes: Qwen2.5-VL-3B's language-model
attention (16 query heads, 2 KV heads, dim 128, causal) and its vision tower's windowed blocks (16 heads, dim 80,
bidirectional, 64-patch windows: 128 blocks per 8k patches). The goal: varlen >= 3x the loop on the LM pack.
Needs CUDA; on CPU it reports why it did not run.
"""

from __future__ import annotations

import json
import pathlib
import time

import torch

GOAL_SPEEDUP = 3.0
SHAPES = {
    "lm_8k_40_subsequences": dict(heads=16, kv_heads=2, dim=128, causal=True, lengths=None),
    "vit_8k_windows_of_64": dict(heads=16, kv_heads=16, dim=80, causal=False, lengths=[64] * 128),
}


def pack_lengths(total: int = 8192, count: int = 40, seed: int = 0) -> list[int]:
    """`count` sub-sequence lengths summing to `total`, uneven like a real pack (a few long, many short)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=gen) ** 3 + 0.02
    lengths = (weights / weights.sum() * total).long().clamp(min=1)
    lengths[0] += total - int(lengths.sum())
    return lengths.tolist()


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def measure(name: str, shape: dict, repeats: int) -> dict:
    """Seconds per forward+backward of each path, and the speed-up."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from qvl.kernels.varlen_attention import SDPAttention

    heads, kv, dim = shape["heads"], shape["kv_heads"], shape["dim"]
    lengths = shape["lengths"] or pack_lengths()
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=kv, bf16=True
    )
    mask = AttnMaskType.causal if shape["causal"] else AttnMaskType.no_mask
    attention = SDPAttention(config, layer_number=1, attn_mask_type=mask, attention_type="self").cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    total = int(cu[-1])
    q, k, v = (
        torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (heads, kv, kv)
    )
    result = {"sub_sequences": len(lengths), "tokens": total}
    for path, run in {"varlen": attention._packed, "loop": attention._packed_loop}.items():
        step = lambda run=run: run(q, k, v, params, shape["causal"], 0.0).sum().backward()
        result[f"{path}_ms"] = round(_time(step, repeats) * 1e3, 3)
    result["speedup"] = round(result["loop_ms"] / result["varlen_ms"], 2)
    return result


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """benchmarks.run entry: both shapes on CUDA; on CPU, a result saying it needs a GPU."""
    if not torch.cuda.is_available():
        results = {"why": "needs a CUDA GPU (torch's varlen kernel runs on CUDA only)", "shapes": {}, "checks": []}
    else:
        from qvl.foundation import distributed

        distributed.init_distributed()
        try:
            shapes = {name: measure(name, shape, 5 if quick else 20) for name, shape in SHAPES.items()}
        finally:
            distributed.destroy_distributed()
        lm = shapes["lm_8k_40_subsequences"]["speedup"]
        results = {
            "device": torch.cuda.get_device_name(),
            "shapes": shapes,
            "checks": [
                {"figure": "LM 8k pack of 40: loop / varlen time", "value": lm, "goal": f">= {GOAL_SPEEDUP}",
                 "met": lm >= GOAL_SPEEDUP},
            ],
        }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_attention.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    print(json.dumps(run(pathlib.Path(".bench")), indent=2))
