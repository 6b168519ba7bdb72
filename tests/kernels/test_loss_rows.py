"""The output layer and the loss at a pack's loss-bearing positions only (qvl.kernels.loss_rows; the training
setting `qvl.loss_rows_only`): qvl's forward step gives the whole-pack path's masked loss and gradients with the output
layer run on those rows only, for Qwen2.5-VL (qvl's loader forward) and Qwen3-VL (Megatron-Bridge's forward, the hook
passed on); Qwen3.5-VL's MTP depth at its own rows; a pack without a loss-bearing position trains nothing and still
runs backward; in bf16 the rows' losses and gradients are as close to float64 as the whole pack's (CPU, and CUDA with
the compiled cross-entropy); under sequence parallelism (two gloo ranks, TP=2) the losses and gradients are those of
the whole-pack path."""

from __future__ import annotations

import types

import pytest
import torch

from qvl.data.count import IGNORE_INDEX
from qvl.foundation import distributed, patches
from qvl.foundation.distributed import start_ranks
from qvl.kernels.loss_rows import LossRows, host_loss_rows, loss_rows_output, losses_at_rows
from tests.numerics import assert_as_close_as_eager, assert_equal_up_to_summation_order
from tests.tiny_megatron import tiny_megatron_model

TEXT = 20  # the first ordinary token id of the tiny vocabulary (tests/kernels/test_speed_sync_free.py)


def test_host_rows_are_where_the_mask_is_set_and_the_label_is_not_ignored():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]], dtype=torch.float32)
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7, 8, 9]])
    (rows,) = host_loss_rows(mask, labels, ignore_index=IGNORE_INDEX)
    assert rows.tolist() == [1, 4, 5]
    # an MTP depth: the mask moved one position left inside each sample ([0, 3) and [3, 6)), each sample's last cut
    main, depth = host_loss_rows(
        mask, labels, ignore_index=IGNORE_INDEX, cu_seqlens=torch.tensor([0, 3, 6]), mtp_depths=1
    )
    assert main.tolist() == [1, 4, 5] and depth.tolist() == [0, 3, 4]
    (none,) = host_loss_rows(torch.zeros(1, 4), torch.zeros(1, 4), ignore_index=IGNORE_INDEX)
    assert none.tolist() == [0]  # no loss-bearing position: the first, masked
    assert host_loss_rows(torch.ones(2, 4), torch.zeros(2, 4), ignore_index=IGNORE_INDEX) is None  # two packs


def _config(seq_length: int, *, loss_rows_only: bool) -> types.SimpleNamespace:
    """The parts of a ConfigContainer qvl's forward step reads."""
    return types.SimpleNamespace(
        model=types.SimpleNamespace(pipeline_model_parallel_size=1, seq_length=seq_length, context_parallel_size=1),
        qvl=types.SimpleNamespace(vision_balance=False, loss_rows_only=loss_rows_only),
        rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=False, check_for_spiky_loss=False),
    )


def _text_answers(batch) -> types.SimpleNamespace:
    """`batch` with the loss on its text tokens only, and not on the first text token of the pack."""
    mask = (batch.tokens >= TEXT).float()
    mask[0, 0] = 0.0
    return types.SimpleNamespace(**{**vars(batch), "loss_mask": mask})


def _kept(batch) -> torch.Tensor:
    """The positions whose loss counts [s]: the loss mask, less the labels the loader ignores (a sample's last)."""
    return (batch.loss_mask[0] > 0) & (batch.labels[0] != IGNORE_INDEX)


def _step(model, batch, *, loss_rows_only: bool):
    """qvl's forward step and its loss function, then backward: (per-token losses, loss, tokens, gradients, the rows
    the output layer was given)."""
    from qvl.kernels import speed_rotary, speed_sync_free
    from qvl.training.step import forward_step

    seen: list[int] = []
    hook = model.language_model.output_layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    model.zero_grad(set_to_none=True)
    state = types.SimpleNamespace(cfg=_config(batch.tokens.shape[1], loss_rows_only=loss_rows_only))
    try:
        with patches.applied(speed_rotary.GROUP, speed_sync_free.GROUP):
            losses, loss_function = forward_step(state, iter([batch]), model)
            loss, tokens, _ = loss_function(losses)
            loss.backward()
    finally:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), loss.detach(), int(tokens), grads, seen


