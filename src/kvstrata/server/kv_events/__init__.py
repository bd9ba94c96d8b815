"""KV events on the wire, as vLLM publishes them: the `--kv-events-config` settings
(config.py), msgspec structs wire-identical to vLLM's (wire.py, the fleet extra) and
the ZMQ publisher with its replay socket (publisher.py)."""

from kvstrata.server.kv_events.config import KVEventsConfig
from kvstrata.server.kv_events.publisher import (
    NullEventPublisher,
    ZmqEventPublisher,
    make_publisher,
)

__all__ = ["KVEventsConfig", "NullEventPublisher", "ZmqEventPublisher", "make_publisher"]
