"""Byte sizes and token counts as people write them: "24GB", "24 GiB", "1.5T", "8k"."""

from __future__ import annotations

import re

from kvstrata.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}

SIZE_HELP = "a byte size such as 1048576, '512MiB', '24GB', '24 GiB' or '1.5T'"


def parse_size(value: int | float | str, field: str = "size", *, allow_zero: bool = False) -> int:
    """Parse a byte size.

    Decimal suffixes (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB,
    TiB) powers of 1024. A bare letter ("1.5T", "16G") is read as binary, as `ls -h`
    and `free -h` print it.

    Args:
        value: an int/float number of bytes or a string with an optional suffix.
        field: the config field name, used in the error message.
        allow_zero: accept 0 (e.g. "no disk tier").

    Returns:
        The size in bytes (int).

    Raises:
        ConfigError: unparseable, negative, or zero when not allowed.
    """
    if isinstance(value, bool):
        raise ConfigError.field(field, value, SIZE_HELP)
    if isinstance(value, int | float):
        num = float(value)
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ConfigError.field(field, value, SIZE_HELP)
        digits, prefix, binary, b = m.groups()
        prefix = prefix.lower()
        if binary and not prefix:
            raise ConfigError.field(field, value, SIZE_HELP)
        # "24GB" is decimal, as disk and GPU vendors write it; "24GiB", "24G", "1.5T" binary
        base = 1000 if prefix and not binary and b else 1024
        num = float(digits) * base ** _POW[prefix]
    if num != num or num < 0 or (num == 0 and not allow_zero):
        raise ConfigError.field(field, value, "must be a positive " + SIZE_HELP.split(" such")[0])
    return int(round(num))


_TOKENS_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([km]?)\s*$", re.IGNORECASE)


def parse_tokens(value: int | str, field: str = "tokens") -> int:
    """Parse a token count: 2048, "2k" (= 2048), "128K", "1m" (= 1048576).

    Raises:
        ConfigError: unparseable, zero or negative.
    """
    if isinstance(value, bool):
        raise ConfigError.field(field, value, "a positive token count such as 2048 or '8k'")
    if isinstance(value, int):
        num = float(value)
    else:
        m = _TOKENS_RE.match(str(value))
        if not m:
            raise ConfigError.field(field, value, "a positive token count such as 2048 or '8k'")
        num = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    if num <= 0 or num != int(num):
        raise ConfigError.field(field, value, "a positive whole token count such as 2048 or '8k'")
    return int(num)


def format_bytes(num: float) -> str:
    """Human-readable binary size: 4294967296 -> '4.00 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def parse_fraction(value: float | str, field: str = "fraction") -> float:
    """Parse a fraction in (0, 1]: 0.1, "0.1" or "10%".

    Raises:
        ConfigError: unparseable or out of range.
    """
    text = str(value).strip()
    try:
        frac = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        frac = -1.0
    if not 0 < frac <= 1:
        raise ConfigError.field(field, value, "a fraction in (0, 1] such as 0.1 or '10%'")
    return frac
