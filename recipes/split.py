"""Non-uniform pipeline split: the vision tower's cost on stage 0, the LM head's on the last stage.

Megatron-Bridge puts the whole vision encoder (and the embedding) on the first pipeline stage and the
output layer on the last. With a uniform split that stage is the bottleneck. `balanced_split` picks
`num_layers_in_first_pipeline_stage` / `..._last_...` so the slowest stage is as fast as possible, under
Megatron-Core's constraints (middle stages equal; with VPP every stage's count divisible by it).
Costs are forward FLOPs from `qvl.foundation.cost` for an assumed workload (`Workload`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qvl.foundation.cost import LMShape, VisionShape, decoder_layer_flops, head_flops, vision_flops
from qvl.foundation.errors import ConfigError


@dataclass(kw_only=True, slots=True, frozen=True)
class Workload:
    """What a packed sequence holds, for cost estimates (the defaults are a typical image SFT mix)."""

    seq_length: int
    sample_tokens: int = 1024  # mean length of a sub-sequence (one conversation) in a pack
    vision_token_fraction: float = 0.5  # share of LM tokens that are image tokens
    patches_per_image: int = 1024  # ViT patches per image (32 x 32 at patch 14 = 448 px)

    def sub_sequences(self) -> list[int]:
        """The pack's sub-sequence lengths."""
        n, rest = divmod(self.seq_length, min(self.sample_tokens, self.seq_length))
        return [min(self.sample_tokens, self.seq_length)] * n + ([rest] if rest else [])

    def images(self, merge: int) -> list[int]:
        """Patches of each image in one pack (an LM image token is merge**2 patches)."""
        vision_patches = self.vision_token_fraction * self.seq_length * merge * merge
        n = int(vision_patches // self.patches_per_image)
        return [self.patches_per_image] * n


def workload_of_dataset(report: dict, *, seq_length: int, merge: int) -> Workload | None:
    """The workload a `qvl data prepare` report.json describes (mean sub-sequence length, the tower's patches per LM
    token, patches per image or video), for a model whose LM image token is merge**2 patches; None for a report
    without the vision counts (written before they were kept) or without samples."""
    samples, tokens = report.get("accepted", 0), report.get("total_tokens", 0)
    if not samples or not tokens or "vision_patches" not in report:
        return None
    # a preference dataset accepts pairs: two sub-sequences each, whose shared images the tower encodes once (the
    # report counts them once)
    sides = 2 if report.get("kind") == "preference" else 1
    media, vision_patches = report.get("media", 0), report["vision_patches"]
    return Workload(
        seq_length=seq_length,
        sample_tokens=max(round(tokens / (samples * sides)), 1),
        vision_token_fraction=vision_patches / merge**2 / tokens,
        patches_per_image=max(round(vision_patches / media), 1) if media else 1,
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class StageCosts:
    """Forward FLOPs per pack: one LM layer, the vision tower (stage 0) and the LM head (last stage)."""

    layer: float
    vision: float
    head: float


@dataclass(kw_only=True, slots=True, frozen=True)
class Split:
    """Layers per pipeline stage and each stage's forward FLOPs per pack."""

    layers: tuple[int, ...]
    costs: tuple[float, ...]

    @property
    def first(self) -> int:
        return self.layers[0]

    @property
    def last(self) -> int:
        return self.layers[-1]

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage (1.0 = perfect balance)."""
        return max(self.costs) / (sum(self.costs) / len(self.costs))


def stage_costs(lm: LMShape, vision: VisionShape | None, workload: Workload) -> StageCosts:
    """Per-pack forward FLOPs of one LM layer, the vision tower and the LM head."""
    subs = workload.sub_sequences()
    one_layer = decoder_layer_flops(lm, subs)  # a hybrid LM's mean layer (Gated DeltaNet and attention)
    head = head_flops(lm, subs)  # output layer and MTP layers
    images = workload.images(vision.spatial_merge_size) if vision else []
    return StageCosts(layer=one_layer, vision=vision_flops(vision, images) if images else 0.0, head=head)


def split_from_counts(layers: list[int], costs: StageCosts) -> Split:
    """The Split for explicit per-stage layer counts."""
    stage = [n * costs.layer for n in layers]
    stage[0] += costs.vision
    stage[-1] += costs.head
    return Split(layers=tuple(layers), costs=tuple(stage))


def counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Per-stage layer counts for Megatron's first/last settings (None = uniform share)."""
    if pp == 1:
        return [num_layers]
    first_n = first if first is not None else num_layers // pp
    last_n = last if last is not None else num_layers // pp
    middle = pp - 2
    rest = num_layers - first_n - last_n
    return [first_n] + ([rest // middle] * middle if middle else []) + [last_n]


def check_split(num_layers: int, pp: int, vpp: int | None, first: int, last: int) -> str | None:
    """Why Megatron-Core would reject this first/last split, or None when it is valid."""
    v = vpp or 1
    middle, rest = pp - 2, num_layers - first - last
    if first < v or last < v or first % v or last % v:
        return f"first={first} and last={last} must be positive multiples of virtual_pipeline={v}"
    if middle == 0:
        return None if rest == 0 else f"first+last={first + last} must equal num_layers={num_layers} at PP=2"
    if rest < middle * v or rest % middle or (rest // middle) % v:
        return f"the {rest} middle layers do not divide into {middle} stages of a multiple of {v}"
    return None


def balanced_split(num_layers: int, pp: int, vpp: int | None, costs: StageCosts) -> Split:
    """The valid first/last split that minimises the slowest stage (ties: the most uniform one)."""
    if pp == 1:
        return split_from_counts([num_layers], costs)
    best: tuple[float, int, Split] | None = None
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            if check_split(num_layers, pp, vpp, first, last):
                continue
            split = split_from_counts(counts(num_layers, pp, first, last), costs)
            key = (max(split.costs), max(split.layers) - min(split.layers))
            if best is None or key < best[:2]:
                best = (*key, split)
    if best is None:
        raise ConfigError(
            f"no pipeline split of {num_layers} layers fits pipeline_parallel={pp}"
            f"{f', virtual_pipeline={vpp}' if vpp else ''}; use a pipeline_parallel whose stages "
            f"get at least {vpp or 1} layer(s) each"
        )
    return best[2]


def parse_split(text: str, num_layers: int, pp: int, vpp: int | None) -> tuple[int, int] | None:
    """`pipeline_split` = "FIRST,LAST" -> (first, last), checked; "uniform" -> None."""
    if text == "uniform":
        if num_layers % (pp * (vpp or 1)):
            raise ConfigError(
                f"pipeline_split=uniform: {num_layers} layers do not divide into {pp} stages"
                f"{f' x {vpp} virtual' if vpp else ''}; use pipeline_split=auto"
            )
        return None
    try:
        first, last = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"pipeline_split={text!r}: use auto, uniform, or FIRST,LAST (e.g. 6,8)") from None
    problem = check_split(num_layers, pp, vpp, first, last)
    if problem:
        raise ConfigError(f"pipeline_split={text!r}: {problem}; use pipeline_split=auto")
    return first, last
