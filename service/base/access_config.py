"""The start-up checks of the tracing and access options (Settings calls `check_access`): a bad value is one
ValueError, which `load_settings` turns into a one-line error and exit code 2, before a port is bound."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Protocol

MAX_KEY_FILE_BYTES = 1024 * 1024


class AccessOptions(Protocol):
    """The options checked here (service.base.config.Settings has them; no import of it: it imports this module)."""

    @property
    def api_key(self) -> tuple[str, ...]: ...
    @property
    def api_key_file(self) -> str: ...
    @property
    def cors_allow_origins(self) -> tuple[str, ...]: ...
    @property
    def cors_allow_credentials(self) -> bool: ...
    @property
    def ssl_certfile(self) -> str: ...
    @property
    def ssl_keyfile(self) -> str: ...
    @property
    def ssl_keyfile_password(self) -> str: ...
    @property
    def otlp_endpoint(self) -> str: ...


def read_key_file(path: str) -> tuple[str, ...]:
    """One key per line; blank lines and lines starting with # are ignored, surrounding spaces stripped."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_KEY_FILE_BYTES:
            raise ValueError(f"api_key_file {path}: {size} bytes, more than a key file holds")
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file {path}: cannot read it ({type(exc).__name__}: "
                         f"{(exc.strerror if isinstance(exc, OSError) else None) or exc})") from None
    keys = tuple(line.strip() for line in text.splitlines())
    return tuple(k for k in keys if k and not k.startswith("#"))


def _check_keys(keys: tuple[str, ...], where: str) -> None:
    for i, key in enumerate(keys):
        # Not the key itself in the message: it is a secret.
        if not key or any(c.isspace() or not c.isprintable() for c in key) or "," in key:
            raise ValueError(f"{where}: key {i + 1} is empty or holds spaces, commas or control characters")


def api_keys(settings: AccessOptions) -> tuple[str, ...]:
    keys = tuple(settings.api_key)
    _check_keys(keys, "api_key")
    if settings.api_key_file:
        from_file = read_key_file(settings.api_key_file)
        if not from_file:
            # An empty file must not silently serve without authentication.
            raise ValueError(f"api_key_file {settings.api_key_file}: no key in it")
        _check_keys(from_file, f"api_key_file {settings.api_key_file}")
        keys += from_file
    return tuple(dict.fromkeys(keys))


def check_tls(settings: AccessOptions) -> None:
    cert, key = settings.ssl_certfile, settings.ssl_keyfile
    if not cert and not key:
        if settings.ssl_keyfile_password:
            raise ValueError("ssl_keyfile_password given without ssl_certfile and ssl_keyfile")
        return
    if not cert or not key:
        raise ValueError("TLS needs both ssl_certfile and ssl_keyfile")
    for name, path in (("ssl_certfile", cert), ("ssl_keyfile", key)):
        if not Path(path).is_file():
            raise ValueError(f"{name} {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # What uvicorn will do; here the error is one clear line instead of a traceback after start-up.
        context.load_cert_chain(cert, key, password=settings.ssl_keyfile_password or None)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"cannot use certificate {cert} with key {key}: {exc}") from None


def check_cors(settings: AccessOptions) -> None:
    if settings.cors_allow_credentials and "*" in settings.cors_allow_origins:
        raise ValueError("cors_allow_credentials cannot be used with cors_allow_origins *: name the origins")


def check_access(settings: AccessOptions) -> tuple[str, ...]:
    """Every check; returns the API keys (from api_key and api_key_file)."""
    check_tls(settings)
    check_cors(settings)
    if settings.otlp_endpoint:
        from service.base.tracing import require_otel

        require_otel()
    return api_keys(settings)
