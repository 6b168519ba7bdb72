"""Multi-token prediction in qvl's step (qvl.training.mtp): targets shifted inside each packed sample, a pack's MTP
loss equal to its samples' run one by one, the loss token-weighted beside the main loss.

At pack boundaries the packed side and the per-sample side are computed by different code: the per-sample targets by
slicing each sample's own labels (position i of a sample predicts its token i + 2, i.e. label i + 1), with every
token learned, so a shift that crosses into the next sample changes the result (it would not where the next sample's
first token is unlearned, as in chat data: then the crossing position is masked either way)."""

from __future__ import annotations

import types

import pytest
import torch

from qvl.foundation import distributed
from qvl.kernels.packed_shift import shift_in_sequences
from qvl.training import mtp
from tests.tiny_megatron import tiny_megatron_model


def test_shift_stays_inside_each_packed_sample():
    tokens = torch.tensor([[10, 11, 12, 20, 21, 30, 31, 32, 33]])
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    shifted = shift_in_sequences(tokens, cu)
    assert shifted.tolist() == [[11, 12, 0, 21, 0, 31, 32, 33, 0]]  # no position sees the next sample's token
    assert shift_in_sequences(tokens, None).tolist() == [[11, 12, 20, 21, 30, 31, 32, 33, 0]]
    positions = torch.arange(9).expand(3, 1, 9)  # mRoPE positions [3, b, s] shift the same way
    assert shift_in_sequences(positions, cu)[2].tolist() == [[1, 2, 0, 4, 0, 6, 7, 8, 0]]


