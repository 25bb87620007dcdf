"""A model's chat template rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it.

The same Jinja environment: sandboxed and immutable (a template is code from the model's author, it must not
reach the server's objects), trim_blocks and lstrip_blocks, the loop-control extension, transformers' `tojson`
filter (no ASCII escaping) and its globals `raise_exception` and `strftime_now`; the special tokens of
tokenizer_config.json (`bos_token`, `eos_token`, ...) as variables. A template that raises is the client's
problem (400 with the template's message), a template that does not compile is the model's (found at load).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed while rendering it."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters and sorts keys, which changes the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> Template:
    """The compiled template (jinja2.TemplateSyntaxError if it is not one)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(source: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str | None],
           add_generation_prompt: bool = True, **extra: Any) -> str:
    """The prompt text of `messages`; ChatTemplateError with the template's own message if it raises."""
    template = compile_template(source)
    variables = {f"{name}_token": value for name, value in special_tokens.items() if value is not None}
    try:
        return template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               **variables, **extra)
    except TemplateError as exc:
        raise ChatTemplateError(str(exc) or type(exc).__name__) from None
    except Exception as exc:  # a template indexing a missing key, dividing by zero, ...: still the template's doing
        raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