def _assert_same_training(rows_path, whole_path, keep: torch.Tensor) -> None:
    losses, loss, tokens, grads, _ = rows_path
    whole_losses, whole_loss, whole_tokens, whole_grads, _ = whole_path
    assert tokens == whole_tokens == int(keep.sum())
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(losses[0, keep], whole_losses[0, keep], rtol=1e-6, atol=0)
    assert torch.all(losses[0, ~keep] == 0) and torch.all(whole_losses[0, ~keep] != 0)
    assert grads.keys() == whole_grads.keys()
    for name, grad in whole_grads.items():
        assert_equal_up_to_summation_order(grads[name], grad, what=name)


@pytest.fixture(scope="module")
def tiny_models():
    """Each family's tiny Megatron model (and HF config), built by qvl's provider in fp32 on first use."""
    from qvl.foundation import runtime

    runtime.activate(force=True)
    distributed.init_distributed()
    built: dict[str, tuple] = {}
    try:
        yield lambda family: built.setdefault(family, tiny_megatron_model(family, gradient_accumulation_fusion=False))
    finally:
        distributed.destroy_distributed()


@pytest.fixture
def qwen2_5_vl(tiny_models):
    return tiny_models("qwen2_5_vl")


def _qwen2_5_vl_batch(model, hf_config):
    import math

    from tests.kernels.test_speed_sync_free import _batch

    patch_dim = math.prod(model.visual.patch_embed.proj.weight.shape[1:])
    return _text_answers(_batch("qwen2_5_vl", hf_config, patch_dim))


def test_qwen2_5_vl_output_layer_runs_on_the_loss_rows_with_the_same_loss_and_gradients(qwen2_5_vl):
    model, hf_config = qwen2_5_vl
    batch = _qwen2_5_vl_batch(model, hf_config)
    rows_path = _step(model, batch, loss_rows_only=True)
    whole_path = _step(model, batch, loss_rows_only=False)
    keep = _kept(batch)
    assert whole_path[4] == [batch.tokens.shape[1]] and rows_path[4] == [int(keep.sum())]
    assert rows_path[4][0] < batch.tokens.shape[1] / 2  # most of the pack is vision placeholders
    _assert_same_training(rows_path, whole_path, keep)
    assert any(name.startswith("visual.") for name in rows_path[3])  # the tower still learns through the rows


def test_a_pack_without_loss_trains_nothing_and_still_runs_backward(qwen2_5_vl):
    model, hf_config = qwen2_5_vl
    batch = _qwen2_5_vl_batch(model, hf_config)
    batch.loss_mask = torch.zeros_like(batch.loss_mask)
    losses, loss, tokens, grads, seen = _step(model, batch, loss_rows_only=True)
    assert seen == [1] and tokens == 0 and float(loss) == 0.0  # one row through the output layer, its loss masked
    assert grads and all(torch.all(grad == 0) for grad in grads.values())


def test_qwen3_vl_passes_the_hook_to_its_language_model(tiny_models):
    from tests.kernels import test_speed_qwen3_vl_sync_free as qwen3_vl

    model, _ = tiny_models(qwen3_vl.FAMILY)
    batch = _text_answers(qwen3_vl.pack(model, "both"))
    rows_path = _step(model, batch, loss_rows_only=True)
    whole_path = _step(model, batch, loss_rows_only=False)
    keep = _kept(batch)
    assert rows_path[4] == [int(keep.sum())] and whole_path[4] == [batch.tokens.shape[1]]
    _assert_same_training(rows_path, whole_path, keep)