def test_the_shift_is_megatron_cores_packed_roll_without_its_host_loop():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    cu = torch.tensor([0, 5, 75, 76, 100], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for tensor in (torch.randint(0, 500, (1, 100)), torch.arange(100).expand(3, 1, 100)):
        rolled, _ = roll_tensor(tensor, shifts=-1, dims=-1, packed_seq_params=packed)
        assert torch.equal(shift_in_sequences(tensor, cu), rolled)


def test_loss_adds_the_scaled_mtp_sum_and_reports_it_token_weighted():
    def main_loss(losses):  # Megatron-Bridge's masked per-token loss shape: (sum, tokens, report)
        return losses.sum(), torch.tensor(losses.numel()), {"lm loss": torch.stack([losses.sum(), torch.tensor(4.0)])}

    output = mtp.LossesWithMtp(
        main=torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
        mtp=(torch.tensor([[5.0, 6.0, 7.0, 8.0]]),),
        mtp_masks=(torch.tensor([[1.0, 1.0, 0.0, 0.0]]),),
    )
    loss, tokens, report = mtp.loss_with_mtp(main_loss, 0.1, output)
    assert float(loss) == pytest.approx(10.0 + 0.1 * 11.0) and int(tokens) == 4
    assert report[mtp.MTP_LOSS].tolist() == [11.0, 2.0]  # (sum, tokens): Megatron-Bridge divides after reducing
    assert mtp.loss_with_mtp(main_loss, 0.1, output.main)[0] == 10.0  # a plain output: the main loss alone


def per_sample_mtp_losses(mtp_logits: torch.Tensor, labels: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Per-token MTP losses [s] of a pack from each sample alone, by slicing: inside sample [a, b), position i
    predicts label i + 1 of the same sample; the last position has no target (0)."""
    losses = torch.zeros(labels.shape[0])
    for a, b in zip(cu[:-1], cu[1:]):
        losses[a : b - 1] = torch.nn.functional.cross_entropy(
            mtp_logits[a : b - 1], labels[a + 1 : b], reduction="none"
        )
    return losses


def packed_mtp_losses(states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cu: torch.Tensor):
    """qvl's step on a pack: the model's output processor on main and MTP states [2s, 1, h], every token learned."""

    def output_layer(x, weight, runtime_gather_output):
        return x @ weight.t(), None

    def token_losses(labels, logits):  # Megatron's [b, s] per-token cross-entropy of [s, b, V] logits
        return torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")

    output = mtp.losses_with_mtp(
        hidden_states=states,
        output_layer=output_layer,
        output_weight=weight,
        labels=labels[None],
        loss_mask=torch.ones(1, labels.shape[0]),
        packed_seq_params=types.SimpleNamespace(cu_seqlens_q=cu),
        runtime_gather_output=None,
        compute_language_model_loss=token_losses,
        scale_logits=lambda logits: logits,
        config=types.SimpleNamespace(mtp_num_layers=1),
    )
    return (output.mtp[0] * output.mtp_masks[0])[0], output.mtp_masks[0][0]


@pytest.fixture
def pack():
    torch.manual_seed(0)
    length, vocab, hidden = 16, 11, 8
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    return torch.randn(2 * length, 1, hidden), torch.randn(vocab, hidden), torch.randint(0, vocab, (length,)), cu


def test_packed_mtp_targets_are_each_samples_own_tokens(pack):
    states, weight, labels, cu = pack
    losses, mask = packed_mtp_losses(states, weight, labels, cu)
    alone = per_sample_mtp_losses(states[len(labels) :, 0] @ weight.t(), labels, cu.tolist())
    torch.testing.assert_close(losses, alone, rtol=1e-6, atol=1e-6)
    expected = [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0]  # each sample's last position learns nothing
    assert mask.tolist() == expected


def test_an_mtp_shift_that_crosses_samples_fails_the_per_sample_check(pack, monkeypatch):
    states, weight, labels, cu = pack
    monkeypatch.setattr(mtp, "shift_in_sequences", lambda tensor, cu_seqlens: shift_in_sequences(tensor, None))
    losses, _ = packed_mtp_losses(states, weight, labels, cu)
    alone = per_sample_mtp_losses(states[len(labels) :, 0] @ weight.t(), labels, cu.tolist())
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(losses, alone, rtol=1e-6, atol=1e-6)


def test_no_mtp_layers_change_nothing():
    config = types.SimpleNamespace(mtp_num_layers=None)
    assert mtp.model_arguments(config) == {} and mtp.loss_function(print, config) is print


@pytest.mark.parametrize("family", ["qwen3_5_vl", pytest.param("qwen3_5_vl_moe", marks=pytest.mark.slow)])
def test_a_packs_mtp_losses_are_its_samples_run_alone_and_sliced(family, tmp_path, cpu_runtime):
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.load import build_packed_datasets
    from qvl.data.samples import write_sample_dataset
    from qvl.launchers.cli import main
    from qvl.training.step import model_inputs

    jsonl, media = write_sample_dataset(tmp_path / "samples", count=12, with_bad=False)
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", family)
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", family, "--hf-path", str(hf)]
    assert main(["data", "prepare", *prepare, "--seq-length", "512", "--output", str(tmp_path / "data")]) == 0
    distributed.init_distributed()
    try:
        model, _ = tiny_megatron_model(family, hf=hf, speed=False)
        provider = model.config  # the provider is the model's TransformerConfig
        model.eval()
        assert model.config.mtp_num_layers == 1
        config = types.SimpleNamespace(
            path=str(tmp_path / "data"), hf_path=str(hf), family=family, micro_batch_size=1, num_workers=0
        )
        batch = next(iter(build_packed_datasets(config, None)[0]))
        kwargs, loss_mask = model_inputs(batch, torch.device("cpu"))
        cu = batch.cu_seqlens_q.tolist()
        assert len(cu) > 2, "the test needs a pack of several samples"
        labels, images = kwargs["labels"], batch.image_grid_thw
        rows = torch.cat([torch.zeros(1, dtype=torch.long), images.prod(-1).cumsum(0)]).tolist()
        per_image = (images.prod(-1) // 4).tolist()
        with torch.no_grad(), mtp.states_kept(provider):
            # every token learned, so that a target taken across a sample boundary would count (chat data leaves a
            # sample's first token unlearned, which would mask it)
            packed = model(**{**kwargs, "loss_mask": torch.ones_like(loss_mask)}, **mtp.model_arguments(provider))
            alone_losses, first = [], 0
            for a, b in zip(cu[:-1], cu[1:]):
                pads, last = int((batch.tokens[0, a:b] == provider.image_token_id).sum()), first
                while pads > 0:
                    pads, last = pads - per_image[last], last + 1
                logits = model(  # no labels: the main and MTP logits [1, 2 (b - a), V], and the loss by slicing
                    input_ids=batch.tokens[:, a:b],
                    attention_mask=None,
                    position_ids=None,
                    pixel_values=batch.pixel_values[rows[first] : rows[last]] if last > first else None,
                    image_grid_thw=images[first:last] if last > first else None,
                )
                alone_losses.append(per_sample_mtp_losses(logits[0, b - a :].float(), labels[0, a:b], [0, b - a]))
                first = last
        pack_losses = (packed.mtp[0] * packed.mtp_masks[0])[0]
        assert packed.mtp_masks[0].sum() == len(labels[0]) - (len(cu) - 1)  # all but each sample's last position
        torch.testing.assert_close(pack_losses, torch.cat(alone_losses), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pack_losses.sum(), sum(loss.sum() for loss in alone_losses), rtol=1e-6, atol=0)
    finally:
        distributed.destroy_distributed()
