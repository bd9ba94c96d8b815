"""Byte sizes, token counts and numbers as people write them: "24GB", "24 GiB", "1.5T",
"8k", "10%". Every parser here refuses what it cannot read exactly (wrong type, bool,
NaN, infinity, a fraction of a byte or token, out of range) with a one-line
`ConfigError` naming the field, the value and what is accepted."""

from __future__ import annotations

import math
import re

from kvstrata.core.errors import ConfigError

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}

_SIZE_EXAMPLES = "such as 1048576, '512MiB', '24GB', '24 GiB' or '1.5T'"
SIZE_HELP = f"a byte size {_SIZE_EXAMPLES}"
TOKENS_HELP = "a whole token count such as 2048 or '8k'"

# Upper bounds of what any field may say (a larger value is a typo, not a plan):
# 1 EiB of bytes, and token positions as int32 (what attention masks and RoPE index).
MAX_BYTES = 2**60
MAX_TOKENS = 2**31 - 1


def _number(value: object) -> float | None:
    """value as a float when it is a real int/float (not bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def parse_size(
    value: int | float | str,
    field: str = "size",
    *,
    allow_zero: bool = False,
    maximum: int = MAX_BYTES,
    fraction_hint: str = "",
) -> int:
    """Parse a byte size.

    Decimal suffixes (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB,
    TiB) powers of 1024. A bare letter ("1.5T", "16G") is read as binary, as `ls -h`
    and `free -h` print it. A number without a suffix is bytes and must be whole: a
    float below 1 (e.g. 0.4) is refused, never read as a fraction of anything.

    Args:
        value: an int/float number of bytes or a string with an optional suffix.
        field: the config field name, used in the error message.
        allow_zero: accept 0 (e.g. "no disk tier").
        maximum: the largest size accepted (bytes).
        fraction_hint: appended to the message when the value looks like a fraction
            (e.g. "for a share of the context use resident_fraction").

    Returns:
        The size in bytes (int).

    Raises:
        ConfigError: wrong type, unparseable, not finite, a fraction of a byte,
            negative, zero when not allowed, or above `maximum`.
    """
    num = _number(value)
    suffixed = False
    if num is None:
        if not isinstance(value, str):
            raise ConfigError.field(field, value, SIZE_HELP)
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError.field(field, value, SIZE_HELP)
        digits, prefix, binary, b = m.groups()
        prefix = prefix.lower()
        if binary and not prefix:
            raise ConfigError.field(field, value, SIZE_HELP)
        # "24GB" is decimal, as disk and GPU vendors write it; "24GiB", "24G", "1.5T" binary
        base = 1000 if prefix and not binary and b else 1024
        suffixed = bool(prefix)
        num = float(digits) * base ** _POW[prefix]
    if not math.isfinite(num):
        raise ConfigError.field(field, value, f"a finite byte size {_SIZE_EXAMPLES}")
    if num < 0 or (num == 0 and not allow_zero):
        least = ">= 0" if allow_zero else "> 0"
        raise ConfigError.field(field, value, f"a byte size {least} {_SIZE_EXAMPLES}")
    if not suffixed and num != int(num):
        if 0 < num < 1:
            hint = f"; {fraction_hint}" if fraction_hint else ""
            raise ConfigError.field(
                field, value, f"{field} is bytes, not a fraction: give e.g. '4GiB'{hint}"
            )
        raise ConfigError.field(field, value, f"a whole number of bytes, or {SIZE_HELP}")
    if num > maximum:
        raise ConfigError.field(field, value, f"at most {format_bytes(maximum)}")
    return int(round(num))


_TOKENS_RE = re.compile(rf"^\s*{_NUMBER}\s*([km]?)\s*$", re.IGNORECASE)


def parse_tokens(
    value: int | str,
    field: str = "tokens",
    *,
    allow_zero: bool = False,
    maximum: int = MAX_TOKENS,
) -> int:
    """Parse a token count: 2048, "2k" (= 2048), "128K", "1m" (= 1048576).

    Args:
        value: an int (or a whole float) or a string with an optional k/m suffix.
        field: the config field name, used in the error message.
        allow_zero: accept 0.
        maximum: the largest count accepted.

    Raises:
        ConfigError: wrong type, unparseable, not finite, not whole, negative, zero
            when not allowed, or above `maximum`.
    """
    least = 0 if allow_zero else 1
    accepted = f"a whole token count >= {least} such as 2048 or '8k'"
    num = _number(value)
    if num is None:
        m = _TOKENS_RE.match(value) if isinstance(value, str) else None
        if not m:
            raise ConfigError.field(field, value, accepted)
        num = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    if not math.isfinite(num) or num != int(num) or num < least:
        raise ConfigError.field(field, value, accepted)
    if num > maximum:
        raise ConfigError.field(field, value, f"at most {maximum:,} tokens")
    return int(num)


def parse_int(
    value: int | str,
    field: str,
    *,
    minimum: int = 1,
    maximum: int = MAX_TOKENS,
    what: str = "a whole number",
) -> int:
    """Parse a whole number in [minimum, maximum] ("4", 4, "1e3"; not 1.5, True, inf).

    Raises:
        ConfigError: names the field, the value and the range.
    """
    accepted = f"{what} from {minimum:,} to {maximum:,}"
    num: int | float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        num = value  # exact, however large
    elif isinstance(value, float):
        num = value
    elif isinstance(value, str):
        try:
            num = int(value.strip())
        except ValueError:
            try:
                num = float(value.strip())  # "1e3"
            except ValueError:
                num = None
    if num is None or not math.isfinite(num) or num != int(num):
        raise ConfigError.field(field, value, accepted)
    if not minimum <= num <= maximum:
        raise ConfigError.field(field, value, accepted)
    return int(num)


def parse_float(
    value: float | str,
    field: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    what: str = "number",
) -> float:
    """Parse a finite number in [minimum, maximum] (either bound may be None).

    Raises:
        ConfigError: unparseable, NaN, infinite or out of range.
    """
    num = _number(value)
    if num is None and isinstance(value, str):
        try:
            num = float(value.strip())
        except ValueError:
            num = None
    bounds = []
    if minimum is not None:
        bounds.append(f">= {minimum:g}")
    if maximum is not None:
        bounds.append(f"<= {maximum:g}")
    accepted = f"a finite {what}" + (f" {' and '.join(bounds)}" if bounds else "")
    if num is None or not math.isfinite(num):
        raise ConfigError.field(field, value, accepted)
    if (minimum is not None and num < minimum) or (maximum is not None and num > maximum):
        raise ConfigError.field(field, value, accepted)
    return num


def format_bytes(num: float) -> str:
    """Human-readable binary size: 4294967296 -> '4.00 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(num) < 1024 or unit == "EiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def parse_fraction(value: float | str, field: str = "fraction") -> float:
    """Parse a fraction in (0, 1]: 0.1, "0.1" or "10%".

    Raises:
        ConfigError: wrong type, unparseable or out of range.
    """
    accepted = "a fraction in (0, 1] such as 0.1 or '10%'"
    num = _number(value)
    if num is None:
        if not isinstance(value, str):
            raise ConfigError.field(field, value, accepted)
        text = value.strip()
        try:
            num = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            num = -1.0
    if not 0 < num <= 1:  # also NaN
        raise ConfigError.field(field, value, accepted)
    return num
