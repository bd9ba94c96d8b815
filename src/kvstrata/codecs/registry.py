"""Codec names -> codec objects. Unknown names list the valid ones."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.codecs._calibrated import CalibratedCodec
from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.codecs.calibration import Calibration, loaded, split_name
from kvstrata.codecs.fp8 import Fp8Codec
from kvstrata.codecs.heads import PATTERN as HEADS
from kvstrata.codecs.heads import HeadsCodec
from kvstrata.codecs.int4 import Int4Codec
from kvstrata.codecs.int8 import Int8Codec
from kvstrata.codecs.lowrank import PATTERN as LOWRANK
from kvstrata.codecs.lowrank import LowRankCodec
from kvstrata.core.errors import ConfigError

INT4_GROUPS = (32, 128)  # int4-gN names besides plain int4 (group 64)

_FACTORIES: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "fp8": Fp8Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    **{f"int4-g{g}": (lambda g=g: Int4Codec(g)) for g in INT4_GROUPS},
}


def register_codec(name: str, factory: Callable[[], Codec]) -> None:
    """Make `name` available to `get_codec` (a codec defined outside kvstrata)."""
    _FACTORIES[name] = factory


def codec_names() -> list[str]:
    return sorted(_FACTORIES)


def get_codec(name: str, field: str = "codec") -> Codec:
    """The codec called `name` (e.g. "none", "int8", "fp8", "int4", "int4-g32", or a
    calibrated one: "lowrank-r32+int8", "heads33-int8-int4", unbound without "@digest").

    Raises:
        ConfigError: unknown name; the message lists the valid names.
    """
    factory = _FACTORIES.get(name)
    if factory is not None:
        return factory()
    codec = calibrated_codec(name, field)
    if codec is None:
        raise ConfigError.field(
            field, name, f"valid codecs: {', '.join(sorted(_FACTORIES))}, {CALIBRATED_HELP}"
        )
    return codec


def calibrated_codec(name: str, field: str, calibration: Calibration | None = None) -> Codec | None:
    """A calibrated codec (lowrank-*, heads*) bound to `calibration`, to the loaded
    calibration its "@digest" names, or unbound; None for other names."""
    base, digest = split_name(name)
    if not is_calibrated(base):
        return None
    cal = calibration
    if cal is None and digest is not None:
        cal = loaded(digest, name, field)
    m = LOWRANK.fullmatch(base)
    if m is not None:
        values = get_codec(m.group(4) or "none", field)
        if isinstance(values, CalibratedCodec):
            raise ConfigError.field(field, name, "the value codec after '+' must be uncalibrated")
        codec = LowRankCodec(int(m.group(2)), bool(m.group(3)), values, cal, pre=bool(m.group(1)))
        if cal is not None:
            codec.check_calibration()  # lowrank-pre-*: the file's RoPE frame
        return codec
    m = HEADS.fullmatch(base)
    assert m is not None
    rest = m.group(2)
    for i, ch in enumerate(rest):
        if ch == "-" and rest[:i] in _FACTORIES and rest[i + 1 :] in _FACTORIES:
            kept, other = get_codec(rest[:i], field), get_codec(rest[i + 1 :], field)
            return HeadsCodec(int(m.group(1)), kept, other, cal)
    raise ConfigError.field(
        field,
        name,
        "heads<PCT>-<kept codec>-<other codec> with two of: " + ", ".join(sorted(_FACTORIES)),
    )


def is_calibrated(name: str) -> bool:
    """Whether `name` (with or without "@digest") is a calibrated codec's."""
    base = split_name(name)[0]
    return bool(LOWRANK.fullmatch(base) or HEADS.fullmatch(base))


CALIBRATED_HELP = (
    "calibrated (with codec_calibration): lowrank[-pre]-r<R>[-int8][+<value codec>], "
    "heads<PCT>-<kept codec>-<other codec>"
)
