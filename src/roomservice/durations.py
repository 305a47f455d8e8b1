"""Go-style duration strings (``"500ms"``, ``"3s"``, ``"1h30m"``) <-> :class:`datetime.timedelta`.

The configuration writes every duration the way the seed does. The grammar is
Go's ``time.ParseDuration`` without signs: one or more ``<number><unit>``
parts, the number possibly fractional (``"1.5s"``), the unit one of ``ns``,
``us`` (or ``µs``/``μs``), ``ms``, ``s``, ``m``, ``h``. Bare numbers (``"5"``,
even ``"0"``), empty strings, negative values and unknown units are rejected.

``timedelta`` has microsecond resolution, so sub-microsecond parts are rounded
to the nearest microsecond (``"10ns"`` is zero).
"""

from __future__ import annotations

import re
from datetime import timedelta
from fractions import Fraction

__all__ = ["format_duration", "parse_duration"]

_UNIT_NS: dict[str, int] = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # µ MICRO SIGN
    "\u03bcs": 1_000,  # μ GREEK SMALL LETTER MU
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([^\d.]*)")
_EXAMPLES = '"500ms", "3s", "5m" or "1h30m"'


def parse_duration(text: str) -> timedelta:
    """Parse a Go-style duration such as ``"1h30m"``; raise ValueError on anything else."""
    if not isinstance(text, str):
        raise ValueError(f"expected a duration string like {_EXAMPLES}, got {type(text).__name__}")
    s = text.strip()
    if not s:
        raise ValueError(f"empty duration; write it like {_EXAMPLES}")
    if s[0] == "-":
        raise ValueError(f"negative duration {text!r} is not allowed")
    if s[0] == "+":
        s = s[1:]
    total_ns = Fraction(0)
    pos = 0
    while pos < len(s):
        match = _PART.match(s, pos)
        if match is None:
            raise ValueError(f"invalid duration {text!r}; write it like {_EXAMPLES}")
        number, unit = match.groups()
        if not unit:
            raise ValueError(f"duration {text!r} is missing a unit (ns, us, ms, s, m, h); write it like {_EXAMPLES}")
        if unit not in _UNIT_NS:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}; use ns, us, ms, s, m or h")
        total_ns += Fraction(number) * _UNIT_NS[unit]
        pos = match.end()
    if pos == 0:
        raise ValueError(f"invalid duration {text!r}; write it like {_EXAMPLES}")
    try:
        return timedelta(microseconds=round(total_ns / 1000))
    except OverflowError:
        raise ValueError(f"duration {text!r} is too large") from None


def format_duration(td: timedelta) -> str:
    """Render ``td`` compactly in the same grammar (``"1h30m"``, ``"1.5s"``, ``"500ms"``, ``"0s"``).

    ``parse_duration(format_duration(td)) == td`` for every non-negative ``td``.
    """
    us = td // timedelta(microseconds=1)
    if us < 0:
        return "-" + format_duration(-td)
    if us == 0:
        return "0s"
    if us < 1_000:
        return f"{us}us"
    if us < 1_000_000:
        return _decimal(us, 1_000) + "ms"
    hours, rest = divmod(us, 3_600_000_000)
    minutes, rest = divmod(rest, 60_000_000)
    out = ""
    if hours:
        out += f"{hours}h"
    if minutes:
        out += f"{minutes}m"
    if rest:
        out += _decimal(rest, 1_000_000) + "s"
    return out


def _decimal(value: int, scale: int) -> str:
    """``value / scale`` written exactly, without trailing zeros (scale is a power of ten)."""
    whole, frac = divmod(value, scale)
    if not frac:
        return str(whole)
    digits = len(str(scale)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")
