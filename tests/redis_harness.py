"""A real `redis-server` for tests: started on a free loopback port, killed, restarted,
reconfigured; and a TCP proxy that delays every answer (a slow link). Both live in
kvstrata.bench._redis (`kvstrata bench remote` uses them too)."""

from __future__ import annotations

import importlib.util

import pytest

from kvstrata.bench._redis import REDIS_SERVER, RedisServer, SlowProxy, free_port

needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or importlib.util.find_spec("redis") is None,
    reason="needs redis-server (apt-get install -y redis-server; .ci/run does it) and the "
    "redis client (pip install 'kvstrata[remote]', in the dev extra)",
)

__all__ = ["REDIS_SERVER", "RedisServer", "SlowProxy", "free_port", "needs_redis"]
