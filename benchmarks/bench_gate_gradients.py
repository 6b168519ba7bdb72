"""How far fp32 gradients of a tiny Qwen3.5-VL are from the same model in fp64, per parameter kind.

transformers' own Qwen3.5 model (its chunked torch fallback, fp32) against a float64 copy whose delta rule is the
exact token-by-token recurrence computed in float64 (transformers' torch kernels cast to fp32 whatever the model's
dtype): one causal-LM backward over 200 random text tokens. The Gated DeltaNet's decay-gate parameters (`A_log`,
`dt_bias`, `in_proj_a`) come out three orders of magnitude further from the fp64 gradient than every other weight:
that is the floor any fp32 training-parity check on them has to allow (README: Training parity). CPU, ~10 s.
"""

from __future__ import annotations

import copy
import pathlib

import torch

KINDS = ("A_log", "dt_bias", "in_proj_a", "in_proj_b", "conv1d", "out_proj", "mlp.down_proj")


def recurrent_fp64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **_):  # fmt: skip
    """The gated delta rule token by token in float64 (transformers' torch_recurrent_gated_delta_rule's math)."""
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    q, k, v, b, decay = (x.transpose(1, 2).double() for x in (query, key, value, beta, g))
    q = q * k.shape[-1] ** -0.5
    state = torch.zeros(*k.shape[:2], k.shape[-1], v.shape[-1], dtype=torch.float64)
    outputs = []
    for t in range(k.shape[2]):
        state = state * decay[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, 2).transpose(1, 2).to(query.dtype), None


def _grads(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Relative gradient error of fp32 transformers against fp64, worst layer per parameter kind."""
    import transformers

    from qvl.bridges.tiny_model import tiny_hf_config

    torch.manual_seed(0)
    fp32 = transformers.AutoModelForImageTextToText.from_config(tiny_hf_config("qwen3_5_vl"), dtype=torch.float32)
    with torch.no_grad():  # zero-initialised norms would hide their gradients' path: perturb as the tiny checkpoints do
        for name, param in fp32.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    fp64 = copy.deepcopy(fp32).double()
    for layer in fp64.model.language_model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.chunk_gated_delta_rule = recurrent_fp64
    ids = torch.randint(7, fp32.config.text_config.vocab_size, (1, 100 if quick else 200))
    ours, exact = _grads(fp32, ids), _grads(fp64, ids)
    figures = {}
    for kind in KINDS:
        names = [n for n in exact if kind in n]
        figures[f"rel_error_{kind}"] = max(float((ours[n] - exact[n]).norm() / exact[n].norm()) for n in names)
    return {"tokens": ids.shape[1], **figures}


if __name__ == "__main__":
    for key, value in run(pathlib.Path(".")).items():
        print(f"{key:28s} {value:.3g}")
