"""Strings from clients that may reach a filesystem or a database: no NUL, valid Unicode, bounded.

A NUL byte ends a C string: `os.path.realpath("/srv/a\\x00x")` raises ValueError (a 500 where a 400
belongs) and PostgreSQL refuses it in text and JSONB columns. JSON's "\\ud800" decodes to a lone
surrogate, which UTF-8 (the filesystem's and the database's encoding) cannot encode. Both are refused
with InvalidArgument, naming the field:

    check_text("/srv/adapters/a\\x00x", "path")
    -> InvalidArgument("field 'path' holds a NUL character (\\\\u0000), which no path or name may contain")
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from services.common.errors import InvalidArgument

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path cannot name a file


def check_text(value: str, field: str) -> str:
    """`value` unchanged, or InvalidArgument (param `field`) if it holds NUL or a lone surrogate."""
    if "\x00" in value:
        raise InvalidArgument(f"field {field!r} holds a NUL character (\\u0000), which no path or name may contain",
                              param=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"field {field!r} is not valid Unicode text: a lone surrogate "
                              f"{value[exc.start]!r} at position {exc.start}", param=field) from None
    return value


def check_path_text(value: str, field: str) -> str:
    """check_text, and no longer than a path can be."""
    check_text(value, field)
    if len(value) > MAX_PATH_CHARS:
        raise InvalidArgument(f"field {field!r} is {len(value)} characters long; a path has at most "
                              f"{MAX_PATH_CHARS}", param=field)
    return value


def strings_in(value: Any) -> Iterator[tuple[str, tuple[str | int, ...]]]:
    """Every string in a parsed JSON value, object keys included, with the path of keys and indexes to it
    (a key's path is its object's). Iterative: strict JSON bounds the depth, not the width."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            yield item, path
        elif isinstance(item, dict):
            for key, inner in item.items():
                yield key, path
                stack.append((inner, (*path, key)))
        elif isinstance(item, list):
            stack.extend((inner, (*path, i)) for i, inner in enumerate(item))


def check_texts(value: Any, field: str) -> None:
    """check_text on every string in `value` (a parsed JSON value), naming where it sits: "task_head.labels[0]"."""
    for text, path in strings_in(value):
        check_text(text, param_name([field, *path]))


def param_name(path: Iterable[str | int]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    name = ""
    for key in path:
        name += f"[{key}]" if isinstance(key, int) else f".{key}" if name else str(key)
    return name
