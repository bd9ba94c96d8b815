"""Two `kvstrata serve` replicas behind a real router, vllm-router (PyPI, the `fleet`
extra): its `kv_aware` policy follows the KV events the replicas publish and sends each
request to the replica that holds its prefix; `round_robin` spreads them regardless.
Text prompts are scored through the replicas' `/v1/completions/render`."""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_harness import RedisServer, needs_redis
from serve_harness import ServeProcess

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
    "vllm-router"
)
BLOCK = 16  # tokens per block: the replicas' --block-size and the router's
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (kvstrata[fleet])"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def served(base: str) -> int:
    """Completions a replica answered, from its /metrics."""
    with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("kvstrata_http_requests_total{") and 'path="/v1/completions"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


class Replica:
    """`kvstrata serve --model tiny` publishing KV events, on fixed ports (a restart
    comes back where the router expects it)."""

    def __init__(self, *argv: str) -> None:
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.argv = argv
        self.start()

    def start(self) -> None:
        config = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        self.proc = ServeProcess(
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK),
            "--served-model-name",
            "tiny",
            "--kv-events-config",
            json.dumps(config),
            *self.argv,
        )
        self.url = self.proc.url  # http://127.0.0.1:PORT/v1
        self.origin = self.url.removesuffix("/v1")


def stop(router: subprocess.Popen | None, replicas: tuple[Replica, ...] = ()) -> None:
    """Stop the router and whichever of the replicas still run."""
    if router is not None:
        router.terminate()
        router.wait(timeout=60)
    for replica in replicas:
        if replica.proc.proc.poll() is None:
            replica.proc.proc.terminate()
            replica.proc.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    started = [Replica(), Replica()]
    yield started
    stop(None, tuple(started))


def start_router(policy: str, replicas: list[Replica]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    argv += ["--worker-urls", *(r.origin for r in replicas)]
    if policy == "kv_aware":
        for r in replicas:
            argv += ["--kv-event-source", f"{r.origin}=tcp://127.0.0.1:{r.events}"]
            argv += ["--kv-event-replay-source", f"{r.origin}=tcp://127.0.0.1:{r.replay}"]
        argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", "tiny"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"vllm-router exited: {argv}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                break
        except OSError:
            assert time.monotonic() < deadline, "vllm-router did not start"
            time.sleep(0.3)
    time.sleep(1.0)  # its event subscribers connect: a PUB socket keeps no history
    return proc, f"http://127.0.0.1:{port}/v1"


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_requests_follow_the_replica_that_holds_their_prefix(replicas, policy):
    rng = random.Random(policy)
    prefix = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(1024))
    holder, other = replicas
    router, url = start_router(policy, replicas)
    try:
        # one request went before, straight to one replica (its events reach the router)
        warm = post(f"{holder.url}/completions", {"prompt": prefix, "max_tokens": 2})
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        shared = warm["usage"]["prompt_tokens"] // BLOCK * BLOCK  # its full blocks
        time.sleep(0.5)
        before = served(holder.url), served(other.url)
        cached = []
        for i in range(10):
            body = {"model": "tiny", "prompt": f"{prefix} question {i}?", "max_tokens": 2}
            cached.append(post(f"{url}/completions", body)["usage"])
        after = served(holder.url), served(other.url)
    finally:
        stop(router)
    to_holder, to_other = after[0] - before[0], after[1] - before[1]
    assert to_holder + to_other == 10
    if policy == "kv_aware":
        assert to_holder == 10, (to_holder, to_other)
        hits = [u["prompt_tokens_details"]["cached_tokens"] for u in cached]
        assert all(hit >= shared for hit in hits), (hits, shared)
    else:
        assert 3 <= to_holder <= 7, (to_holder, to_other)