def test_with_mtp_each_depth_runs_at_its_own_rows(tiny_models, tmp_path):
    """Qwen3.5-VL with its MTP layer: the main head and the depth, each at the rows its mask keeps, give the
    whole-pack path's losses (main and MTP, as the step's loss function adds them) and gradients."""
    from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
    from qvl.data.load import build_packed_datasets
    from qvl.data.samples import write_sample_dataset
    from qvl.launchers.cli import main
    from qvl.training.mtp import LossesWithMtp

    model, _ = tiny_models("qwen3_5_vl")
    assert model.config.mtp_num_layers == 1
    jsonl, media = write_sample_dataset(tmp_path / "samples", count=6, with_bad=False)
    hf = write_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5_vl")
    prepare = ["--input", str(jsonl), "--media-root", str(media), "--family", "qwen3_5_vl", "--hf-path", str(hf)]
    assert main(["data", "prepare", *prepare, "--seq-length", "512", "--output", str(tmp_path / "data")]) == 0
    config = types.SimpleNamespace(
        path=str(tmp_path / "data"), hf_path=str(hf), family="qwen3_5_vl", micro_batch_size=1, num_workers=0
    )
    batch = next(iter(build_packed_datasets(config, None)[0]))
    assert len(batch.cu_seqlens_q) > 2  # several samples: the depth's rows stop at each sample's end
    rows_path = _mtp_step(model, batch, loss_rows_only=True)
    whole_path = _mtp_step(model, batch, loss_rows_only=False)
    (outputs, loss, report, grads, seen), (whole, whole_loss, whole_report, whole_grads, whole_seen) = (
        rows_path,
        whole_path,
    )
    assert isinstance(outputs, LossesWithMtp) and len(outputs.mtp) == 1
    keep = _kept(batch)
    depth_keep = outputs.mtp_masks[0][0] > 0
    assert whole_seen == [batch.tokens.shape[1]] * 2 and seen == [int(keep.sum()), int(depth_keep.sum())]
    main_rows, depth_rows = host_loss_rows(
        batch.loss_mask, batch.labels, ignore_index=IGNORE_INDEX, cu_seqlens=batch.cu_seqlens_q, mtp_depths=1
    )
    # the host's rows of the depth are where the model's shifted mask is set, not the main head's
    assert depth_rows.tolist() == torch.nonzero(depth_keep).reshape(-1).tolist() != main_rows.tolist()
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(report["mtp loss"], whole_report["mtp loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(outputs.main[0, keep], whole.main[0, keep], rtol=1e-6, atol=0)
    torch.testing.assert_close(outputs.mtp[0][0, depth_keep], whole.mtp[0][0, depth_keep], rtol=1e-6, atol=0)
    assert grads.keys() == whole_grads.keys() and any(".mtp." in name or name.startswith("mtp.") for name in grads)
    for name, grad in whole_grads.items():
        assert_equal_up_to_summation_order(grads[name], grad, what=name)


def _mtp_step(model, batch, *, loss_rows_only: bool):
    """qvl's forward step with MTP, its loss function, backward: (outputs, loss, report, gradients, output rows)."""
    from qvl.kernels import speed_rotary
    from qvl.training.step import forward_step

    cfg = types.SimpleNamespace(
        model=model.config,  # the provider: MTP depths, its loss scale, the layout
        qvl=types.SimpleNamespace(vision_balance=False, loss_rows_only=loss_rows_only),
        rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=False, check_for_spiky_loss=False),
    )
    seen: list[int] = []
    hook = model.language_model.output_layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    model.zero_grad(set_to_none=True)
    try:
        with patches.applied(speed_rotary.GROUP):
            outputs, loss_function = forward_step(types.SimpleNamespace(cfg=cfg), iter([batch]), model)
            loss, _, report = loss_function(outputs)
            loss.backward()
    finally:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return outputs, loss.detach(), {k: v.detach() for k, v in report.items()}, grads, seen


class _Head(torch.nn.Module):
    """An output layer as `losses_at_rows` calls it: `(logits, bias)` of `[s, b, h]` states, no sequence parallelism."""

    sequence_parallel = False
    tp_group = None

    def forward(self, x, weight, runtime_gather_output=None):
        return x @ weight.t(), None


def _head_gradients(device: str, dtype: torch.dtype, *, rows: torch.Tensor | None, seed: int = 0):
    """The per-token losses, and the gradients of the states and the output weight, of qvl's cross-entropy over a
    random head at `dtype`: at `rows` only (`losses_at_rows`) or at every position."""
    from qvl.kernels.speed_cross_entropy import vocab_parallel_cross_entropy

    generator = torch.Generator().manual_seed(seed)
    tokens, hidden, vocab = 300, 64, 1000
    states = torch.randn(tokens, 1, hidden, generator=generator).to(device, dtype).requires_grad_()
    weight = (0.1 * torch.randn(vocab, hidden, generator=generator)).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)
    mask = (torch.rand(1, tokens, generator=generator) < 0.3).to(device)
    loss = lambda labels, logits: vocab_parallel_cross_entropy(logits, labels.t(), None).t()  # noqa: E731
    if rows is None:
        losses = loss(labels, _Head()(states, weight)[0])
    else:
        losses = losses_at_rows(
            states, rows.to(device), labels, output_layer=_Head(), output_weight=weight, runtime_gather_output=None,
            compute_language_model_loss=loss, scale_logits=lambda logits: logits,
        )  # fmt: skip
    (losses.float() * mask).sum().backward()
    return losses.detach() * mask, states.grad, weight.grad, mask


