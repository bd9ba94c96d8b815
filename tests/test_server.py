"""The OpenAI-compatible server (issue #12), end to end: uvicorn on loopback in this
process, the real engine over the embedded model, driven by the official `openai`
client (and httpx for what the client hides: raw bytes, disconnects).

The engine's tier budgets are small (16 device blocks of 16 tokens, 64 on the host), so
eight concurrent requests do not fit the device together and exercise preemption.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
import uvicorn

from kvstrata.engine import Engine, EngineConfig
from kvstrata.modelzoo import load_model
from kvstrata.server import build_app
from kvstrata.server.chat import plain_chat_prompt

MODEL = "kvstrata-code-tiny"
# Python source to cut prompts from (the model was trained on the standard library).
SOURCE = Path(textwrap.__file__).read_text()[2000:9000]
CAPACITY_TOKENS = 80 * 16  # device 1MiB + host 4MiB of 64 KiB blocks


@dataclass
class Served:
    engine: Engine
    url: str
    tokenizer: object

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        return self.engine.metrics.value(name, **labels)


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


@pytest.fixture(scope="module")
def served(one_thread) -> Iterator[Served]:
    engine = make_engine()
    server, thread, url = serve_in_thread(build_app(engine))
    try:
        yield Served(engine, url, engine.tokenizer)
    finally:
        stop(server, thread)
        engine.shutdown()


def wait_idle(engine: Engine, timeout: float = 60.0) -> dict:
    """Poll until nothing runs and no block is held by a live sequence."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats["running"] == stats["waiting"] == stats["preempted"] == 0
        if idle and stats["live_blocks"] == 0 and stats["sequences"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        time.sleep(0.02)


def prompt_of(n_chars: int, start: int = 0) -> str:
    return SOURCE[start : start + n_chars]


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def check_usage(usage, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached < prompt_tokens


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a refused request, checked for shape and one line."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    return error


# -- the endpoints ---------------------------------------------------------------------


def test_completion_non_streaming_and_streaming_agree(served):
    client = served.client()
    prompt = prompt_of(120, 100)
    n_prompt = len(served.tokenizer(prompt)["input_ids"])
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.id.startswith("cmpl-")
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.text
    check_usage(whole.usage, n_prompt, 12)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None
    check_usage(last.usage, n_prompt, 12)
    assert all(c.usage is None for c in deltas)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in deltas) == choice.text
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert len(deltas) > 1  # streamed, not one piece


def test_chat_non_streaming_and_streaming_use_the_plain_template(served):
    client = served.client()
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def parse(line):"},
    ]
    rendered = plain_chat_prompt(messages)
    assert rendered == "system: You write Python.\nuser: def parse(line):\nassistant:"
    n_prompt = len(served.tokenizer(rendered)["input_ids"])

    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    check_usage(whole.usage, n_prompt, 10)
    # The chat prompt is the rendered template: the same as a completion of it.
    assert choice.message.content == greedy(client, rendered, 10)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    *deltas, finish, usage_chunk = chunks
    assert finish.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == choice.message.content
    assert usage_chunk.choices == []
    check_usage(usage_chunk.usage, n_prompt, 10)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_a_tokenizers_chat_template_renders_the_messages(served):
    client, tokenizer = served.client(), served.tokenizer
    assert tokenizer.chat_template is None  # the embedded model has none: set one
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "def f():"},
                                     {"type": "text", "text": "    pass"}]},
    ]  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    try:
        rendered = "<system>Be brief.\n<user>def f():\n    pass\n<assistant>"
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        )
        assert out.usage.prompt_tokens == len(rendered.encode())  # one token per byte
        assert out.choices[0].message.content == greedy(client, rendered, 6)

        tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
        response = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": messages})
        error = error_of(response, 400)
        assert error["param"] == "messages" and "roles must alternate" in error["message"]
    finally:
        tokenizer.chat_template = None


