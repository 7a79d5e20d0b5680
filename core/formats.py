"""One formatter per kind of value a person reads (the report, the progress line, the ledger's
artifact): `money`, `duration`, `number`, `percent`, `yes_no`, `gigabytes`, `text`. No Python
repr (None, (), True) reaches a person; `NONE` stands for an unknown value."""
from __future__ import annotations

import math

NONE = "-"


def sig(v: float, digits: int = 3) -> str:
    """`v` to `digits` significant digits, written out (no exponent)."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    v = float(f"{v:.{digits}g}")
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:.{decimals}f}"


def money(usd: float | None) -> str:
    """Dollars to 3 significant digits: `$0.000592`, `$1.23`, `$1,230`; `-` when unknown."""
    if usd is None:
        return NONE
    sign = "-" if usd < 0 else ""
    usd = abs(usd)
    if usd >= 1000:
        return f"{sign}${float(f'{usd:.3g}'):,.0f}"
    return f"{sign}${sig(usd)}"


def duration(seconds: float | None) -> str:
    """Seconds with their unit, 3 significant digits: `542 ms` below 1 s, `54.2 s`, `2.50 min`
    above 120 s, `3.00 h` above 120 min; `-` when unknown."""
    if seconds is None:
        return NONE
    s = float(seconds)
    if s == 0:
        return "0 s"
    if abs(float(f"{s:.3g}")) < 1:
        return f"{sig(s * 1000)} ms"
    if abs(s) <= 120:
        return f"{sig(s)} s"
    if abs(s) <= 120 * 60:
        return f"{sig(s / 60)} min"
    return f"{sig(s / 3600)} h"


def number(v: float | None, digits: int = 3) -> str:
    """A plain number: integers as they are, floats to `digits` significant digits."""
    if v is None:
        return NONE
    if isinstance(v, bool):
        return yes_no(v)
    if isinstance(v, int):
        return str(v)
    return sig(v, digits)


def percent(fraction: float | None) -> str:
    """A fraction as a percentage: 0.9312 -> `93.1%`."""
    return NONE if fraction is None else f"{sig(100 * fraction)}%"


def yes_no(v) -> str:
    return "yes" if v else "no"


def gigabytes(sizes) -> str:
    """Worker sizes: 2 -> `2 GB`, [1, 4] -> `1/4 GB`."""
    if sizes is None or sizes == [] or sizes == ():
        return NONE
    if isinstance(sizes, (int, float)):
        sizes = [sizes]
    return "/".join(f"{float(g):g}" for g in sizes) + " GB"


def text(v) -> str:
    """Any value as a person reads it: no None, (), [], True or False."""
    if v is None or v == "" or (isinstance(v, (list, tuple, dict)) and not v):
        return NONE
    if isinstance(v, bool):
        return yes_no(v)
    if isinstance(v, float):
        return number(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(text(x) for x in v)
    return str(v)
