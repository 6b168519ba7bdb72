"""The language model's rotary without host reads, as one compiled region where CUDA and Triton are (patch group
"speed-rotary" of qvl.foundation.patches); the model's forward with the loader's mRoPE positions and the loss check
once per step are qvl.kernels.speed_sync_free.

Megatron-Core 0.19.2's packed (THD) rotary, `_apply_rotary_pos_emb_thd`
(megatron/core/models/common/embeddings/rope_utils.py), reads the sub-sequence lengths and every sub-sequence's
start back to the host (`.tolist()`, one `.item()` each) in every attention layer, for the query and the key, then
cuts the frequencies per sub-sequence and concatenates them again. With one context-parallel rank and frequencies
for every position of the pack (Qwen-VL's mRoPE positions are per token), those slices put together are the whole
frequency tensor, so the result is bitwise that of the plain (BSHD) rotary over the whole pack, which is what
`packed_rotary` runs. That equality needs the sub-sequences to cover the pack, from its first token to its last.

How that fact reaches the rotary: Megatron-Core's attention hands `_apply_rotary_pos_emb_thd` only the
`cu_seqlens` tensor of the `PackedSeqParams` it was given (megatron/core/transformer/attention.py), so no argument
of qvl's can get there. The fact travels as the tensor's type instead: qvl's forward step builds its `cu_seqlens`
as a `WholePackCuSeqlens` (`mark_whole_pack`), a plain `torch.Tensor` subclass with torch functions disabled (as
`nn.Parameter` is: every op on it returns an ordinary tensor, and kernels see an ordinary tensor), and
`packed_rotary` takes the one-pass path for that type only; any other tensor takes upstream's loop.

Where qvl's compiled regions run (CUDA with Triton, qvl.kernels.compiled), that whole-pack rotary is
one compiled region: Megatron-Core's eager rotary is about ten kernels each way per query or key (cos, sin, their
casts, rotate-half's neg and cat, the products and the sum), Inductor's one each way, computing the cos and sin from the
frequencies inside the kernel and rounding to bf16 once instead of after each product (the eager path stays on CPU
and is what the CPU tests compare bitwise). So is the rotary of Megatron-Bridge's Qwen3-VL attention (language model
and vision tower), which has no host read but the same eager kernels.
"""

from __future__ import annotations

import functools

import torch

from qvl.kernels import compiled

GROUP = "speed-rotary"


_KEEPS_TYPE = frozenset({torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.detach})


class WholePackCuSeqlens(torch.Tensor):
    """The `cu_seqlens` of a pack whose sub-sequences cover it from its first token to its last (qvl's forward step
    builds them so). Only the type says it: every op on it returns an ordinary tensor but a copy or an alias of it
    (`clone`, `detach`: the same bounds, as Megatron-Core's CUDA graphs hand a shared input buffer to each layer and
    clone the buffers for their warm-up), and eager kernels and custom ops (torch's varlen attention) take it as
    one. Inside a torch.compile graph Dynamo refuses it as a custom op's input: no compiled region takes the language
    model's `cu_seqlens`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if func in _KEEPS_TYPE and isinstance(result, torch.Tensor):
            return result.as_subclass(cls)
        return result


def mark_whole_pack(cu_seqlens: torch.Tensor) -> WholePackCuSeqlens:
    """`cu_seqlens` (the same storage) as a `WholePackCuSeqlens`: it ends at its pack's last token."""
    return cu_seqlens.as_subclass(WholePackCuSeqlens)


def rotary_whole_pack(
    t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool, mla_rotary_interleaved: bool, mscale: float
) -> torch.Tensor:
    """Megatron-Core's plain (BSHD) rotary over a whole pack `[tokens, heads, dim]` with per-token frequencies."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs,
        rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved,
        mscale=mscale,
    ).squeeze(1)


def rotary_absolute(
    t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool, in_fp32: bool, packed: bool
) -> torch.Tensor:
    """Megatron-Bridge's Qwen3-VL rotary (`apply_rotary_pos_emb_absolute`, modelling_qwen3_vl/rope.py, used by its
    language model and its vision tower) with the config's two fields as arguments: per-token frequencies, packed
    `[tokens, heads, dim]` or `[s, b, heads, dim]`, optionally in fp32."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    x = t.float() if in_fp32 else t
    out = _apply_rotary_pos_emb_bshd(x[:, None] if packed else x, freqs, rotary_interleaved=rotary_interleaved)
    out = out.squeeze(1) if packed else out
    return out.to(t.dtype) if in_fp32 else out


def absolute_rotary(original):
    """Patch factory for `apply_rotary_pos_emb_absolute` as Megatron-Bridge's Qwen3-VL attention calls it: one
    compiled region each way where qvl's compiled regions run (its eager form is about ten kernels each way per query
    or key, as Megatron-Core's), upstream's function elsewhere."""

    @functools.wraps(original)
    def apply_rotary_pos_emb_absolute(t, freqs, config, cu_seqlens=None):
        if config.apply_rope_fusion or not compiled.runs_compiled(t):
            return original(t, freqs, config, cu_seqlens)
        rotate = compiled.compiled(rotary_absolute)
        return rotate(t, freqs, config.rotary_interleaved, config.apply_rotary_pos_emb_in_fp32, cu_seqlens is not None)

    return apply_rotary_pos_emb_absolute


def packed_rotary(original):
    """`_apply_rotary_pos_emb_thd` that, for a whole pack (`WholePackCuSeqlens`) on one CP rank with per-token frequencies, rotates
    the pack in one pass (no host read); everything else goes to upstream's loop."""

    @functools.wraps(original)
    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
              cp_group=None, multi_latent_attention=None):  # fmt: skip
        whole = (
            cp_group is not None
            and cp_group.size() == 1
            and multi_latent_attention is None
            and isinstance(cu_seqlens, WholePackCuSeqlens)
            and freqs.dim() >= 1
            and freqs.size(0) == t.size(0)
        )
        if not whole:
            return original(t, cu_seqlens, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, cp_group,
                            multi_latent_attention)  # fmt: skip
        return compiled.region(rotary_whole_pack, t)(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale)

    return apply
