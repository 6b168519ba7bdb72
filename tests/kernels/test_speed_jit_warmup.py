"""Patch group "speed-jit-warmup": Megatron-Bridge's setup warms up the fused functions only where the model uses one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qvl.foundation import patches
from qvl.foundation.families import FAMILIES
from qvl.foundation.megatron import import_megatron_bridge
from qvl.kernels import speed_jit_warmup, switch
from qvl.kernels.switch import Target


@pytest.fixture
def warmups(monkeypatch) -> list:
    """The calls of upstream's warm-up (`set_jit_fusion_options` calls it through its module)."""
    import_megatron_bridge()
    from megatron.bridge.training import initialize

    calls = []
    monkeypatch.setattr(initialize, "_warmup_jit_function", lambda config, mbs: calls.append(config))
    return calls


def _setup_warms(config) -> None:
    from megatron.bridge.training import setup

    setup.set_jit_fusion_options(config, 1)


@pytest.mark.parametrize(("activation", "dropout", "warmed"), [(False, False, 0), (True, False, 1), (False, True, 1)])
def test_the_warm_up_runs_only_where_a_fusion_is_on(warmups, activation, dropout, warmed):
    config = SimpleNamespace(bias_activation_fusion=activation, bias_dropout_fusion=dropout)
    with patches.applied(speed_jit_warmup.GROUP):
        _setup_warms(config)
    assert len(warmups) == warmed
    _setup_warms(config)  # upstream's: always
    assert len(warmups) == warmed + 1


def test_it_is_on_around_every_training_loop():
    assert speed_jit_warmup.GROUP in switch.training_groups(Target(device="cpu"))
    assert speed_jit_warmup.GROUP in switch.training_groups(Target(device="cuda"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_family_compiles_a_fused_function_on_the_cpu(family, monkeypatch):
    """Where CUDA and Triton are not, the fixed provider of every family turns both compiled fusions off, so a CPU run
    warms up and compiles none (Qwen3-VL-MoE's upstream provider turns bias_dropout_fusion on); where they are, the
    provider's bias-dropout-add setting stays."""
    from qvl.bridges.providers import auto_bridge, provider_from_hf
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation import megatron

    if megatron.have_transformer_engine():
        pytest.skip("with Transformer Engine the provider keeps its TE settings")
    monkeypatch.setattr(megatron, "jit_fusions_usable", lambda: False)
    provider = provider_from_hf(tiny_hf_config(family))
    assert not speed_jit_warmup.fusions_in_use(provider), (
        provider.bias_activation_fusion,
        provider.bias_dropout_fusion,
    )
    monkeypatch.setattr(megatron, "jit_fusions_usable", lambda: True)
    upstream = auto_bridge(tiny_hf_config(family)).to_megatron_provider(load_weights=False)
    assert provider_from_hf(tiny_hf_config(family)).bias_dropout_fusion == upstream.bias_dropout_fusion
