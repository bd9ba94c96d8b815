"""Codec names -> codec objects. Unknown names list the valid ones."""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.core.errors import ConfigError

_FACTORIES: dict[str, Callable[[], Codec]] = {"none": NoneCodec}


def register_codec(name: str, factory: Callable[[], Codec]) -> None:
    """Make `name` available to `get_codec` (codec modules call this on import)."""
    _FACTORIES[name] = factory


def _load_builtin() -> None:
    # Import codec modules for their register_codec side effect. Kept lazy so a
    # module that fails to import does not break the `none` codec.
    import importlib
    import pkgutil

    import kvstrata.codecs as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("base", "registry") and not info.name.startswith("_"):
            importlib.import_module(f"kvstrata.codecs.{info.name}")


def codec_names() -> list[str]:
    _load_builtin()
    return sorted(_FACTORIES)


def get_codec(name: str, field: str = "codec") -> Codec:
    """The codec called `name` (e.g. "none", "int8", "fp8", "int4", "int4-g32").

    Raises:
        ConfigError: unknown name; the message lists the valid names.
    """
    _load_builtin()
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError.field(field, name, f"valid codecs: {', '.join(sorted(_FACTORIES))}")
    return factory()
