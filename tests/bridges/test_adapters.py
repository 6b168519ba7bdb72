"""qvl's LoRA and DoRA (qvl.bridges.adapters): targets by meaning from the family record, refusals in one line, the
TE-flag fix (Megatron-Bridge's LoRA fails on every target without TE unless it is applied), and the adapted layers'
outputs equal `peft`'s on the same weights (fp32 on CPU; bf16 forward and backward on a GPU)."""

from __future__ import annotations

import pytest
import torch

from qvl.foundation import distributed, patches
from qvl.foundation.errors import ConfigError
from qvl.foundation.families import ADAPTER_TARGETS, FAMILIES
from qvl.foundation.megatron import have_transformer_engine, import_megatron_bridge

import_megatron_bridge()

from qvl.bridges.adapters import (  # noqa: E402
    QvlDoRA,
    QvlLoRA,
    adapter_config,
    check_dora_layout,
    global_name,
    target_modules,
)
from qvl.kernels import fix_peft_without_te  # noqa: E402

IN, OUT, RANK, ALPHA = 48, 80, 4, 8


@pytest.fixture
def megatron_state(cpu_runtime):
    distributed.init_distributed()
    yield
    distributed.destroy_distributed()


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, use_cpu_initialization=True)


def _model(*, bias: bool = True) -> torch.nn.Module:
    """A container whose one linear has the name the family record's language patterns match: a fused qkv that adds
    its own bias (`skip_bias_add=False`), as Qwen2's attention does."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(0)
    linear = ColumnParallelLinear(IN, OUT, config=_config(), init_method=torch.nn.init.normal_, bias=bias,
                                  skip_bias_add=False, gather_output=False)  # fmt: skip
    with torch.no_grad():
        if bias:
            linear.bias.normal_()
    attention = torch.nn.Module()
    attention.linear_qkv = linear
    layer = torch.nn.Module()
    layer.self_attention = attention
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([layer])
    language = torch.nn.Module()
    language.decoder = decoder
    model = torch.nn.Module()
    model.language_model = language
    return model


def test_targets_by_meaning_come_from_the_family_record_and_language_is_the_default():
    for family in FAMILIES.values():
        language = target_modules(family.name, ("language",))
        assert language == list(family.adapter_modules["language"])
        assert all(p.startswith("language_model.decoder.") for p in language), family.name  # no MTP, no vision
        assert not any(".experts." in p for p in language), family.name
        assert adapter_config(family=family.name).target_modules == language
        assert set(family.adapter_modules) == set(ADAPTER_TARGETS)
        assert bool(family.adapter_modules["experts"]) == family.moe


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(family="qwen2_5_vl", targets=("language", "vison")), r"'vison' is not an adapter target; use any of"),
        (dict(family="qwen3_vl", targets=("experts",)), r"Qwen3-VL has no experts to adapt .* drop experts"),
        (dict(family="qwen2_5_vl", method="dora", targets=("language", "vision")), r"adapter=dora cannot adapt"),
        (dict(family="qwen3_vl_moe", method="dora", targets=("experts",)), r"dora cannot adapt MoE experts"),
        (dict(family="qwen2_vl", method="qlora"), r"adapter='qlora' is not an adapter method; use one of lora, dora"),
        (dict(family="qwen2_vl", rank=0), r"adapter_rank=0 .* must be at least 1"),
        (dict(family="qwen2_vl", targets=()), r"adapter_targets is empty"),
    ],
)
def test_bad_adapter_options_are_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        adapter_config(**kwargs)


def test_dora_is_refused_at_tensor_parallel_above_one():
    check_dora_layout("lora", 4)
    with pytest.raises(ConfigError, match=r"adapter=dora needs tensor_parallel=1 \(got 2\)"):
        check_dora_layout("dora", 2)


@pytest.mark.skipif(have_transformer_engine(), reason="the mock TE flags exist only where TE is absent")
def test_without_the_fix_megatron_bridge_lora_fails_on_every_target_and_with_it_wraps(megatron_state):
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.peft.utils import HAVE_TE

    assert HAVE_TE and not patches.is_applied(fix_peft_without_te.GROUP)  # the MagicMock `te` looks like TE
    with pytest.raises(TypeError, match="isinstance"):
        LoRA(target_modules=["*.linear_qkv"], dim=RANK, alpha=ALPHA)(_model(), training=True)
    adapted = adapter_config(family="qwen2_5_vl", rank=RANK, alpha=ALPHA)(_model(), training=True)
    wrapped = adapted.language_model.decoder.layers[0].self_attention.linear_qkv
    assert type(wrapped).__name__ == "LoRALinear"
    assert not patches.is_applied(fix_peft_without_te.GROUP)  # applied for the transform only
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert sorted(trainable) == [
        "language_model.decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight",
        "language_model.decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight",
    ]


def test_initial_adapters_depend_on_the_seed_and_name_not_on_the_process_rng(megatron_state):
    """A is drawn per module from (seed, global name): the same after other draws from torch's RNG (as a pipeline
    stage holding other layers makes), another with another seed; B starts at zero."""

    def initial_a(seed: int, draws: int) -> torch.Tensor:
        torch.manual_seed(123)
        torch.randn(draws)
        model = adapter_config(family="qwen2_5_vl", rank=RANK, alpha=ALPHA, seed=seed)(_model(), training=True)
        adapter = model.language_model.decoder.layers[0].self_attention.linear_qkv.adapter
        assert not adapter.linear_out.weight.any()
        return adapter.linear_in.weight.detach().clone()

    first = initial_a(seed=7, draws=0)
    assert torch.equal(initial_a(seed=7, draws=1000), first)
    assert not torch.equal(initial_a(seed=8, draws=0), first)
    assert 0.5 < float(first.std() / (2 / (IN + RANK)) ** 0.5) < 1.5  # xavier-normal's scale, as upstream draws


def test_a_target_that_matches_no_module_is_an_error(megatron_state):
    with pytest.raises(ConfigError, match=r"adapter_targets: 'vision' matches no module of this Qwen3-VL model"):
        QvlLoRA(family="qwen3_vl", targets=["vision"], target_modules=target_modules("qwen3_vl", ("vision",)))(
            _model(), training=True
        )


class _Group:
    """An expert-parallel group's face as global_name sees it: this process's rank in it."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _moe_stage(*, first_layer: int, ep_rank: int, local_experts: int = 2) -> torch.nn.Module:
    """A pipeline stage's chunk holding two MoE layers from global layer `first_layer` (Megatron-Core's 1-based
    layer_number), each with this EP rank's `local_experts` experts, named as Megatron-Core names them."""
    layers = torch.nn.ModuleList()
    for k in range(2):
        experts = torch.nn.Module()
        experts.ep_group, experts.num_local_experts = _Group(ep_rank), local_experts
        experts.local_experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(local_experts))
        mlp = torch.nn.Module()
        mlp.experts = experts
        layer = torch.nn.Module()
        layer.layer_number, layer.mlp = first_layer + k + 1, mlp
        layers.append(layer)
    decoder = torch.nn.Module()
    decoder.layers = layers
    language = torch.nn.Module()
    language.decoder = decoder
    chunk = torch.nn.Module()
    chunk.language_model = language
    return chunk


