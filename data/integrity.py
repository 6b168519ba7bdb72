"""Image integrity without decoding pixels: a JPEG's marker structure and a PNG's chunk CRCs.

Decoding every pixel was more than half of `qvl data prepare`'s time, yet what it catches in a JPEG is a file
that ends early: libjpeg raises on truncation and only warns on corrupt entropy-coded data (PIL then returns
the damaged pixels). Walking the markers catches every truncation the decode catches, and more (a file cut
just before its EOI marker decodes "fine"), plus bogus segment lengths and Huffman / quantisation tables and
SOF / SOS headers, at memory speed. A PNG's CRC-32 per chunk catches any flipped byte, including inside the
pixel data where a decode would not notice. JPEGs other than baseline / extended / progressive Huffman
(arithmetic coding, lossless, hierarchical) and every other format still get the full decode.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

from PIL import Image

_ENTROPY_END = re.compile(rb"\xff[^\x00\xd0-\xd7]")  # the first marker after a scan's entropy-coded data
_HUFFMAN_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended, progressive; others fall back to a decode
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class CorruptImage(ValueError):
    """The file's structure is broken (truncated, bad lengths or tables, CRC mismatch)."""


def check_image_file(path, image: Image.Image) -> None:
    """Raise CorruptImage (or PIL's own error) if the image at `path`, opened as `image`, is not intact."""
    if image.format == "JPEG":
        data = _read(path)
        if check_jpeg(data):
            return
    elif image.format == "PNG":
        check_png(_read(path))
        return
    image.load()  # every other format, and unusual JPEG codings: a full decode


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_jpeg(data: bytes) -> bool:
    """Walk a JPEG's markers to its EOI; True if it is intact, False if its coding needs a full decode to check."""
    if data[:2] != b"\xff\xd8":
        raise CorruptImage("no JPEG start-of-image marker")
    pos, end = 2, len(data)
    frame = _Frame()
    while True:
        if pos >= end:
            raise CorruptImage(f"image file is truncated (no end-of-image marker after {end} bytes)")
        if data[pos] != 0xFF:
            raise CorruptImage(f"expected a JPEG marker at byte {pos}, found 0x{data[pos]:02x}")
        while pos < end and data[pos] == 0xFF:  # fill bytes may precede a marker
            pos += 1
        if pos >= end:
            raise CorruptImage("image file is truncated inside a marker")
        marker = data[pos]
        pos += 1
        if marker == 0xD9:
            return True
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            continue
        if pos + 2 > end:
            raise CorruptImage("image file is truncated inside a segment header")
        length = int.from_bytes(data[pos : pos + 2], "big")
        segment_end = pos + length
        if length < 2 or segment_end > end:
            raise CorruptImage(f"image file is truncated (segment 0xFF{marker:02X} of {length} bytes at byte {pos})")
        body = data[pos + 2 : segment_end]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if marker not in _HUFFMAN_SOF:
                return False
            _check_sof(body, frame, progressive=marker == 0xC2)
        elif marker == 0xC4:
            _check_dht(body, frame)
        elif marker == 0xDB:
            _check_dqt(body, frame)
        elif marker == 0xDA:
            _check_sos(body, frame)
            found = _ENTROPY_END.search(data, segment_end)
            if found is None:
                raise CorruptImage("image file is truncated (scan data without an end-of-image marker)")
            segment_end = found.start()
        pos = segment_end


@dataclass(slots=True)
class _Frame:
    """What the segments so far defined: the tables the frame and its scans may refer to."""

    components: dict[int, int] = field(default_factory=dict)  # component id -> quantisation table
    quant_tables: set[int] = field(default_factory=set)
    huffman_tables: set[tuple[int, int]] = field(default_factory=set)  # (class 0 = DC / 1 = AC, id)
    progressive: bool = False


def _check_sof(body: bytes, frame: _Frame, *, progressive: bool) -> None:
    if frame.components:
        raise CorruptImage("a second frame header (SOF)")
    if len(body) < 6 or len(body) != 6 + 3 * body[5] or body[5] == 0 or body[0] != 8:
        raise CorruptImage("bogus frame header (SOF)")
    if int.from_bytes(body[1:3], "big") == 0 or int.from_bytes(body[3:5], "big") == 0:
        raise CorruptImage("frame header (SOF) with an empty image size")
    for k in range(body[5]):
        component, sampling, table = body[6 + 3 * k : 9 + 3 * k]
        if not 1 <= sampling >> 4 <= 4 or not 1 <= sampling & 0x0F <= 4 or table > 3 or component in frame.components:
            raise CorruptImage("bogus component in the frame header (SOF)")
        frame.components[component] = table
    frame.progressive = progressive


