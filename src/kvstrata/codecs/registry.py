"""Codec names -> codec objects. Unknown names list the valid ones."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.codecs.fp8 import Fp8Codec
from kvstrata.codecs.int4 import Int4Codec
from kvstrata.codecs.int8 import Int8Codec
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
    """The codec called `name` (e.g. "none", "int8", "fp8", "int4", "int4-g32").

    Raises:
        ConfigError: unknown name; the message lists the valid names.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError.field(field, name, f"valid codecs: {', '.join(sorted(_FACTORIES))}")
    return factory()