@pytest.mark.parametrize(("first_layer", "ep_rank"), [(0, 0), (2, 0), (0, 1), (2, 1)])
def test_global_name_makes_layer_and_expert_indices_global_at_every_pp_and_ep_layout(first_layer, ep_rank):
    """PP=2 x EP=2 without processes: the second stage's second layer (local 1, global 3) and EP rank 1's first
    expert (local 0, global 2); each module is looked up by its local path (the global one does not exist here)."""
    chunk = _moe_stage(first_layer=first_layer, ep_rank=ep_rank)
    local = "language_model.decoder.layers.1.mlp.experts.local_experts.0"
    expected = f"language_model.decoder.layers.{first_layer + 1}.mlp.experts.local_experts.{2 * ep_rank}"
    assert global_name(chunk, local) == expected
    assert global_name(chunk, local + ".weight") == expected + ".weight"
    assert global_name(chunk, "language_model.decoder.layers.0") == f"language_model.decoder.layers.{first_layer}"


def _peft_linear(linear, *, dora: bool) -> torch.nn.Module:
    """`peft`'s LoRA / DoRA on an nn.Linear holding `linear`'s weight and bias."""
    from peft import LoraConfig, get_peft_model

    plain = torch.nn.Sequential(torch.nn.Linear(IN, OUT, bias=linear.bias is not None))
    with torch.no_grad():
        plain[0].weight.copy_(linear.weight)
        if linear.bias is not None:
            plain[0].bias.copy_(linear.bias)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0"], use_dora=dora, init_lora_weights=False)
    return get_peft_model(plain, config)


