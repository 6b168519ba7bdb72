"""How far fp32 gradients of a tiny Qwen3.5-VL are from the same model in fp64, per parameter kind.

transformers' own Qwen3.5 model (its chunked torch fallback, fp32) against a float64 copy computed with every
explicit fp32 cast of the modelling code made fp64 (`qvl.training.parity.exact.Float64Casts`: the RMSNorms, the
decay gate `-exp(A_log) * softplus(a + dt_bias)`, rotary and softmax upcast to `torch.float32` by name, which a
plain `.double()` would keep) and its delta rule the exact token-by-token recurrence: one causal-LM backward over
200 random text tokens. The Gated DeltaNet's decay-gate parameters (`A_log`, `dt_bias`, `in_proj_a`) come out
orders of magnitude further from the fp64 gradient than every other weight: that is the floor any fp32
training-parity check on them has to allow (docs/parity.md; qvl's own side of the same comparison is
`tests/training/test_parity.py::test_gate_gradients_differ_by_fp32_error_alone`). CPU, ~15 s.

`--device cuda` measures on a GPU, where transformers' fp32 model runs flash-linear-attention's chunked rule if fla is
installed: under qvl's exact-fp32 settings (qvl.kernels.fix_fla_tf32, as the parity check runs it there), so the
figures are the chunked algorithm's, not TF32's (tests/training/test_parity_gated_delta.py holds them to the chunked
gate tolerance).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import pathlib

import torch

KINDS = ("A_log", "dt_bias", "in_proj_a", "in_proj_b", "conv1d", "out_proj", "mlp.down_proj")


def _grads(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def exact_settings(device: str):
    """qvl's exact-fp32 settings on CUDA (fla's group too where fla is installed); nothing on the CPU."""
    if device != "cuda":
        return contextlib.nullcontext()
    from qvl.foundation import patches
    from qvl.kernels import fix_fla_tf32

    stack = contextlib.ExitStack()
    stack.enter_context(fix_fla_tf32.arithmetic())
    if importlib.util.find_spec("fla") is not None:
        stack.enter_context(patches.applied(fix_fla_tf32.PATCH_GROUP))
    return stack


def run(out_dir: pathlib.Path, quick: bool = False, device: str = "cpu") -> dict:
    """Relative gradient error of fp32 transformers against fp64, worst layer per parameter kind."""
    import transformers

    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.training.parity.exact import Float64Casts, exact_delta_rule

    torch.manual_seed(0)
    fp32 = transformers.AutoModelForImageTextToText.from_config(tiny_hf_config("qwen3_5_vl"), dtype=torch.float32)
    with torch.no_grad():  # zero-initialised norms would hide their gradients' path: perturb as the tiny checkpoints do
        for name, param in fp32.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    fp64 = exact_delta_rule(copy.deepcopy(fp32).double()).to(device)
    fp32 = fp32.to(device)
    ids = torch.randint(7, fp32.config.text_config.vocab_size, (1, 100 if quick else 200)).to(device)
    with exact_settings(device):
        ours = _grads(fp32, ids)
        with Float64Casts():
            exact = _grads(fp64, ids)
    figures = {}
    for kind in KINDS:
        names = [n for n in exact if kind in n]
        figures[f"rel_error_{kind}"] = max(float((ours[n] - exact[n]).norm() / exact[n].norm()) for n in names)
    others = [n for n in exact if not any(k in n for k in ("A_log", "dt_bias", "in_proj_a"))]
    figures["rel_error_every_other_tensor"] = max(
        float((ours[n] - exact[n]).norm() / exact[n].norm().clamp(min=1e-300)) for n in others
    )
    return {"tokens": ids.shape[1], "device": device, **figures}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for key, value in run(pathlib.Path("."), device=parser.parse_args().device).items():
        print(f"{key:32s} {value:.3g}" if isinstance(value, float) else f"{key:32s} {value}")
