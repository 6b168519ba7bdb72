"""Encode preference packs: qvl's packed batches plus which sub-sequences form a pair, and their reference log-probs.

A pack of a preference dataset (`qvl data prepare --kind preference`) holds whole pairs, each pair's chosen and
rejected sub-sequences adjacent, chosen first, listed in its json's `pairs`. `PreferenceTaskEncoder` encodes it as
the SFT encoder does (tokens, labels learning only each side's completion, mRoPE positions, vision inputs: every image
placeholder gets its pixel_values, a pair's shared image decoded once and given twice, and `image_sources` /
`video_sources` say so: the step gives the tower each distinct image of the micro-batch once, qvl.data.encode's
`deduplicate_vision`) and adds, per micro-batch:

- `pairs`: int64 [n_pairs, 2], the (chosen, rejected) sub-sequence indices within the micro-batch's concatenated
  `cu_seqlens_q`;
- with a reference table (qvl.data.reference, written by `qvl reference`): `reference_logps` float64 [n_subs] and
  `reference_tokens` int64 [n_subs], each sub-sequence's summed reference log-prob and its learned-token count;
- `packs`: the pack ids (meta["pack"]) of the micro-batch, in order.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import torch
from megatron.energon import edataclass, stateless

from qvl.data.encode import PackedBatch, PackedSample, PackRecord, QwenVLPackedTaskEncoder
from qvl.data.reference import ReferenceTable
from qvl.foundation.errors import DataError


@edataclass
class PreferenceSample(PackedSample):
    """One encoded preference pack: its pairs as sub-sequence indices within the pack."""

    pack: int
    pairs: torch.Tensor  # int64 [n_pairs, 2] (chosen, rejected)
    reference_logps: torch.Tensor | None = None  # float64 [n_subs]
    reference_tokens: torch.Tensor | None = None  # int64 [n_subs]


@edataclass
class PreferenceBatch(PackedBatch):
    """A micro-batch of preference packs: a PackedBatch whose sub-sequences pair up as `pairs` says."""

    pairs: torch.Tensor  # int64 [n_pairs, 2] indices into the sub-sequences of cu_seqlens_q, chosen first
    packs: list[int]  # meta["pack"] of each pack, in order
    reference_logps: torch.Tensor | None = None  # float64 [n_subs], with a reference table
    reference_tokens: torch.Tensor | None = None  # int64 [n_subs]


def _fields(instance: Any) -> dict:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


class PreferenceTaskEncoder(QwenVLPackedTaskEncoder):
    """Energon TaskEncoder for preference datasets: SFT's packed batches plus `pairs` and the reference columns.

    `reference`: a folder written by the reference pass (`REF/logps.npz`), loaded once; None for a run that needs
    none (SimPO, or adapters switched off). A pack without rows in it fails in one line naming the pack.
    `deduplicate_vision`: each distinct image of a micro-batch encoded once (qvl.data.encode), on by default."""

    def __init__(
        self,
        *,
        hf_path: pathlib.Path,
        family: str,
        reference: pathlib.Path | None = None,
        tokens_per_second: int | None = None,
        deduplicate_vision: bool = True,
        **vision_overrides,
    ):
        super().__init__(
            hf_path=hf_path,
            family=family,
            tokens_per_second=tokens_per_second,
            deduplicate_vision=deduplicate_vision,
            **vision_overrides,
        )
        self.reference = None if reference is None else ReferenceTable.load(reference)

    @stateless
    def encode_sample(self, sample: PackRecord) -> PreferenceSample:
        pairs = sample.meta.get("pairs")
        if pairs is None:
            raise DataError(
                f"pack {sample.meta['pack']} holds SFT conversations, not preference pairs; prepare the pairs with "
                "`qvl data prepare --kind preference ...`"
            )
        encoded = super().encode_sample(sample)
        columns = {}
        if self.reference is not None:
            logps, tokens = self.reference.for_pack(sample.meta["pack"], len(sample.meta["subs"]))
            columns = {
                "reference_logps": torch.as_tensor(logps, dtype=torch.float64),
                "reference_tokens": torch.as_tensor(tokens, dtype=torch.int64),
            }
        return PreferenceSample(
            **_fields(encoded),
            pack=int(sample.meta["pack"]),
            pairs=torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2),
            **columns,
        )

    @stateless
    def batch(self, samples: list[PreferenceSample]) -> PreferenceBatch:
        packed = super().batch(samples)
        first_sub = 0  # each pack's first sub-sequence in the micro-batch's cu_seqlens
        pairs = []
        for sample in samples:
            pairs.append(sample.pairs + first_sub)
            first_sub += len(sample.cu_seqlens) - 1
        columns = {}
        if self.reference is not None:
            columns = {
                "reference_logps": torch.cat([s.reference_logps for s in samples]),
                "reference_tokens": torch.cat([s.reference_tokens for s in samples]),
            }
        return PreferenceBatch(**_fields(packed), pairs=torch.cat(pairs), packs=[s.pack for s in samples], **columns)