def _same_adapter(peft_model, adapter) -> None:
    layer = peft_model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(adapter.linear_in.weight)
        layer.lora_B["default"].weight.copy_(adapter.linear_out.weight)
        if hasattr(adapter, "weight_magnitude"):
            layer.lora_magnitude_vector["default"].weight.copy_(adapter.weight_magnitude)


@pytest.mark.parametrize("method", ["lora", "dora"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens", [(5, 2), (7,)], ids=["3d", "2d"])
def test_adapted_linear_equals_peft_on_the_same_weights(megatron_state, method, bias, tokens):
    """Forward and adapter gradients of qvl's adapted Megatron linear equal peft's on an nn.Linear (fp32): for DoRA
    the linear's own bias stays outside the magnitude scaling, as in peft (upstream's DoRALinear scales it), and a
    2-D input (the vision merger's [patches, hidden]) gives a 2-D output (upstream's gives [1, patches, out])."""
    model = adapter_config(family="qwen2_5_vl", method=method, rank=RANK, alpha=ALPHA)(_model(bias=bias))
    wrapped = model.language_model.decoder.layers[0].self_attention.linear_qkv
    with torch.no_grad():  # trained-looking adapters: B non-zero, the magnitude away from ||W||
        wrapped.adapter.linear_out.weight.normal_(0, 0.5)
        if method == "dora":
            wrapped.adapter.weight_magnitude.mul_(torch.linspace(0.5, 1.5, OUT))
    reference = _peft_linear(wrapped.to_wrap, dora=method == "dora")
    _same_adapter(reference, wrapped.adapter)
    x = torch.randn(*tokens, IN)
    ours, bias_out = wrapped(x)
    theirs = reference(x)
    assert bias_out is None and ours.shape == (*tokens, OUT)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    layer = reference.base_model.model[0]
    torch.testing.assert_close(wrapped.adapter.linear_out.weight.grad, layer.lora_B["default"].weight.grad)
    torch.testing.assert_close(wrapped.adapter.linear_in.weight.grad, layer.lora_A["default"].weight.grad)
    if method == "dora":
        assert isinstance(model.language_model.decoder.layers[0].self_attention.linear_qkv, torch.nn.Module)
        assert type(wrapped).__name__ == "BiasOutsideDoRALinear"


def test_dora_config_is_qvls_dora():
    assert isinstance(adapter_config(family="qwen3_5_vl", method="dora"), QvlDoRA)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["lora", "dora"])
def test_bf16_adapter_forward_and_backward_on_cuda_against_the_unadapted_layer(method):
    """bf16 on a GPU: with B = 0 (as trained from) the adapted layer gives the unadapted layer's output bit for bit;
    with a trained-looking B its output and adapter gradients are as close to fp64 as bf16 allows."""
    from tests.numerics import BF16_BOUND, relative_error

    distributed.init_distributed()
    try:
        # adapters are built from the layer's config (CPU initialisation, fp32): added first, then moved with the model
        model = adapter_config(family="qwen2_5_vl", method=method, rank=RANK, alpha=ALPHA)(_model()).cuda().bfloat16()
        wrapped = model.language_model.decoder.layers[0].self_attention.linear_qkv
        x = torch.randn(64, 2, IN, device="cuda", dtype=torch.bfloat16)
        unadapted, _ = wrapped.to_wrap(x)
        adapted, _ = wrapped(x)
        if method == "lora":  # DoRA's magnitude over the fp32-computed norm rounds once more
            assert torch.equal(adapted, unadapted)
        else:
            assert relative_error(adapted, unadapted) <= BF16_BOUND
        with torch.no_grad():
            wrapped.adapter.linear_out.weight.normal_(0, 0.5)
        adapted, _ = wrapped(x)
        grad = torch.randn_like(adapted)
        adapted.backward(grad)
        exact = _model().double().cuda()
        reference = _peft_linear(
            exact.language_model.decoder.layers[0].self_attention.linear_qkv, dora=method == "dora"
        )
        reference = reference.double().cuda()
        with torch.no_grad():
            reference.base_model.model[0].weight.copy_(wrapped.to_wrap.weight)
            reference.base_model.model[0].bias.copy_(wrapped.to_wrap.bias)
        _same_adapter(reference, wrapped.adapter)
        expected = reference(x.double())
        expected.backward(grad.double())
        layer = reference.base_model.model[0]
        assert relative_error(adapted, expected) <= BF16_BOUND
        assert relative_error(wrapped.adapter.linear_out.weight.grad, layer.lora_B["default"].weight.grad) <= BF16_BOUND
        assert relative_error(wrapped.adapter.linear_in.weight.grad, layer.lora_A["default"].weight.grad) <= BF16_BOUND
    finally:
        distributed.destroy_distributed()


def test_dora_on_the_merger_keeps_the_forward_and_a_tower_of_the_wrong_shape_is_named(cpu_runtime):
    """Qwen3-VL's tiny model with DoRA on the language model and the mergers (2-D [patches, hidden] inputs): at init
    (B = 0, magnitude = ||W||) qvl's forward of a packed batch with images and a video is the unadapted one bit for
    bit. With upstream's DoRALinear on the mergers (its `.view(1, 1, -1)` makes their output 3-D) the forward stops
    naming the vision tower as the fault, not the data."""
    from megatron.bridge.peft.dora_layers import DoRALinear

    from qvl.kernels.speed_qwen3_vl_sync_free import VisionTowerOutputError
    from tests.kernels.test_speed_qwen3_vl_sync_free import FAMILY, inputs_of, pack, with_host_batch
    from tests.tiny_megatron import tiny_megatron_model

    distributed.init_distributed()
    try:
        model, _ = tiny_megatron_model(FAMILY, gradient_accumulation_fusion=False)
        batch = pack(model, "both")
        kwargs = with_host_batch(model, batch, inputs_of(batch))
        with torch.no_grad():
            unadapted = model(**kwargs)
        targets = ("language", "merger")
        adapter_config(family=FAMILY, method="dora", targets=targets, rank=RANK, alpha=ALPHA)(model, training=True)
        mergers = [m for n, m in model.named_modules() if "merger" in n and isinstance(m, DoRALinear)]
        assert len(mergers) >= 2 and all(type(m).__name__ == "BiasOutsideDoRALinear" for m in mergers)
        with torch.no_grad():
            assert torch.equal(model(**kwargs), unadapted)
            for merger in mergers:
                merger.__class__ = DoRALinear
            with pytest.raises(VisionTowerOutputError, match=r"the vision tower \(\w+\) returned .* shape \[1, ") as e:
                model(**kwargs)
        assert "not the data" in str(e.value) and "prepare the dataset" not in str(e.value)
    finally:
        distributed.destroy_distributed()
