"""GPU checks (marked `gpu`: skipped without CUDA; run with `make test PYTEST_ARGS="-m gpu"` on a GPU host).
They use the non-TE path, which must work on GPUs without Transformer Engine too."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import distributed
from tests.bridges.test_attention import naive_attention

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

    from qvl.bridges.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, bf16=True)
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
