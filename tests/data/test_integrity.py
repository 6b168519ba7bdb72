"""The structure / CRC image check rejects every truncated file a full decode rejects, and more."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from qvl.data.integrity import CorruptImage, check_jpeg, check_png


def _encoded(fmt: str, **save) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def _decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
        return True
    except (OSError, SyntaxError, ValueError):
        return False


def _passes(data: bytes) -> bool:
    try:
        return check_png(data) is None if data.startswith(b"\x89PNG") else check_jpeg(data)
    except CorruptImage:
        return False


@pytest.mark.parametrize("fmt, save", [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {})])
def test_every_truncation_a_decode_rejects_is_rejected(fmt, save):
    data = _encoded(fmt, **save)
    assert _passes(data) and _decodes(data)
    cuts = range(1, len(data), max(1, len(data) // 300))
    missed = [cut for cut in cuts if _decodes(data[:cut]) and _passes(data[:cut])]
    assert not [cut for cut in cuts if not _decodes(data[:cut]) and _passes(data[:cut])]
    # Where the decode lets a cut through (the last bytes of a JPEG), the check still refuses it.
    assert missed == [] or fmt == "PNG"


def test_flipped_bits_in_png_pixel_data_fail_the_crc():
    data = bytearray(_encoded("PNG"))
    rng = random.Random(0)
    start = data.index(b"IDAT") + 4
    for _ in range(50):
        flipped = bytearray(data)
        flipped[rng.randrange(start, len(data) - 16)] ^= 1 << rng.randrange(8)
        assert not _passes(bytes(flipped))
