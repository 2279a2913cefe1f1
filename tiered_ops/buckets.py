"""Shape buckets as stored: the encoding of an op's bucket tuple, and the distance between two buckets.

An op's ``bucket(problem)`` returns a tuple of typed values (leading dims rounded to a power of two, reduced dims
exact, flags). The store keeps it as canonical JSON text (``encode``): ints stay ints, bools stay bools (a flag,
never the number 1), strings and None as themselves, nested tuples as lists; equal tuples give equal text, so the
text is a key. ``decode`` gives the tuple back. ``distance`` says how far apart two buckets are for the nearest-bucket
fallback: the sum of |log2| ratios of their numeric parts, infinite when anything else differs; ``flags_apart``
ranks buckets whose named variants differ (a fallback of its own, where no bucket of the same flags is measured).

Stores written before this encoding held ``"a|b|c"`` (``str`` of each part joined by ``|``): ``from_legacy`` reads
that form (the store's migration converts every stored bucket with it).
"""

from __future__ import annotations

import json
import math
from typing import Any, Union

Bucket = tuple
Part = Union[int, float, bool, str, None, tuple]


def _plain(v: Any, where: str) -> Any:
    """``v`` as JSON-ready data; a type a bucket cannot hold is a ValueError naming it."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)  # an int subclass (an enum) as its value
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"bucket: {where} is {v!r}; expected a finite number")
        return v
    if isinstance(v, (tuple, list)):
        return [_plain(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if hasattr(v, "__index__"):  # numpy / torch integer scalars
        return int(v.__index__())
    raise ValueError(f"bucket: {where} is a {type(v).__name__} ({v!r}); expected int, float, bool, str, None or a "
                     "tuple of those")


def encode(bucket: Bucket) -> str:
    """The canonical JSON text of a bucket tuple (the store's ``bucket`` column)."""
    if not isinstance(bucket, (tuple, list)):
        raise ValueError(f"bucket: expected a tuple, got {type(bucket).__name__} ({bucket!r})")
    return json.dumps(_plain(bucket, "part"), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def decode(text: str) -> Bucket:
    """The bucket tuple of an ``encode``d text (lists come back as tuples)."""
    try:
        v = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"bucket: expected the JSON text of a bucket, got {text!r} ({e})") from None
    if not isinstance(v, list):
        raise ValueError(f"bucket: expected the JSON text of a list, got {text!r}")
    return _tuples(v)


def from_legacy(text: str) -> Bucket:
    """The tuple of a bucket stored as ``"a|b|c"``: digits (with a sign) are ints, True/False bools, None None, the
    rest strings."""
    def part(s: str) -> Part:
        if s.lstrip("-").isdigit():
            return int(s)
        return {"True": True, "False": False, "None": None}.get(s, s)

    return tuple(part(s) for s in text.split("|"))


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parts_distance(a: Part, b: Part) -> float:
    if _numeric(a) and _numeric(b):
        return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return distance(a, b)
    return 0.0 if type(a) is type(b) and a == b else math.inf


def distance(a: Bucket | str, b: Bucket | str) -> float:
    """How far apart two buckets (tuples, or their ``encode``d texts) are: the sum of |log2| ratios of their numeric
    parts (sizes below 1 count as 1); inf when their lengths differ or a non-numeric part (a flag, a name) differs.
    A bool is a flag, never a number: (64, True) and (64, 1) are infinitely far apart."""
    ta = decode(a) if isinstance(a, str) else tuple(a)
    tb = decode(b) if isinstance(b, str) else tuple(b)
    if len(ta) != len(tb):
        return math.inf
    return sum(_parts_distance(x, y) for x, y in zip(ta, tb))


def flags_apart(a: Bucket | str, b: Bucket | str) -> tuple[float, float]:
    """(how many named variants differ, the ``distance`` of the numeric parts): buckets of the same structure ranked
    by their variants first. A variant is a string part (cross_entropy's reduction, gelu's approximation): the same
    kernel with another epilogue, its time a fair guess of the other's. A bool is not: it says which path runs (a
    softmax over a dim that is not last, a norm without weight), so buckets whose bools differ are (inf, inf) apart,
    as are those whose lengths differ or whose parts are of different kinds."""
    ta = decode(a) if isinstance(a, str) else tuple(a)
    tb = decode(b) if isinstance(b, str) else tuple(b)
    if len(ta) != len(tb):
        return math.inf, math.inf
    flags, apart = 0.0, 0.0
    for x, y in zip(ta, tb):
        if _numeric(x) and _numeric(y):
            apart += _parts_distance(x, y)
        elif isinstance(x, tuple) and isinstance(y, tuple):
            f, d = flags_apart(x, y)
            flags, apart = flags + f, apart + d
        elif type(x) is type(y) and x == y:
            continue
        elif isinstance(x, str) and isinstance(y, str):
            flags += 1.0
        else:
            return math.inf, math.inf
    return flags, apart
