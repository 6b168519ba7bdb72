"""Qwen3.5-VL's multi-token-prediction (MTP) head as it is served, pinned by a transcription of vLLM's forward.

`served_mtp_logits` is written from vLLM's source (vllm/model_executor/models/qwen3_5_mtp.py at
https://github.com/vllm-project/vllm: `Qwen3_5MTP.embed_input_ids` merges the multimodal embeddings, gathered one
position ahead of the target model's (`shift_computed_tokens=1`), into the drafter's inputs;
`Qwen3_5MultiTokenPredictor.forward` is `fc(cat[pre_fc_norm_embedding(inputs_embeds), pre_fc_norm_hidden(h)])`, one
full-attention `Qwen3_5DecoderLayer` at the target's positions, `norm`, and the shared `lm_head`). It runs in plain
torch on transformers' model (vision tower, language model, rotary and decoder-layer class) and the checkpoint's own
`mtp.*` tensors, and shares no code with qvl's MTP layer (qvl.bridges.qwen3_5_vl, qvl.bridges.mtp_inputs) or qvl's
reference head (qvl.bridges.mtp_reference): a defect made on both qvl sides at once fails here.

qvl's side is the Megatron model as training builds it (tests/tiny_megatron.py), run as `qvl convert verify` runs it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from qvl.bridges.tiny_model import write_tiny_hf_checkpoint
from qvl.foundation import distributed

CASES = {"dense": ("qwen3_5_vl", None), "moe": ("qwen3_5_vl_moe", "3.6")}  # Qwen3.6 MoE: its experts stored packed


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's Qwen3_5RMSNorm (GemmaRMSNorm): in fp32, scaled by (1 + weight)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def target_model_inputs(hf_model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target model's input embeddings [b, s, h], vision features at the placeholders; its mRoPE positions):
    vLLM's `embed_input_ids` writes each modality's features into the rows its placeholder ids mark."""
    model, ids = hf_model.model, inputs["input_ids"]
    embeds = model.get_input_embeddings()(ids).clone()
    config = hf_model.config
    for pixels, grid, token in (("pixel_values", "image_grid_thw", config.image_token_id),
                                ("pixel_values_videos", "video_grid_thw", config.video_token_id)):  # fmt: skip
        if pixels in inputs:
            features = torch.cat(model.get_image_features(inputs[pixels], inputs[grid]).pooler_output)
            embeds[ids == token] = features.to(embeds.dtype)
    positions = model.compute_3d_position_ids(
        input_ids=ids,
        inputs_embeds=embeds,
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        attention_mask=inputs.get("attention_mask"),
        mm_token_type_ids=inputs.get("mm_token_type_ids"),
    )
    return embeds, positions


