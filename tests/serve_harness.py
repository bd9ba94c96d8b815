"""Serving helpers shared by the server's and the CLI's tests: an app on uvicorn in a
thread, a small engine, the one-line error check, and a real `kvstrata serve` process."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import httpx2 as httpx
import uvicorn

from kvstrata.engine import Engine, EngineConfig
from kvstrata.workload.zoo import load_model

MODEL = "kvstrata-code-tiny"


def serve_in_thread(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """uvicorn on a free loopback port in a background thread (what `kvstrata serve`
    runs in the main thread)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


def stop(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(60)
    assert not thread.is_alive()


def make_engine() -> Engine:
    model, tokenizer = load_model("default")
    return Engine(
        model,
        tokenizer,
        config=EngineConfig(max_num_seqs=8, max_batched_tokens=256),
        model_name=MODEL,
        block_size=16,
        device_budget="1MiB",
        host_budget="4MiB",
    )


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a refused request, checked for shape and one line."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    return error


class ServeProcess:
    """`python -m kvstrata.cli serve ...` with its stderr read line by line."""

    def __init__(self, *argv: str, preexec_fn=None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstrata.cli",
                "serve",
                "--port",
                "0",
                "--model",
                "tiny",
                *argv,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=preexec_fn,  # e.g. join a memory cgroup (tests/memory_squeeze.py)
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for_url()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def _wait_for_url(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.stderr)
                continue
            if " at http://" in line:
                return line.split(" at ")[1].split()[0]
        raise AssertionError(f"kvstrata serve did not start: {''.join(self.stderr)}")

    def complete(self, prompt: str) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"{self.url}/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=120)
        time.sleep(0.1)  # the reader thread has the last lines
        assert "Traceback" not in "".join(self.stderr)
        assert "stopped (engine shut down, store closed)" in self.stderr[-1]
        return code