def _check_dht(body: bytes, frame: _Frame) -> None:
    pos = 0
    while pos < len(body):
        if pos + 17 > len(body) or (body[pos] >> 4) > 1 or (body[pos] & 0x0F) > 3:
            raise CorruptImage("bogus Huffman table definition")
        table_class, counts = body[pos] >> 4, body[pos + 1 : pos + 17]
        code = 0
        for bits, n in enumerate(counts, start=1):  # the canonical codes must fit in their bit lengths (libjpeg)
            code += n
            if code > 1 << bits:
                raise CorruptImage("bogus Huffman table definition")
            code <<= 1
        symbols = body[pos + 17 : pos + 17 + sum(counts)]
        if sum(counts) > 256 or len(symbols) < sum(counts) or (table_class == 0 and symbols and max(symbols) > 15):
            raise CorruptImage("bogus Huffman table definition")
        frame.huffman_tables.add((table_class, body[pos] & 0x0F))
        pos += 17 + len(symbols)


def _check_dqt(body: bytes, frame: _Frame) -> None:
    pos = 0
    while pos < len(body):
        precision, table = body[pos] >> 4, body[pos] & 0x0F
        pos += 1 + 64 * (2 if precision else 1)
        if precision > 1 or table > 3 or pos > len(body):
            raise CorruptImage("bogus quantization table definition")
        frame.quant_tables.add(table)


def _check_sos(body: bytes, frame: _Frame) -> None:
    if not body or not 1 <= body[0] <= 4 or len(body) != 4 + 2 * body[0]:
        raise CorruptImage("bogus scan header (SOS)")
    start, stop, approx = body[-3], body[-2], body[-1]
    if frame.progressive:
        dc_scan = start == 0
        if (dc_scan and stop != 0) or (not dc_scan and (stop < start or stop > 63 or body[0] != 1)):
            raise CorruptImage("invalid progressive parameters in the scan header (SOS)")
        if approx >> 4 > 13 or approx & 0x0F > 13:
            raise CorruptImage("invalid progressive parameters in the scan header (SOS)")
    for k in range(body[0]):
        component, tables = body[1 + 2 * k], body[2 + 2 * k]
        if component not in frame.components or frame.components[component] not in frame.quant_tables:
            raise CorruptImage("scan header (SOS) names a component or quantisation table that is not defined")
        needed = []
        if not frame.progressive or (start == 0 and approx >> 4 == 0):
            needed.append((0, tables >> 4))
        if not frame.progressive or start > 0:
            needed.append((1, tables & 0x0F))
        if not frame.progressive and stop == 0:
            needed.pop()
        if any(table not in frame.huffman_tables for table in needed):
            raise CorruptImage("scan header (SOS) uses a Huffman table that is not defined")


def check_png(data: bytes) -> None:
    """Check a PNG's signature, every chunk's length and CRC-32, and that it ends with IEND."""
    if data[:8] != _PNG_SIGNATURE:
        raise CorruptImage("no PNG signature")
    pos, end, seen_data = 8, len(data), False
    while True:
        if pos + 12 > end:
            raise CorruptImage(f"image file is truncated (no IEND chunk after {end} bytes)")
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        chunk_end = pos + 12 + length
        if chunk_end > end:
            raise CorruptImage(f"image file is truncated (chunk {kind!r} of {length} bytes at byte {pos})")
        crc = int.from_bytes(data[chunk_end - 4 : chunk_end], "big")
        if zlib.crc32(data[pos + 4 : chunk_end - 4]) != crc:
            raise CorruptImage(f"CRC mismatch in chunk {kind!r} at byte {pos}")
        seen_data |= kind == b"IDAT"
        if kind == b"IEND":
            if not seen_data:
                raise CorruptImage("PNG without image data (IDAT)")
            return
        pos = chunk_end