def served_mtp_logits(hf_model, mtp: dict[str, torch.Tensor], inputs: dict, *, placeholders: bool = False):
    """The drafter's logits [b, s - 1, V] for every position with a next token: position i reads the target's last
    hidden state (after its final norm) at i and the input embedding of token i + 1. `placeholders`: the token
    embedding there instead (Megatron-Core's convention), to show the inputs tell the two apart."""
    text = hf_model.model.language_model
    config, eps = text.config, text.config.rms_norm_eps
    embeds, positions = target_model_inputs(hf_model, inputs)
    hidden = text(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    ahead = hf_model.model.get_input_embeddings()(inputs["input_ids"]) if placeholders else embeds
    drafter_embeds, hidden, positions = ahead[:, 1:], hidden[:, :-1], positions[..., :-1]
    x = torch.cat([zero_centred_rms_norm(drafter_embeds, mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                   zero_centred_rms_norm(hidden, mtp["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)  # fmt: skip
    x = x @ mtp["mtp.fc.weight"].t()  # ColumnParallelLinear(2H -> H, bias=False, gather_output=True)
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = ["full_attention"]  # vLLM builds Qwen3_5DecoderLayer(layer_type="full_attention")
    layer = type(text.layers[0])(layer_config, 0).to(x.dtype)
    prefix = "mtp.layers.0."
    layer.load_state_dict({k[len(prefix) :]: v for k, v in mtp.items() if k.startswith(prefix)}, strict=True)
    length = x.shape[1]
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    # vLLM's layer returns (hidden, residual) and its final norm adds them; transformers' returns the sum
    x = layer(x, position_embeddings=text.rotary_emb(x, positions), attention_mask=causal)
    return hf_model.lm_head(zero_centred_rms_norm(x, mtp["mtp.norm.weight"], eps)).float()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, dict]:
    """Per case: the tiny checkpoint, the verify inputs (two images and a video), the transcription's MTP logits
    (and with placeholder embeddings), and qvl's Megatron model."""
    from transformers import AutoModelForImageTextToText

    from qvl.bridges.verify import reference_inputs
    from qvl.foundation import runtime
    from tests.tiny_megatron import tiny_megatron_model

    runtime.activate(force=True)
    distributed.init_distributed()
    root, cases = tmp_path_factory.mktemp("mtp_served"), {}
    for name, (family, release) in CASES.items():
        hf = write_tiny_hf_checkpoint(root / name, family, seed=5, release=release)
        inputs = reference_inputs(hf, video=True)
        hf_model = AutoModelForImageTextToText.from_pretrained(str(hf), dtype=torch.float32).eval()
        mtp = {k: v for k, v in load_file(str(hf / "model.safetensors")).items() if k.startswith("mtp.")}
        with torch.no_grad():
            logits = served_mtp_logits(hf_model, mtp, inputs)
            placeholder_logits = served_mtp_logits(hf_model, mtp, inputs, placeholders=True)
        model, _ = tiny_megatron_model(family, hf=hf)
        cases[name] = dict(hf=hf, inputs=inputs, logits=logits, placeholder_logits=placeholder_logits, model=model)
    yield cases
    distributed.destroy_distributed()
    runtime.deactivate()


def qvl_mtp_logits(case: dict) -> torch.Tensor:
    """qvl's MTP logits [b, s - 1, V] where a next token exists, as `qvl convert verify` computes them."""
    from qvl.bridges.verify import megatron_logits

    length = case["inputs"]["input_ids"].shape[1]
    ours = megatron_logits([case["model"]], case["inputs"], mtp=True)
    return ours[:, length : 2 * length - 1, : case["logits"].shape[-1]]


def reference_mtp_logits(case: dict) -> torch.Tensor:
    """qvl's reference head's MTP logits [b, s - 1, V] (qvl.bridges.mtp_reference, what verify compares with)."""
    from qvl.bridges.verify import hf_logits_and_mtp

    return hf_logits_and_mtp(case["hf"], case["inputs"])[1][:, :-1]


def test_inputs_follow_images_and_a_video_and_tell_the_conventions_apart(served):
    ids = served["dense"]["inputs"]["input_ids"][0]
    config = served["dense"]["model"].config
    for token in (config.image_token_id, config.video_token_id):
        assert (ids == token).sum() > 0 and (ids[(ids == token).nonzero().max() + 1 :] != token).any()
    for case in served.values():  # the placeholder embedding gives other MTP logits after the first image
        assert (case["logits"] - case["placeholder_logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(CASES))
def test_qvl_mtp_logits_are_the_served_ones_with_images_and_video(served, name):
    case = served[name]
    torch.testing.assert_close(qvl_mtp_logits(case), case["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(reference_mtp_logits(case), case["logits"], rtol=0, atol=1e-5)


def _swap_concatenation(monkeypatch) -> None:
    """Both qvl sides with [hidden, embedding] instead of [embedding, hidden] before `fc` / `eh_proj`."""
    from qvl.bridges import mtp_reference, qwen3_5_vl

    def megatron_swapped(self, hidden_states, decoder_input):
        both = torch.cat((self.hnorm(hidden_states), self.enorm(decoder_input)), -1)
        return self.eh_proj(both)[0]  # one TP rank, no sequence parallelism: nothing to gather or scatter

    def reference_swapped(self, hidden, next_embeddings, position_embeddings, attention_mask, depth=0):
        x = self.fc(torch.cat([self.pre_fc_norm_hidden(hidden), self.pre_fc_norm_embedding(next_embeddings)], -1))
        x = self.layers[depth](x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.norm(x)

    monkeypatch.setattr(qwen3_5_vl.MultiTokenPredictionLayer, "_concat_embeddings", megatron_swapped)
    monkeypatch.setattr(mtp_reference.Qwen35MtpHead, "forward", reference_swapped)


@pytest.mark.parametrize("name", list(CASES))
def test_a_concatenation_order_swapped_on_both_qvl_sides_fails(served, name, monkeypatch):
    case = served[name]
    _swap_concatenation(monkeypatch)
    ours = qvl_mtp_logits(case)
    torch.testing.assert_close(ours, reference_mtp_logits(case), rtol=0, atol=1e-5)  # qvl's own check passes
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(ours, case["logits"], rtol=0, atol=1e-5)
