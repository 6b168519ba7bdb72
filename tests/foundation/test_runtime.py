"""Each redirection of the CPU runtime, one test apiece, so a Megatron or torch bump that breaks one fails here."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.foundation.conftest import check_passed


def test_activate_is_explicit_and_reversible(cpu_runtime_off):
    """From off (an earlier test file of this worker may have left it on; importing qvl switches nothing on: the
    fresh interpreter of tests/foundation/fresh_import.py), on and back off."""
    from qvl.foundation import runtime

    assert not runtime.is_active()
    original = torch.cuda.current_device
    with runtime.cpu_runtime(force=True) as active:
        assert active and runtime.is_active()
        assert torch.cuda.current_device is not original
    assert not runtime.is_active()
    assert torch.cuda.current_device is original


def test_cuda_device_arguments_land_on_cpu(cpu_runtime):
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    x = torch.arange(4.0)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to(torch.cuda.current_device(), torch.float16).dtype == torch.float16
    assert x.pin_memory() is x


def test_a_backward_run_by_autograd_grad_keeps_the_redirection(cpu_runtime):
    """A mode is off while it handles a call, and `torch.autograd.grad` is one call for its whole backward: a custom
    Function's backward that makes a tensor on "cuda" (Megatron-Core's TP collectives do, inside its CUDA graphs'
    captures) must still land on the CPU."""

    class OnCudaInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.full(grad.shape, 2.0, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    y = OnCudaInBackward.apply(x)
    (grad,) = torch.autograd.grad(y, x, torch.ones(3), retain_graph=True)
    assert torch.equal(grad, torch.full((3,), 2.0))
    (grad,) = torch.autograd.grad(outputs=[y.sum()], inputs=[x])
    assert torch.equal(grad, torch.full((3,), 2.0))


def test_tensor_type_reports_cuda_names(cpu_runtime):
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"  # only the optimizer's float checks


def test_streams_events_and_sync_are_no_ops(cpu_runtime):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert event.query() is True


def test_megatron_causal_mask_helper_runs_on_cpu(cpu_runtime):
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))


def test_rng_tracker_forks_the_cpu_generator(cpu_runtime):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    outside_first = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        inside = torch.rand(3)
    outside_after_fork = torch.rand(3)
    # The fork drew from its own stream and put the default stream back where it was.
    assert torch.equal(outside_after_fork, outside_first)
    assert not torch.equal(inside, outside_first)
    # Re-seeding the tracker with the same seed reproduces the forked draws (what TP ranks rely on).
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork():
        assert torch.equal(torch.rand(3), inside)
    tracker.reset()


def test_megatron_bridge_imports_without_transformer_engine(fresh_import_report):
    """In a fresh interpreter: no stand-in leaks, nothing kept out or TorchInductor comes in with Megatron-Bridge, and
    the stand-in's classes are no real TE layer."""
    if check_passed(fresh_import_report, "transformer_engine_free")["te_present"]:
        pytest.skip("Transformer Engine is installed here; the stand-in is not used")


def test_stand_in_classes_refuse_use():
    from qvl.foundation import megatron

    stand_in = megatron._STAND_INS["megatron.bridge.peft.lora_layers"]
    with megatron._stand_in(stand_in.package, stand_in.submodule, stand_in.advice):
        import transformer_engine.pytorch as te

        with pytest.raises(megatron.OptionalPackageUnavailable, match="transformer_engine.*not installed"):
            te.Linear(4, 4)
    assert "transformer_engine" not in sys.modules


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("fp8", "hybrid", "FP8 needs Transformer Engine"),
        ("transformer_impl", "transformer_engine", "transformer_impl='local'"),
        ("tp_comm_overlap", True, "tp_comm_overlap=False"),
    ],
)
def test_cpu_refuses_what_it_cannot_run(field, value, message):
    from qvl.foundation import runtime

    config = type("Config", (), {field: value})()
    with pytest.raises(runtime.UnsupportedOnCPU, match=message):
        runtime.check_cpu_config(config)


def test_a_cpu_training_config_refuses_the_optimizers_cpu_offload_by_name():
    """The recipe's optimizer_offload sets the optimizer's field, not the model's: a CPU run named it only through a
    traceback from torch ("can't optimize a non-leaf Tensor") until the optimizer's config was checked too."""
    from types import SimpleNamespace

    from qvl.foundation import runtime

    plain = {**runtime.cpu_safe_config_overrides(), "fp8": None, "sequence_parallel": False}
    config = SimpleNamespace(dist=SimpleNamespace(), dataset=SimpleNamespace(), model=SimpleNamespace(**plain),
                             optimizer=SimpleNamespace(optimizer_cpu_offload=True))  # fmt: skip
    with pytest.raises(runtime.UnsupportedOnCPU, match="optimizer_offload=0"):
        runtime.cpu_training_config(config)
    config.optimizer.optimizer_cpu_offload = False
    runtime.cpu_training_config(config)
    assert config.dist.distributed_backend == "gloo"


def test_cpu_accepts_a_plain_fp32_config():
    from qvl.foundation import runtime

    config = type("Config", (), {**runtime.cpu_safe_config_overrides(), "fp8": None, "sequence_parallel": False})()
    runtime.check_cpu_config(config)  # raises if anything is refused