def _check_head(device: str) -> None:
    _, _, _, mask = _head_gradients("cpu", torch.float32, rows=None)
    (rows,) = host_loss_rows(mask.cpu().float(), torch.zeros(mask.shape, dtype=torch.long), ignore_index=IGNORE_INDEX)
    exact = _head_gradients(device, torch.float64, rows=None)
    eager = _head_gradients(device, torch.bfloat16, rows=None)
    fast = _head_gradients(device, torch.bfloat16, rows=rows)
    for what, a, b, c in zip(("losses", "states' gradient", "weight gradient"), fast[:3], eager[:3], exact[:3]):
        assert_as_close_as_eager(a.double(), b.double(), c, what=f"loss rows, {what}")


def test_the_rows_path_is_as_close_to_fp64_as_the_whole_pack_in_bf16():
    """bf16, the rows' losses and gradients (the output layer's weight gradient summed over fewer rows) as close to
    float64 as the whole pack's (eagerly on the CPU; the same check on CUDA with the compiled regions below)."""
    _check_head("cpu")


@pytest.mark.gpu
def test_the_rows_path_is_as_close_to_fp64_as_the_whole_pack_on_cuda():
    """On CUDA, qvl's cross-entropy compiled (its regions with dynamic row counts), the rows' losses and gradients in
    bf16 as close to float64 as the whole pack's."""
    _check_head("cuda")


# --- sequence parallelism: two gloo ranks, TP=2 ------------------------------------------------------------------


def _sequence_parallel_worker(rank: int, port: int, out: str) -> None:
    import os

    from megatron.core.pipeline_parallel.schedules import custom_backward

    from qvl.foundation import runtime
    from qvl.kernels import torch_sequence_parallel_norm
    from tests import megatron_smoke as smoke

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    runtime.activate()
    distributed.init_distributed(tensor_parallel=2)
    try:
        shape = smoke.TinyGPT(seq_length=16)
        with patches.applied(torch_sequence_parallel_norm.GROUP):  # torch's norms refuse sequence parallelism
            model = smoke.build_model(shape, smoke.transformer_config(shape, sequence_parallel=True))
        batch = smoke.synthetic_batches(shape, micro_batch_size=1, count=1, seed=3)[0]
        mask = torch.zeros(1, shape.seq_length)
        mask[0, [1, 2, 5, 9, 10, 11, 15]] = 1.0
        positions = torch.arange(shape.seq_length)[None]
        rows = LossRows(rows=host_loss_rows(mask, batch["labels"], ignore_index=IGNORE_INDEX)[0])
        results = {}
        for name, hook in (("rows", {"output_processor": loss_rows_output, "output_processor_context": rows}),
                           ("whole", {})):  # fmt: skip
            model.zero_grad(set_to_none=True)
            losses = model(batch["tokens"], positions, attention_mask=None, labels=batch["labels"], **hook)
            # as Megatron's schedules run it: the engine called directly, inside the CPU runtime's device mode (a
            # Tensor.backward() would run outside it: the mode is off while it handles the call)
            custom_backward((losses * mask).sum(), None)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results[name] = (losses.detach(), grads)
        assert model.output_layer.sequence_parallel  # put back after the rows' call
        torch.save({"mask": mask, **results}, f"{out}/rank{rank}.pt")
    finally:
        distributed.destroy_distributed()


@pytest.mark.slow
def test_sequence_parallel_gives_the_whole_pack_losses_and_gradients(tmp_path, free_port):
    start_ranks(_sequence_parallel_worker, (free_port, str(tmp_path)), 2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        keep = result["mask"][0] > 0
        (losses, grads), (whole_losses, whole_grads) = result["rows"], result["whole"]
        torch.testing.assert_close(losses[0, keep], whole_losses[0, keep], rtol=1e-6, atol=0)
        assert torch.all(losses[0, ~keep] == 0)
        assert grads.keys() == whole_grads.keys() and "output_layer.weight" in grads
        for name, grad in whole_grads.items():
            assert_equal_up_to_summation_order(grads[name], grad, what=name)
