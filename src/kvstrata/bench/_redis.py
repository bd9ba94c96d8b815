"""A real `redis-server` and a slow link to it, for `kvstrata bench remote` and the tests:
the server on a free loopback port (no persistence: a restart is empty), killed,
restarted, reconfigured; and a TCP proxy that holds every server-to-client chunk back
a fixed delay, plus its length at a given rate when one is set (a slow or far link:
the injected per-read delay, and a throttled one)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1:`port` (no persistence: a restart is empty)."""

    def __init__(self, workdir: Path, port: int | None = None, *args: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING (RuntimeError after 10 s)."""
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.workdir), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                if self.client().ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def client(self, **kw: Any) -> Any:
        import redis

        args = list(self.args)
        if "--requirepass" in args:
            kw.setdefault("password", args[args.index("--requirepass") + 1])
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kw)

    def used_memory(self) -> int:
        """Bytes the server holds (INFO memory)."""
        return int(self.client().info("memory")["used_memory"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class SlowProxy:
    """Forwards 127.0.0.1:`port` to a server, holding every server->client chunk back
    `delay` seconds, plus its length / `rate` (bytes per second) when `rate` is set (a
    slow or far link, a throttled one)."""

    def __init__(self, target_port: int, delay: float, rate: float | None = None) -> None:
        self.target_port, self.delay, self.rate = target_port, delay, rate
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if slow:  # read at each chunk: a test may change them
                    time.sleep(self.delay + (len(data) / self.rate if self.rate else 0.0))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stop = True
        self._listener.close()
