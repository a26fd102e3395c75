"""Sizes and times as people write and read them: ``10GiB`` in, ``2.2 GiB`` out.

Suffixes follow coreutils (`truncate`, `dd`): K, M, G, T and KiB, MiB, GiB, TiB are powers of
1024; KB, MB, GB, TB are powers of 1000. A bare number is bytes.
"""

from __future__ import annotations

import datetime as _dt
import re
from decimal import Decimal

__all__ = ["SizeError", "format_duration", "format_size", "format_timestamp", "parse_size"]

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
SIZE_BYTES_MAX = 1 << 62  # no tier is near 4 EiB; larger is a typo


class SizeError(ValueError):
    """A size that does not parse; the message says what does."""


def parse_size(text: str | int) -> int:
    """Bytes in `text`: ``4096``, ``10GiB``, ``10G`` (= GiB), ``1.5TB`` (decimal)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if m is None:
            raise SizeError(f"{text!r} is not a size; use bytes or e.g. 512MiB, 10GiB, 2TB")
        number, prefix, binary, b = m.groups()
        if binary and not (prefix and b):  # "Ki", "iB": neither coreutils nor we read them
            raise SizeError(f"{text!r} is not a size; use bytes or e.g. 512MiB, 10GiB, 2TB")
        base = 1000 if prefix and b and not binary else 1024  # KB: decimal; K, KiB: binary
        # exact, and no float overflow (a 400-digit size raised OverflowError, a traceback)
        value = int(Decimal(number) * base ** _POWERS[prefix.lower()])
    if not 0 <= value <= SIZE_BYTES_MAX:
        raise SizeError(f"{text!r} is out of range (0 .. {SIZE_BYTES_MAX} bytes)")
    return value


def format_size(nbytes: float) -> str:
    """``2415919104`` -> ``2.2 GiB``; under 1 KiB the bytes themselves."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """``4.9`` -> ``4.9 s``; ``3725`` -> ``1h 2m 5s``."""
    if seconds < 60:
        return f"{seconds:.3g} s" if seconds < 1 else f"{seconds:.1f} s"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours or days else []
    return " ".join([*parts, f"{minutes}m", f"{secs}s"])


def format_timestamp(unix_s: float) -> str:
    """A unix time as local ISO 8601 to the second, with its UTC offset."""
    return _dt.datetime.fromtimestamp(unix_s).astimezone().isoformat(timespec="seconds")