def test_a_repeated_prompt_is_served_from_the_prefix_cache(served):
    client = served.client()
    prompt = "# cached-prefix test\n" + prompt_of(90, 3000)
    n_prompt = len(served.tokenizer(prompt)["input_ids"])
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every full block of the prompt but the one holding its last token is reused.
    assert cached == (n_prompt - 1) // 16 * 16 > 0
    assert second.choices[0].text == first.choices[0].text

    # A tenant salt keeps prefixes apart: tenant "b" does not see tenant "a"'s blocks.
    def cached_for(salt: str) -> int:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"salt": salt}
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert [cached_for("a"), cached_for("b"), cached_for("a")] == [0, 0, cached]


def test_token_id_prompt_stop_strings_and_seeded_sampling(served):
    client = served.client()
    prompt = prompt_of(80, 500)
    ids = served.tokenizer(prompt)["input_ids"]
    text = greedy(client, prompt, 16)
    assert greedy(client, ids, 16) == text  # a prompt of token ids is the same prompt

    stop = text[5:7]
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]

    sampled = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]  # the same seed, the same tokens


def test_models_health_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{served.url}/metrics")
    assert metrics.status_code == 200, metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "kvstrata_generation_tokens_total",
        "kvstrata_time_to_first_token_seconds_bucket",
        "kvstrata_requests_running",
        "kvstrata_tier_used_bytes",
        'kvstrata_http_requests_total{path="/health",status="200"}',
    ):
        assert name in metrics.text, name


# -- many at once -----------------------------------------------------------------------

# (start, characters, max_tokens): prompts of 9 to 150 tokens, each its own output length.
REQUESTS = [(0, 150, 24), (400, 9, 8), (900, 60, 20), (1500, 120, 12),
            (2100, 33, 16), (2800, 90, 10), (3500, 140, 22), (4200, 45, 14)]  # fmt: skip


def test_concurrent_requests_equal_each_alone_and_transformers(served):
    client = served.client()
    prompts = [(prompt_of(n, start), max_tokens) for start, n, max_tokens in REQUESTS]
    alone = [greedy(client, p, m) for p, m in prompts]
    assert len(set(alone)) > 1  # different prompts, different continuations
    wait_idle(served.engine)

    barrier = threading.Barrier(len(prompts))

    def at_once(item: tuple[str, int]) -> str:
        barrier.wait()
        return greedy(client, *item)

    seen = []  # (running, waiting, preempted) after each engine step, while they run
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            stats = served.engine.stats()
            seen.append((stats["running"], stats["waiting"], stats["preempted"]))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(at_once, prompts))
    finally:
        done.set()
        watcher.join()
    assert together == alone
    assert max(running for running, _, _ in seen) > 1  # they were batched together
    stats = wait_idle(served.engine)  # no block leaked
    assert stats["live_blocks"] == 0 and stats["sequences"] == 0

    # ... and equal to transformers' own generate with a DynamicCache (a fresh model:
    # the engine's has been switched to the kvstrata attention).
    model, tokenizer = load_model("default")
    for (prompt, max_tokens), text in list(zip(prompts, alone, strict=True))[:3]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert text == expected


