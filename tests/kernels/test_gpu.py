"""GPU checks (marked `gpu`: skipped without CUDA; run with `make test PYTEST_ARGS="-m gpu"` on a GPU host).
They use the non-TE path, which must work on GPUs without Transformer Engine too."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_attention import pack_lengths
from qvl.foundation import distributed
from tests.kernels.test_varlen_attention import naive_attention
from tests.numerics import assert_as_close_as_eager, relative_error

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_distributed():

    distributed.init_distributed()  # nccl, one rank; the CPU runtime stays off on a CUDA host
    yield
    distributed.destroy_distributed()


def test_packed_sdpa_attention_on_cuda_bf16(cuda_distributed):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from qvl.kernels.varlen_attention import SDPAttention

    # attention_dropout=0: the module is in training mode, and Megatron's default of 0.1 would drop out (and take
    # the per-segment path: the varlen kernel has no dropout), which no dropout-free reference can match.
    config = TransformerConfig(
        num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, bf16=True, attention_dropout=0.0
    )
    attention = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").cuda()
    lengths = [300, 17, 1024, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(int(cu[-1]), h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = attention(q, k, v, attention_mask=None, packed_seq_params=params).float()
    expected = torch.cat(
        [
            naive_attention(q[a:b].float(), k[a:b].float(), v[a:b].float(), True)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
    )
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # bf16 inputs


def test_tiny_gpt_trains_on_cuda(cuda_distributed):
    from tests import megatron_smoke as smoke

    shape = smoke.TinyGPT()
    model = smoke.wrap_ddp(smoke.build_model(shape))
    assert next(model.parameters()).is_cuda
    batches = smoke.synthetic_batches(shape, micro_batch_size=2, count=40)
    losses, _ = smoke.train([model], batches, shape=shape, steps=20, micro_batch_size=2, num_microbatches=2)
    assert losses[-1] < losses[0] - 0.5


# bf16 attention's norm-wise error from fp64: about 2e-3 for the output; grouped-query heads' key and value gradients
# are sums over each group of bf16 gradients (the bf16 loop on the CPU: 9e-3 at 8 query heads per KV head)
ATTENTION_BF16_BOUND = 2e-2


def varlen_and_loop_against_fp64(attention, inputs, weight, params, causal) -> dict[str, tuple[float, float]]:
    """torch's varlen kernel (one call for the pack) and one SDPA call per sub-sequence, both bf16, forward and
    backward, each against the same loop in fp64 (SDPA's math path: no fused kernel takes fp64), so that the check
    holds whichever kernels torch picks for either (torch 2.14 sends long bidirectional calls to cuDNN on SM90 and
    SM100, as SDPA may the loop's). The varlen path must be within bf16 rounding of the exact result
    (ATTENTION_BF16_BOUND) and not twice as far from it as the loop. Returns each tensor's relative error from fp64
    by path, for the record."""
    results = {}
    for name, run, dtype in (("varlen", attention._packed, torch.bfloat16), ("loop", attention._packed_loop, None),
                             ("fp64", attention._packed_loop, torch.float64)):  # fmt: skip
        q, k, v = (t.to(dtype or t.dtype).clone().requires_grad_() for t in inputs)
        out = run(q, k, v, params, causal, 0.0)
        (out.double() * weight.double()).sum().backward()
        results[name] = (out.detach(), q.grad, k.grad, v.grad)
    errors = {}
    for i, what in enumerate(("output", "query gradient", "key gradient", "value gradient")):
        varlen, loop, exact = (results[name][i] for name in ("varlen", "loop", "fp64"))
        assert_as_close_as_eager(varlen, loop, exact, what=f"varlen attention's {what}", slack=2.0,
                                 bound=ATTENTION_BF16_BOUND)  # fmt: skip
        errors[what] = (round(relative_error(varlen, exact), 5), round(relative_error(loop, exact), 5))
    return errors


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_varlen_is_as_exact_as_the_per_segment_loop_in_bf16_forward_and_backward(
    cuda_distributed, causal, record_property
):
    """The varlen kernel and the per-sub-sequence loop against fp64 (`varlen_and_loop_against_fp64`): an 8k pack of
    40 sub-sequences at Qwen2.5-VL-3B's LM attention shape (16 query heads, 2 KV heads, dim 128), bf16."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from qvl.kernels.varlen_attention import SDPAttention, varlen_usable

    config = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=16, num_query_groups=2, bf16=True)
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    attention = SDPAttention(config, layer_number=1, attn_mask_type=mask, attention_type="self").cuda()
    cu = torch.tensor([0, *torch.tensor(pack_lengths()).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(8192, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (16, 2, 2)]
    weight = torch.randn(8192, 16 * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert varlen_usable(inputs[0])
    errors = varlen_and_loop_against_fp64(attention, inputs, weight, params, causal)
    record_property(f"relative error from fp64, varlen / loop (torch {torch.__version__})", errors)


VISION_SHAPES = {  # the step census's vision attention calls: 16 heads; 5 images of 44 x 44 patches, or 64-patch windows
    "whole_images_head_80": (80, [1936] * 5),  # Qwen2-VL's blocks, Qwen2.5-VL's full-attention ones
    "whole_images_head_72": (72, [1936] * 5),  # Qwen3-VL's and Qwen3.5-VL's towers
    "windows_of_64_head_80": (80, [64] * 151),  # Qwen2.5-VL's windowed blocks
}


@pytest.mark.parametrize("shape", list(VISION_SHAPES))
def test_vision_attention_shapes_are_as_exact_as_the_loop_and_record_their_flop_rate(
    cuda_distributed, shape, record_property
):
    """The vision towers' attention at the census's shapes: torch's varlen kernel and one SDPA call per image or
    window against fp64 (`varlen_and_loop_against_fp64`; forward and backward, bf16), and the varlen kernel's rate.
    The step model fits one attention rate to a run's mix of windows and whole images, and the windows' rate over
    whole images' from these records (`step_calibration.short_attention_speed`, ATTENTION_RATE_LABEL). Each is
    recorded as TFLOP/s at the model's head dim and at the one FlashAttention-2's kernel runs
    (benchmarks.step_kernels.flash_head_dim), forward + backward counted as 3.5 forwards, as the census counts them."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from benchmarks.step_calibration import ATTENTION_RATE_LABEL
    from benchmarks.step_kernels import flash_head_dim
    from qvl.kernels.varlen_attention import SDPAttention

    dim, lengths = VISION_SHAPES[shape]
    heads, tokens = 16, sum(lengths)
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, bf16=True,
                               attention_dropout=0.0)  # fmt: skip
    attention = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.no_mask, attention_type="self").cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    weight = torch.randn(tokens, heads * dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(path):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = path(q, k, v, params, False, 0.0)
        (out.float() * weight).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    errors = varlen_and_loop_against_fp64(attention, inputs, weight, params, False)
    record_property(f"{shape}: relative error from fp64, varlen / loop", errors)
    for _ in range(2):  # warm-up
        run(attention._packed)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run(attention._packed)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 5 / 1e3
    flops = 3.5 * 4.0 * sum(n * n for n in lengths) * heads  # per head-dim column
    label = ATTENTION_RATE_LABEL.format(shape=shape, dim=dim, kernel_dim=flash_head_dim(dim))
    record_property(f"{label} (torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()})",
                    (round(seconds * 1e3, 3), round(flops * dim / seconds / 1e12, 1),
                     round(flops * flash_head_dim(dim) / seconds / 1e12, 1)))  # fmt: skip


def test_hf_vision_tower_varlen_equals_sdpa_on_cuda_bf16():
    """Qwen2.5-VL's HF vision tower (windowed and full-attention blocks) with qvl's varlen attention against
    transformers' SDPA loop over windows and images: outputs and parameter gradients, bf16."""
    import copy

    from transformers import AutoModel

    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.kernels.varlen_attention import varlen_vision_towers

    config = tiny_hf_config("qwen2_5_vl")
    torch.manual_seed(0)
    reference = AutoModel.from_config(config).visual.to("cuda", torch.bfloat16)
    tower = copy.deepcopy(reference)
    varlen_vision_towers([tower])
    grid = torch.tensor([[1, 16, 24], [1, 8, 8], [2, 12, 12]], device="cuda")
    vision = config.vision_config
    pixels = torch.randn(
        int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size**2, device="cuda"
    ).bfloat16()
    outputs = []
    for model in (tower, reference):
        out = model(pixels, grid_thw=grid)
        out = getattr(out, "pooler_output", out)
        out.float().square().mean().backward()
        outputs.append((out.detach(), [p.grad for p in model.parameters()]))
    (out, grads), (out_ref, grads_ref) = outputs
    assert relative_error(out, out_ref) < 1e-2
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        assert relative_error(grad, grad_ref) < 3e-2
