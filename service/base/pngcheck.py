"""Does a PNG's compressed image data hold every row? Pillow fills the rows of a zlib stream that ends early
(properly terminated, so nothing looks truncated) with zeros and reports no error: a 6,324-row image whose
stream stops after 10 rows would be classified as mostly black. This inflates the IDAT stream once more,
counting bytes without keeping them, and compares with what the header promises."""

from __future__ import annotations

import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
# Adam7 passes: (x start, y start, x step, y step)
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_STEP = 1 << 20  # inflate at most this much at a time: memory stays flat whatever the image


def _raw_size(width: int, height: int, depth: int, colour: int, interlaced: bool) -> int:
    bits = _CHANNELS.get(colour, 4) * depth

    def rows(w: int, h: int) -> int:
        return 0 if w == 0 or h == 0 else h * (1 + (w * bits + 7) // 8)

    if not interlaced:
        return rows(width, height)
    return sum(rows((width - x0 + dx - 1) // dx if width > x0 else 0, (height - y0 + dy - 1) // dy if height > y0
                    else 0) for x0, y0, dx, dy in _ADAM7)


def missing_rows(data: bytes) -> tuple[int, int] | None:
    """(rows present, rows promised) when `data` is a PNG whose image data ends early; None otherwise (also for
    anything that is not a PNG, or one too damaged to tell: Pillow reports those itself)."""
    if not data.startswith(SIGNATURE):
        return None
    pos, header, chunks = len(SIGNATURE), None, []
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR" and len(body) >= 13:
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            chunks.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if header is None or not chunks:
        return None
    width, height, depth, colour, _, _, interlace = header
    expected = _raw_size(width, height, depth, colour, interlace == 1)
    inflater = zlib.decompressobj()
    produced = 0
    try:
        for chunk in chunks:
            buf = chunk
            while buf and not inflater.eof:
                produced += len(inflater.decompress(buf, _STEP))
                buf = inflater.unconsumed_tail
            if inflater.eof or produced >= expected:
                break
        while not inflater.eof and produced < expected:
            out = inflater.decompress(b"", _STEP)  # what is still buffered inside the inflater
            if not out:
                break
            produced += len(out)
    except zlib.error:
        return None
    if produced >= expected:
        return None
    return produced // max(1, expected // height), height  # (rows of an interlaced image: about)
