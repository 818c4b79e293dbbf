"""Strict JSON for untrusted files and request bodies: finite numbers only, bounded nesting.

Python's `json` accepts the non-standard literals `NaN`, `Infinity` and `-Infinity`, turns `1e999`
into `inf`, and raises RecursionError (not a ValueError) on input nested a few thousand levels
deep. A LoRA alpha of NaN or Infinity then registers and serves garbage, and a nested body answers
500. `loads` refuses all of them with InvalidArgument (400), naming what was parsed:

    loads('{"lora_alpha": NaN}', "adapter_config.json")
    -> InvalidArgument("adapter_config.json is not valid JSON: NaN is not allowed (finite numbers only)")
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from services.common.errors import InvalidArgument

# Deeper than any config, safetensors header or task head we serve (those nest 2-4 levels).
MAX_DEPTH = 64


class _NonFinite(ValueError):
    pass


def _refuse_constant(literal: str) -> NoReturn:
    raise _NonFinite(f"{literal} is not allowed (finite numbers only)")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NonFinite(f"{literal} overflows a 64-bit float (finite numbers only)")
    return value


def _check_depth(value: Any, what: str) -> None:
    """InvalidArgument if objects/arrays nest deeper than MAX_DEPTH (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise InvalidArgument(f"{what} nests objects or arrays deeper than {MAX_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)


def loads(text: str | bytes, what: str) -> Any:
    """Parse `text` (UTF-8 if bytes); InvalidArgument naming `what` on malformed, non-finite or too deep input."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")  # not json's guess among UTF-8/16/32
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidArgument(f"{what} nests objects or arrays deeper than {MAX_DEPTH} levels") from None
    except _NonFinite as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, or an integer too long to convert
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from exc
    _check_depth(value, what)
    return value
