"""Parse the `Server-Timing` response header (W3C): `queue;dur=1.2, compute;dur=3.4;desc="x"` -> {name: ms}."""

from __future__ import annotations

import contextlib
import re

# A metric's name, then its `dur` param (case-insensitive), both inside one comma-separated entry.
_FAST = re.compile(r"(?:^|,)\s*([^,;\s]+)[^,]*?;\s*dur\s*=\s*([^;,\s]*)", re.IGNORECASE)


def _split(text: str, sep: str) -> list[str]:
    """Split on `sep` outside double quotes (a `desc` may hold commas and semicolons)."""
    parts, current, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def parse_server_timing(header: str | None) -> dict[str, float]:
    """Durations in milliseconds by metric name; metrics without a numeric `dur` are left out.

    Several headers may be passed joined with ", " (HTTP's rule for repeated headers). A repeated name keeps
    its first value, as the spec says.
    """
    out: dict[str, float] = {}
    if not header:
        return out
    if '"' not in header:  # the usual case, done by one regex (this runs for every response)
        for name, dur in _FAST.findall(header):
            if name not in out:
                with contextlib.suppress(ValueError):
                    out[name] = float(dur)
        return out
    for metric in _split(header, ","):
        name, *params = (p.strip() for p in _split(metric, ";"))
        if not name or name in out:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "dur":
                with contextlib.suppress(ValueError):
                    out[name] = float(value.strip().strip('"'))
                break
    return out
