"""Bodies from outside, read without trusting them: a size cap before parsing, a depth cap after
(json.loads recurses, and 60,000 open brackets are a RecursionError), and text that PostgreSQL can
store (no U+0000) cut to a stated length with the original's size and SHA-256."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


class BodyTooLarge(Exception):
    """A body over its size cap, or JSON nested past its depth cap."""


def load_json_body(raw: bytes | str, *, max_bytes: int, max_depth: int) -> Any:
    """Parse ``raw``, refusing one too large or too deeply nested before it costs anything.
    Raises BodyTooLarge, or ValueError for text that is not JSON."""
    if len(raw) > max_bytes:
        raise BodyTooLarge(f"the body is over {max_bytes} bytes")
    try:
        data = json.loads(raw, parse_constant=_not_a_json_number, parse_float=_finite_float)
    except RecursionError:
        raise BodyTooLarge(f"JSON nested more than {max_depth} levels deep") from None
    if depth_exceeds(data, max_depth):
        raise BodyTooLarge(f"JSON nested more than {max_depth} levels deep")
    return data


NOT_A_NUMBER = "NaN and Infinity are not JSON numbers (nor is a number too large for a double, such as 1e999)"


def _not_a_json_number(word: str) -> float:
    """Python's json reads ``NaN``, ``Infinity`` and ``-Infinity``; RFC 8259 and PostgreSQL's jsonb do not."""
    raise ValueError(f"{word}: {NOT_A_NUMBER}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf
        raise ValueError(f"{text[:20]}: {NOT_A_NUMBER}")
    return value


def json_too_deep(raw: bytes | str, max_depth: int) -> bool:
    """Whether the JSON text ``raw`` nests past ``max_depth`` (past Python's own recursion limit
    included); False for text that is not JSON, which its reader refuses in its own words."""
    try:
        return depth_exceeds(json.loads(raw), max_depth)
    except RecursionError:
        return True
    except ValueError:
        return False


def depth_exceeds(data: Any, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            if depth > limit:
                return True
            stack.extend((item, depth + 1) for item in value)
    return False


def storable(text: str, limit: int) -> str:
    """``text`` as PostgreSQL can keep it: at most ``limit`` characters, each NUL as U+FFFD."""
    return text[:limit].replace("\x00", "\ufffd")


def sha256_hex(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()
