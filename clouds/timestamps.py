"""The one reading of a cloud's timestamps as epoch seconds, for every provider module.

The providers hand their clocks back in different shapes: boto3 (ECS), the Azure SDK (ACI)
and the Kubernetes client give `datetime`s; a number is already epoch seconds; the Docker
engine answers RFC 3339 text with nanoseconds and `Z` or an offset, and the zero time
`0001-01-01T00:00:00Z` for "never".
"""
from __future__ import annotations

from datetime import datetime

NEVER = "0001-01-01"
"""How an engine's zero time ("never happened") begins."""


def epoch_seconds(value) -> float | None:
    """`value` as epoch seconds: a `datetime` (naive ones read as local time), a number, or
    RFC 3339 text (any number of fraction digits, `Z` or an offset; numeric text is read as
    epoch seconds). None for None, empty text, the engine's zero time, and anything that is
    neither a timestamp nor a number."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        text = value.strip()
        if not text or text.startswith(NEVER):
            return None
        try:
            return float(text)
        except ValueError:
            return _rfc3339(text)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _rfc3339(text: str) -> float:
    text = text.replace("Z", "+00:00")
    date, _, rest = text.partition(".")
    if rest:  # Python reads at most microseconds: cut the fraction to 6 digits
        digits = len(rest) - len(rest.lstrip("0123456789"))
        frac, tz = rest[:digits], rest[digits:]
        text = f"{date}.{frac[:6].ljust(6, '0')}{tz}"
    return datetime.fromisoformat(text).timestamp()
