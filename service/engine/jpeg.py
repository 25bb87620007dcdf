"""JPEG decoding that refuses data that ends early.

Pillow hides libjpeg's warnings: a JPEG whose entropy-coded data stops mid-scan, followed by an end-of-image
marker (or anything libjpeg reads as a marker), decodes without an error, the missing blocks grey. libjpeg-turbo
through simplejpeg, with `strict`, raises on those warnings instead, and decodes the same pixels as Pillow (the
same library and settings: islow DCT, fancy upsampling; bit-identical in the tests). So JPEGs of Pillow mode L
or RGB are decoded here; others (CMYK) are checked here at 1/8 scale and decoded by Pillow.

A progressive JPEG cut at a scan boundary, then given an end-of-image marker, is valid to libjpeg: its
coefficients are just not refined. `unrefined` finds those from the scan headers alone.
"""

from __future__ import annotations

import re
import struct

import simplejpeg
from PIL import Image

from service.base.errors import ServiceError

# libjpeg's warnings that mean data is missing (everything else falls back to Pillow, which has its own checks:
# some encoders write a few extraneous bytes before a marker, harmless, and Pillow accepts those files)
_ENDS_EARLY = ("premature end of data segment", "premature end of jpeg file", "instead of rst")
# Pillow mode -> (libjpeg-turbo's output, the mode returned): laid out as Pillow keeps the mode in memory (RGB in 4
# bytes a pixel, as RGBX), so Image.frombuffer shares the array instead of copying it; preprocessing crops, then
# converts only the crop
_COLORSPACE = {"L": ("GRAY", "L"), "RGB": ("RGBX", "RGBX")}
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start of frame markers (not DHT, JPG, DAC)
_NEXT_MARKER = re.compile(rb"\xff+([^\x00\xd0-\xd7\xff])")  # after entropy-coded data: stuffing and RSTn skipped


def _ends_early(why: str) -> ServiceError:
    return ServiceError(422, f"JPEG data ends early (libjpeg: {why})", code="invalid_image")


def decode(data: bytes, header: Image.Image) -> Image.Image | None:
    """`data` decoded (mode L, or RGBX for an RGB JPEG), when `header` (Pillow's, only the header read) is a JPEG of
    mode L or RGB; None when Pillow should decode it (after the check here). 422 when its data ends early."""
    why = unrefined(data)
    if why is not None:
        raise ServiceError(422, f"JPEG data ends early: {why}", code="invalid_image")
    layout = _COLORSPACE.get(header.mode)
    try:
        if layout is None:  # CMYK (or YCCK, converted by libjpeg): checked at 1/8 scale, Pillow decodes
            simplejpeg.decode_jpeg(data, colorspace="CMYK", min_factor=8, strict=True)
            return None
        pixels = simplejpeg.decode_jpeg(data, colorspace=layout[0], strict=True)
    except ValueError as exc:
        if any(words in str(exc).lower() for words in _ENDS_EARLY):
            raise _ends_early(str(exc)) from None
        return None  # not a warning about missing data: Pillow decodes (or reports) it
    if pixels.shape[:2] != (header.height, header.width):
        return None  # never seen; Pillow's reading of the header wins
    return Image.frombuffer(layout[1], header.size, pixels, "raw", layout[1], 0, 1)


def unrefined(data: bytes) -> str | None:
    """Why a progressive JPEG's scans leave coefficients out or unrefined (an end-of-image marker right after a
    complete scan: libjpeg accepts that), or None (also for baseline files and for what it cannot parse: the
    decoder reports those)."""
    if not data.startswith(b"\xff\xd8"):
        return None
    pos, progressive = 2, False
    components: list[int] = []
    bits: dict[int, list[int | None]] = {}  # component id -> per coefficient, the last scan's Al (None: no scan)
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xD9:  # end of image
            break
        (length,) = struct.unpack(">H", data[pos + 2:pos + 4])
        body = data[pos + 4:pos + 2 + length]
        if marker in _SOF and len(body) >= 6:
            progressive = marker in (0xC2, 0xC6, 0xCA)
            components = [body[6 + 3 * i] for i in range(body[5]) if 6 + 3 * i < len(body)]
            bits = {c: [None] * 64 for c in components}
        pos += 2 + length
        if marker == 0xDA:  # start of scan: its header, then entropy-coded data up to the next marker
            if progressive and len(body) >= 1 + 2 * body[0] + 3:
                n = body[0]
                ss, se, approx = body[1 + 2 * n], body[2 + 2 * n], body[3 + 2 * n]
                for i in range(n):
                    coefficients = bits.get(body[1 + 2 * i])
                    if coefficients is not None:
                        coefficients[ss:se + 1] = [approx & 0x0F] * (se + 1 - ss)
            found = _NEXT_MARKER.search(data, pos)
            if found is None:
                return None  # ends inside a scan: the decoder says so
            pos = found.start(1) - 1
    if not progressive:
        return None
    for component, coefficients in bits.items():
        missing = [k for k, al in enumerate(coefficients) if al is None]
        if missing:
            return f"component {component}: no scan holds coefficients {missing[0]}-{missing[-1]}"
        if any(coefficients):
            return f"component {component}: coefficients lack their last {max(a or 0 for a in coefficients)} bits"
    return None