# -- clients that leave -----------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served):
    aborted = served.metric("kvstrata_requests_finished_total", reason="abort")
    body = {"model": MODEL, "prompt": prompt_of(60), "max_tokens": 900, "temperature": 0}
    events = []
    with (
        httpx.Client(base_url=served.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 2:
                    break  # leaving the block closes the connection mid-stream
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    wait_idle(served.engine)
    # Freed because it was aborted, not because it ran to its 900 tokens.
    assert served.metric("kvstrata_requests_finished_total", reason="abort") == aborted + 1


def test_a_client_that_gives_up_on_a_whole_completion_frees_its_blocks(served):
    aborted = served.metric("kvstrata_requests_finished_total", reason="abort")
    body = {"model": MODEL, "prompt": prompt_of(60), "max_tokens": 900, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # 900 tokens take seconds; it waits 0.5 s
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=0.5)
    wait_idle(served.engine)
    assert served.metric("kvstrata_requests_finished_total", reason="abort") == aborted + 1


# -- refusals ---------------------------------------------------------------------------

TOO_LONG = SOURCE[: CAPACITY_TOKENS + 100]  # more than every tier, fewer than 4096 positions

BAD_REQUESTS = [  # (endpoint, body, status, param, words in the message)
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ["max_tokens=-1"]),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", [">= 1"]),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", ["'hot'"]),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p", ["top_p=0"]),
    ("completions", {"prompt": "x", "n": 2}, 400, "n", ["n=2", "one choice"]),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo", ["echo"]),
    ("completions", {"prompt": "x", "temprature": 0}, 400, "temprature", ["'temperature'"]),
    ("completions", {"prompt": ""}, 400, "prompt", ["non-empty"]),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", ["one prompt per request"]),
    ("completions", {"prompt": [1, 999]}, 400, "prompt[1]", ["999", "[0, 259)"]),
    ("completions", {"prompt": "x", "stream_options": {}}, 400, "stream_options", ["stream"]),
    ("completions", {"prompt": TOO_LONG}, 400, None, ["all tiers", "host_budget"]),
    ("completions", {"prompt": "x", "max_tokens": 4096}, 400, None, ["context length is 4096"]),
    ("chat/completions", {"messages": []}, 400, "messages", ["non-empty"]),
    (
        "chat/completions",
        {"messages": [{"role": "bot", "content": "x"}]},
        400,
        "messages[0].role",
        ["'bot'"],
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "max_completion_tokens": 2,
        },
        400,
        "max_tokens",
        ["max_completion_tokens"],
    ),  # fmt: skip
    ("completions", {"model": "gpt-4o", "prompt": "x"}, 404, "model", ["'gpt-4o'", MODEL]),
]


@pytest.mark.parametrize(
    "endpoint, body, status, param, words", BAD_REQUESTS, ids=[str(i) for i in range(17)]
)
def test_bad_requests_are_refused_and_the_server_keeps_serving(
    served, endpoint, body, status, param, words
):
    response = httpx.post(f"{served.url}/v1/{endpoint}", json=body, timeout=60)
    error = error_of(response, status)
    assert error["param"] == param
    for word in words:
        assert word in error["message"]
    assert greedy(served.client(), "import os", 2)  # still serving
    wait_idle(served.engine)


def test_malformed_json_and_unknown_routes(served):
    for raw in (b'{"prompt": "x",', b"[1, 2]", b"\xff\xfe"):
        response = httpx.post(
            f"{served.url}/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert error_of(response, 400)["code"] == "invalid_json"
    assert "GET /v1/nothing" in error_of(httpx.get(f"{served.url}/v1/nothing"), 404)["message"]
    assert error_of(httpx.get(f"{served.url}/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        served.client().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    assert greedy(served.client(), "import os", 2)


def test_stopping_the_server_or_the_engine_answers_503(one_thread):
    engine = make_engine()
    body = {"model": "tiny", "prompt": "import os", "max_tokens": 2}
    # What `kvstrata serve` does when its shutdown grace period is over: open requests
    # are aborted, their streams end with an error event, new requests get a 503.
    app = build_app(engine, served_model_name="tiny")
    server, thread, url = serve_in_thread(app)
    try:
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        long = {**body, "max_tokens": 900, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines)[len("data: ") :])["choices"][0]["finish_reason"] is None
            app.state.server.stop_requests()
            *_, error_event, done = list(lines)
        assert done == "data: [DONE]"
        error = json.loads(error_event[len("data: ") :])["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"]
        refused = error_of(httpx.post(f"{url}/v1/completions", json=body), 503)
        assert "shutting down" in refused["message"]
        wait_idle(engine)
    finally:
        stop(server, thread)

    server, thread, url = serve_in_thread(build_app(engine, served_model_name="tiny"))
    try:
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        engine.shutdown()
        refused = error_of(httpx.post(f"{url}/v1/completions", json=body), 503)
        assert "shut down" in refused["message"]
        assert error_of(httpx.get(f"{url}/health"), 503)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        stop(server, thread)
        engine.shutdown()
