"""`kvstrata serve --kv-events-config '<json>'`: vLLM's KVEventsConfig keys, checked.

The keys and defaults are vLLM's (`vllm.config.kv_events.KVEventsConfig`), so one
JSON works for both servers. Every bad key or value is a one-line ConfigError naming
the field, the value and what it takes.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields

from kvstrata.core.errors import ConfigError

PUBLISHERS = ("zmq", "null")
_FLAG = "kv_events_config"


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KV event settings (publisher None: "zmq" when enabled, else "null")."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise _bad("enable_kv_cache_events", self.enable_kv_cache_events, "true or false")
        if self.publisher not in PUBLISHERS:
            raise _bad("publisher", self.publisher, '"zmq" or "null"')
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                raise _bad(name, value, 'a ZMQ endpoint such as "tcp://*:5557" or "ipc:///tmp/kv"')
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise _bad(name, value, f"a whole number >= {least}")
        if not isinstance(self.topic, str):
            raise _bad("topic", self.topic, "a string (the ZMQ topic; default empty)")

    @property
    def enabled(self) -> bool:
        """Events are recorded and published (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON object (one-line ConfigError on bad JSON, key or value)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError.field(
                _FLAG,
                text,
                f"a JSON object ({exc.msg} at character {exc.pos}), e.g. "
                '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError.field(
                _FLAG, text, 'a JSON object, e.g. {"enable_kv_cache_events": true}'
            )
        known = [f.name for f in fields(cls)]
        for key in raw:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                guess = f"did you mean {close[0]!r}? " if close else ""
                raise _bad(key, raw[key], f"unknown key (vLLM's); {guess}known: {', '.join(known)}")
        return cls(**raw)


def _bad(name: str, value: object, accepted: str) -> ConfigError:
    return ConfigError.field(f"{_FLAG}.{name}", value, accepted)
