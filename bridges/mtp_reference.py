"""Qwen3.5's multi-token-prediction (MTP) head as published, to check qvl's Megatron MTP against.

Released Qwen3.5 / 3.6 / 3.8 checkpoints carry one MTP layer under `mtp.*`, but transformers (up to 5.24) builds
no module for it: `Qwen3_5PreTrainedModel._keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`. The definition the
serving engines implement (vLLM's `Qwen3_5MultiTokenPredictor`,
https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen3_5_mtp.py) is:

    x_i    = fc(cat[pre_fc_norm_embedding(embed(token_{i+1})), pre_fc_norm_hidden(h_i)])    # fc: 2H -> H, no bias
    y_i    = norm(layers[k](x_i))             # one full-attention decoder layer of the main model's kind
    logits = lm_head(y_i)                      # predicts token_{i+2}

with `h_i` the main model's last hidden state after its final norm, the embedding and head shared with the main
model, the norms zero-centred (`(1 + w)`) like every Qwen3.5 norm, and the layer at the main model's positions
(mRoPE included). `Qwen35MtpHead` is that module, built from transformers' own decoder-layer and norm classes of
the checkpoint, so the comparison shares nothing with Megatron-Core's MTP block but the weights.

Token embeddings: where token i + 1 is an image or video placeholder, the MTP input is that position's vision
features, the row the main model's language model takes there (vision merged), as vLLM's drafter and SGLang feed it,
not the placeholder token's embedding (Megatron-Core's `MultiTokenPredictionLayer`, which qvl's MTP layer replaces
there: qvl.bridges.mtp_inputs). It matters beyond the placeholders: the MTP layer's attention sees every earlier
position's input, so the text after an image predicts differently (tests/bridges/test_mtp_as_served.py).

On disk the MoE MTP experts are per expert (`mtp.layers.0.mlp.experts.3.gate_proj.weight`, Qwen3.5) or packed
(`mtp.layers.0.mlp.experts.gate_up_proj` [E, 2I, H], gate first, Qwen3.6); both load here.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from qvl.foundation.errors import ConversionError

logger = logging.getLogger(__name__)

MTP_PREFIX = "mtp."
_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")  # HF `mtp.layers.0.` or Megatron `...mtp.layers.0.`
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen35MtpHead(torch.nn.Module):
    """The published Qwen3.5 MTP module: fc, two pre-fc norms, `layers` decoder layers, a final norm."""

    def __init__(self, text_config, decoder_layer_class: type, norm_class: type, layers: int):
        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        layer_config = copy.deepcopy(text_config)
        layer_config.layer_types = ["full_attention"] * layers  # MTP layers are full attention in every release
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=eps)
        self.layers = torch.nn.ModuleList(decoder_layer_class(layer_config, i) for i in range(layers))
        self.norm = norm_class(hidden, eps=eps)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeddings: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        depth: int = 0,
    ) -> torch.Tensor:
        """The head's output states [b, s, H] (before the shared output layer) at prediction depth `depth`."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)], -1))
        x = self.layers[depth](x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.norm(x)


def mtp_head_for(hf_model, layers: int) -> Qwen35MtpHead:
    """A randomly initialised MTP head of `layers` layers matching an HF Qwen3.5 model's language model."""
    language_model = hf_model.model.language_model
    head = Qwen35MtpHead(
        language_model.config,
        decoder_layer_class=type(language_model.layers[0]),
        norm_class=type(language_model.norm),
        layers=layers,
    )
    with torch.no_grad():  # as transformers initialises: normal weights, zero-centred norms at zero ((1 + w) = 1)
        for name, param in head.named_parameters():
            param.zero_() if "norm" in name else param.normal_(0.0, language_model.config.initializer_range)
    return head.to(next(hf_model.parameters()).dtype)


def checkpoint_mtp_names(hf_path: Path) -> list[str]:
    """Names of the `mtp.*` tensors in an HF checkpoint directory's safetensors files."""
    names = []
    for path in sorted(Path(hf_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += [name for name in f.keys() if name.startswith(MTP_PREFIX)]
    return sorted(names)


def mtp_layer_count(names: list[str]) -> int:
    """How many MTP layers the tensor names hold (HF `mtp.layers.N.*`, Megatron `language_model.mtp.layers.N.*`)."""
    return len({int(m.group(1)) for m in map(_LAYER.search, names) if m})


def read_mtp_tensors(hf_path: Path) -> dict[str, torch.Tensor]:
    """Every `mtp.*` tensor of a checkpoint, by its on-disk name."""
    tensors = {}
    for path in sorted(Path(hf_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(MTP_PREFIX)})
    return tensors


def to_disk_layout(state: dict[str, torch.Tensor], *, packed: bool) -> dict[str, torch.Tensor]:
    """A head's state dict as a checkpoint's `mtp.*` tensors: experts packed, or split per expert."""
    disk = {}
    for name, tensor in state.items():
        key = MTP_PREFIX + name
        if packed or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            disk[key] = tensor.contiguous()
            continue
        base = key.rsplit(".", 1)[0]
        for expert, weight in enumerate(tensor):
            if name.endswith("gate_up_proj"):
                gate, up = weight.chunk(2, dim=0)
                disk[f"{base}.{expert}.gate_proj.weight"] = gate.contiguous()
                disk[f"{base}.{expert}.up_proj.weight"] = up.contiguous()
            else:
                disk[f"{base}.{expert}.down_proj.weight"] = weight.contiguous()
    return disk


def pack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every per-expert MoE weight (`....mlp.experts.3.gate_proj.weight`) packed per layer into
    `....mlp.experts.gate_up_proj` [E, 2I, H] (gate first) and `....mlp.experts.down_proj` [E, H, I]."""
    packed, experts = {}, {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match:
            experts.setdefault(match.group(1), {}).setdefault(match.group(3), {})[int(match.group(2))] = tensor
        else:
            packed[name] = tensor
    for base, parts in experts.items():
        stack = lambda part: torch.stack([parts[part][e] for e in sorted(parts[part])])  # noqa: E731
        packed[f"{base}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        packed[f"{base}.down_proj"] = stack("down_proj")
    return packed


def from_disk_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's `mtp.*` tensors as the head's state dict (experts packed, as transformers holds them)."""
    return {name[len(MTP_PREFIX) :]: tensor for name, tensor in pack_experts(tensors).items()}


def load_mtp_head(hf_model, hf_path: Path) -> Qwen35MtpHead:
    """The checkpoint's MTP head with its weights (strict: every tensor used, every parameter set)."""
    tensors = read_mtp_tensors(hf_path)
    if not tensors:
        raise ConversionError(f"{hf_path} has no mtp.* tensors; there is no MTP head to compare")
    head = mtp_head_for(hf_model, mtp_layer_count(list(tensors)))
    state = from_disk_layout(tensors)
    missing, unexpected = head.load_state_dict({k: v.to(head.fc.weight.dtype) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ConversionError(
            f"{hf_path}: the mtp.* tensors do not match the published MTP head (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); the checkpoint's MTP weights are not Qwen3.5's"
        )
    return head


def hf_logits_with_mtp(hf_model, head: Qwen35MtpHead, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, MTP logits at depth 1), each [b, s, V] in fp32, without gradients (`logits_with_mtp`)."""
    with torch.no_grad():
        main, mtp = logits_with_mtp(hf_model, head, inputs)
    return main.float(), mtp.float()


def logits_with_mtp(hf_model, head: Qwen35MtpHead, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, MTP logits at depth 1), each [b, s, V]: position i of the MTP logits predicts token i + 2 from
    the main model's state at i and token i + 1, its vision features where it is a placeholder (the last position
    sees token id 0, as Megatron-Core's rolled input does). Differentiable: the MTP loss reaches the main model, the
    shared embedding, the vision tower and the output head."""
    from transformers.masking_utils import create_causal_mask

    model = hf_model.model
    ids = inputs["input_ids"]
    embed = model.get_input_embeddings()
    positions = model.compute_3d_position_ids(
        input_ids=ids,
        inputs_embeds=embed(ids).detach(),  # read for its shape and device only
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        attention_mask=inputs.get("attention_mask"),
        mm_token_type_ids=inputs.get("mm_token_type_ids"),
    )
    merged = merged_embeddings(model, inputs)  # the language model's input, as transformers' model forward makes it
    language_model = model.language_model
    hidden = language_model(
        input_ids=None, position_ids=positions, attention_mask=inputs.get("attention_mask"), inputs_embeds=merged
    ).last_hidden_state  # after the final norm
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, ids.shape[0], -1)
    rotary = language_model.rotary_emb(hidden, positions)
    mask = create_causal_mask(
        config=language_model.config,
        inputs_embeds=hidden,
        attention_mask=inputs.get("attention_mask"),
        past_key_values=None,
    )
    next_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0)
    # the table without transformers' `padding_idx`: Megatron-Core's embedding has none, and the filler id 0 at each
    # last position reaches the table's row 0 through the MTP layer's MoE load-balancing loss (not through a target)
    next_embeddings = torch.nn.functional.embedding(next_ids, embed.weight)
    vision = torch.isin(next_ids, torch.tensor([hf_model.config.image_token_id, hf_model.config.video_token_id]))
    merged_ahead = torch.nn.functional.pad(merged[:, 1:], (0, 0, 0, 1))
    next_embeddings = torch.where(vision.unsqueeze(-1), merged_ahead.to(next_embeddings.dtype), next_embeddings)
    mtp = hf_model.lm_head(head(hidden, next_embeddings, rotary, mask))
    return hf_model.lm_head(hidden), mtp


def merged_embeddings(model, inputs: dict) -> torch.Tensor:
    """Token embeddings with the vision features placed at their placeholders: the input transformers' Qwen3.5 model
    forward (modeling_qwen3_5.py, `Qwen3_5Model.forward`) hands its language model, made the same way."""
    ids = inputs["input_ids"]
    embeds = model.get_input_embeddings()(ids)
    for pixels, grid, features, kind in (
        (inputs.get("pixel_values"), inputs.get("image_grid_thw"), model.get_image_features, "image_features"),
        (inputs.get("pixel_values_videos"), inputs.get("video_grid_thw"), model.get_video_features, "video_features"),
    ):
        if pixels is None:
            continue
        rows = torch.cat(features(pixels, grid, return_dict=True).pooler_output, dim=0).to(embeds.device, embeds.dtype)
        image_mask, video_mask = model.get_placeholder_mask(ids, inputs_embeds=embeds, **{kind: rows})
        embeds = embeds.masked_scatter(image_mask if kind == "image_features" else video_mask, rows)
    return embeds


def mtp_layers_in_checkpoint(hf_path: Path, configured: int) -> int:
    """How many MTP layers to build for an HF checkpoint whose config says `configured`: that many when its `mtp.*`
    tensors hold them, 0 when it has none (an export from a trainer that drops the head); any other count is an
    error naming the field to fix."""
    found = mtp_layer_count(checkpoint_mtp_names(hf_path))
    if configured and not found:
        logger.warning(
            "%s/config.json says mtp_num_hidden_layers=%d but the checkpoint has no mtp.* tensors: converting it "
            "without its multi-token-prediction head",
            hf_path,
            configured,
        )
        return 0
    if found != configured:
        raise ConversionError(
            f"{hf_path}/config.json says mtp_num_hidden_layers={configured}, but its mtp.* tensors hold {found} "
            f"layer(s); set text_config.mtp_num_hidden_layers to {found} in config.json"
        )
    return found
