"""Request bodies as the routes accept them: which content types (browsers send `text/plain`,
`application/x-www-form-urlencoded` and `multipart/form-data` cross-site without asking first, so a JSON route
takes none of them), and which content encodings (gzip and deflate, inflated never past a limit; anything else
is a 415 that says so, not a misleading parse error)."""

from __future__ import annotations

import zlib

from starlette.requests import Request

from service.base.errors import ServiceError, shown

ENCODINGS = ("gzip", "deflate")
JSON = "application/json"


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def require_media(request: Request, accepted: tuple[str, ...], *, missing_ok: bool = True) -> None:
    """415 unless the request's content type is one of `accepted` (or, with `missing_ok`, absent: a client
    such as Triton's that sends none; a browser cannot make a cross-site request without a Content-Type that
    also passes the Origin check, see service.edge.crosssite)."""
    media = media_type(request)
    if media in accepted or (missing_ok and not media):
        return
    raise ServiceError(415, f"content type {shown(media) if media else 'none'} not accepted here: send "
                       f"Content-Type: {' or '.join(accepted)}", code="unsupported_media_type")


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """`body` decoded from its Content-Encoding, never inflated past `limit` bytes (a zip bomb stops there)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ENCODINGS:
        raise ServiceError(415, f"Content-Encoding {shown(encoding)} not supported (send gzip, deflate or none)",
                           code="bad_encoding")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ServiceError(400, f"body is not valid {encoding}: {exc}", code="bad_encoding") from None
    if len(out) > limit:
        raise ServiceError(413, f"decompressed body exceeds the limit of {limit} bytes", code="body_too_large")
    if not inflater.eof:
        raise ServiceError(400, f"body is not valid {encoding}: the compressed stream is truncated",
                           code="bad_encoding")
    return out


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, decoded from its Content-Encoding (at most `limit` bytes once inflated)."""
    return inflate(await request.body(), request.headers.get("content-encoding", ""), limit)