def test_render_gives_the_prompt_token_ids(replicas):
    """vLLM's render API: the ids a completion or chat request's prompt becomes."""
    replica = replicas[0]
    items = post(f"{replica.url}/completions/render", {"prompt": ["ab", "abc"], "max_tokens": 3})
    assert [len(item["token_ids"]) for item in items] in ([2, 3], [3, 4])  # with or without BOS
    assert items[0]["token_ids"] == items[1]["token_ids"][:-1]
    assert items[0]["sampling_params"]["max_tokens"] == 3 and items[0]["model"] == "tiny"
    done = post(f"{replica.url}/completions", {"prompt": "abc", "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == len(items[1]["token_ids"])
    chat = post(
        f"{replica.url}/chat/completions/render",
        {"messages": [{"role": "user", "content": "hello"}]},
    )
    assert chat["token_ids"] and all(isinstance(t, int) for t in chat["token_ids"])
    answer = post(
        f"{replica.url}/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1},
    )
    assert answer["usage"]["prompt_tokens"] == len(chat["token_ids"])


def test_a_restarted_replica_announces_its_disk_and_gets_the_traffic_back(tmp_path):
    """Fault: a replica with a disk tier stops (its cached blocks persisted) and comes
    back on the same ports; it announces what its disk kept (AllBlocksCleared, then the
    chains in order), and kv_aware sends the prefix's requests to it again."""
    disk = ("--disk-dir", str(tmp_path / "kv"), "--disk-budget", "64MiB")
    holder, other = Replica(*disk), Replica()
    router = None
    try:
        router, url = start_router("kv_aware", [holder, other])
        prefix = "".join(random.Random(7).choice("qrstuvwxyz \n") for _ in range(1024))
        warm = post(f"{holder.url}/completions", {"prompt": prefix, "max_tokens": 2})
        shared = warm["usage"]["prompt_tokens"] // BLOCK * BLOCK
        holder.proc.stop(signal.SIGTERM)  # graceful: the store persists to its disk
        holder.start()
        # the other replica holds the prefix's first blocks: had the restart announced
        # the chain broken (each block a chain of its own), the router would credit the
        # holder one block and send the requests there
        post(f"{other.url}/completions", {"prompt": prefix[: 3 * BLOCK], "max_tokens": 1})
        time.sleep(1.5)  # the router's subscriber reconnects and hears the announcement
        before = served(holder.url), served(other.url)
        hits = []
        for i in range(6):
            body = {"model": "tiny", "prompt": f"{prefix} again {i}?", "max_tokens": 2}
            hits.append(post(f"{url}/completions", body)["usage"])
        after = served(holder.url), served(other.url)
        assert (after[0] - before[0], after[1] - before[1]) == (6, 0)
        assert hits[0]["prompt_tokens_details"]["cached_tokens"] >= shared  # from disk
    finally:
        stop(router, (holder, other))


def test_a_killed_replica_costs_no_wrong_answer(tmp_path):
    """Fault: one replica is killed (SIGKILL) with the router in front; every request
    after it is answered by the survivor with the same greedy text the survivor gives
    directly, or fails with an HTTP error — never a wrong or truncated answer."""
    first, second = Replica(), Replica()
    router = None
    try:
        router, url = start_router("kv_aware", [first, second])
        prompt = "".join(random.Random(11).choice("abcdef \n") for _ in range(300))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        expected = post(f"{second.url}/completions", body)["choices"][0]["text"]
        post(f"{first.url}/completions", body)  # both hold it: either may be chosen
        first.proc.proc.kill()
        first.proc.proc.wait(timeout=60)
        answered = failed = 0
        for _ in range(8):
            try:
                out = post(f"{url}/completions", body)
            except urllib.error.HTTPError as exc:  # refused, never a wrong answer
                assert exc.code >= 500, exc.code
                failed += 1
                continue
            assert out["choices"][0]["text"] == expected
            assert out["usage"]["completion_tokens"] == 8
            answered += 1
        print(f"after the kill: {answered} answered, {failed} refused")
        assert answered >= 4, (answered, failed)  # the router moves on to the survivor
    finally:
        stop(router, (first, second))


def test_a_router_started_after_the_traffic_learns_what_each_replica_holds(replicas):
    """Fault: the router (re)starts after a replica computed a prefix. Each replica hears
    the new subscription and announces everything it holds again (AllBlocksCleared, then
    its blocks), so kv_aware routes the prefix's requests to it (vllm-router itself asks
    no replay when it subscribes)."""
    holder, other = replicas
    prefix = "".join(random.Random(13).choice("ghijklmn \n") for _ in range(1024))
    post(f"{holder.url}/completions", {"prompt": prefix, "max_tokens": 2})
    router, url = start_router("kv_aware", replicas)  # after the traffic
    try:
        time.sleep(1.5)  # the replicas' next idle tick announces their snapshot
        before = served(holder.url), served(other.url)
        for i in range(6):
            body = {"model": "tiny", "prompt": f"{prefix} late {i}?", "max_tokens": 2}
            post(f"{url}/completions", body)
        after = served(holder.url), served(other.url)
    finally:
        stop(router)
    assert (after[0] - before[0], after[1] - before[1]) == (6, 0)


@needs_redis
def test_a_killed_redis_leaves_the_replicas_serving_from_their_own_tiers(tmp_path):
    """Fault: two replicas share a Redis behind kv_aware; the server is killed. Every
    later request is answered, with the same greedy text as before, the replica that
    computed a prefix still serving it from its own tiers."""
    srv = RedisServer(tmp_path).start()
    remote = ("--remote-url", srv.url)
    holder, other = Replica(*remote), Replica(*remote)
    router = None
    try:
        router, url = start_router("kv_aware", [holder, other])
        prefix = "".join(random.Random(17).choice("opqrstu \n") for _ in range(600))
        body = {"model": "tiny", "prompt": prefix, "max_tokens": 6, "temperature": 0}
        expected = post(f"{holder.url}/completions", body)["choices"][0]["text"]
        srv.stop()  # SIGKILL: the shared tier is gone
        time.sleep(0.5)
        before = served(holder.url)
        for _ in range(4):
            out = post(f"{url}/completions", body)
            assert out["choices"][0]["text"] == expected
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # local tiers
        assert served(holder.url) - before == 4
    finally:
        stop(router, (holder, other))
        srv.stop()
