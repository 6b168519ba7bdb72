"""Fixtures for recipe tests: tiny HF checkpoint dirs (config only) from qvl.bridges.tiny_model's shrunk configs."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """family -> a directory holding only the tiny model's config.json."""
    from qvl.bridges.tiny_model import tiny_hf_config
    from qvl.foundation.families import FAMILIES

    root = tmp_path_factory.mktemp("tiny_hf")
    dirs = {}
    for family in FAMILIES:
        tiny_hf_config(family).save_pretrained(root / family)
        dirs[family] = root / family
    return dirs
