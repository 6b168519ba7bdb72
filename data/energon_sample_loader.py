"""Energon's typed view of a `qvl data prepare` dataset: copied as `.nv-meta/sample_loader.py` next to the dataset.

Energon's own tools (`energon info`, `energon lint`, `get_train_dataset(..., task_encoder=DefaultTaskEncoder())`)
read a dataset through a sample type and a loader function named in `dataset.yaml`
(https://nvidia.github.io/Megatron-Energon/basic/data_prep.html, "sample_loader.py"). This module is that loader:
it imports nothing of qvl, so a user with Energon alone can inspect and load the data. It maps one pack to an
`InterleavedSample`: for each packed sub-sample its images (decoded by Energon) followed by its token ids as a
space-separated string. qvl's own loader reads the same shards through the crude config `dataset_qvl.yaml`.
"""


def sample_loader(raw: dict) -> dict:
    """One pack (Energon's decoded tar members) -> the fields of an InterleavedSample."""
    meta, ids = raw["json"], raw["ids.npy"]
    sequence, start = [], 0
    for sub in meta["subs"]:
        for media in sub["media"]:
            members = media.get("members") or [media["member"]]
            sequence.extend(raw[name] for name in members)
        sequence.append(" ".join(str(int(t)) for t in ids[start : start + sub["length"]]))
        start += sub["length"]
    return {"sequence": sequence}


def part_filter(part: str) -> bool:
    """The tar members the loader reads (all of them: metadata, token ids, loss mask, media)."""
    return True
