"""The OpenAI-compatible server (issue #12), end to end: uvicorn on loopback in this
process, the real engine over the embedded model, driven by the official `openai`
client (and httpx for what the client hides: raw bytes, disconnects).

The engine's tier budgets are small (16 device blocks of 16 tokens, 64 on the host), so
eight concurrent requests do not fit the device together and exercise preemption.
"""

from __future__ import annotations

import concurrent.futures
import json
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

from kvstrata.core.errors import ConfigError
from kvstrata.engine import Engine
from kvstrata.server import build_app
from kvstrata.server.chat import plain_chat_prompt
from kvstrata.server.limits import ServeLimits
from kvstrata.workload.zoo import load_model
from serve_harness import MODEL, error_of, make_engine, serve_in_thread, stop

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
        "{% if add_generation_prompt %}<assistant>{% endif %}{% if lang %}# {{ lang }}\n{% endif %}"
    )
    try:
        rendered = "<system>Be brief.\n<user>def f():\n    pass\n<assistant>"
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        )
        assert out.usage.prompt_tokens == len(rendered.encode())  # one token per byte
        assert out.choices[0].message.content == greedy(client, rendered, 6)
        # vLLM's chat_template_kwargs are the template's variables
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"chat_template_kwargs": {"lang": "python"}, "add_generation_prompt": False},
        )
        rendered = "<system>Be brief.\n<user>def f():\n    pass\n# python\n"
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
    # vLLM's name for it, cache_salt, is the same tenant (not ignored, not refused)
    vllm_named = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": "b"}
    )
    assert vllm_named.usage.prompt_tokens_details.cached_tokens == cached
    both = {"salt": "a", "cache_salt": "b"}
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=both)


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
    assert served.client().models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    assert httpx.get(f"{served.url}/v1/models/").json()["data"][0]["id"] == MODEL
    other = error_of(httpx.get(f"{served.url}/v1/models/no-such-model"), 404)
    assert other["code"] == "model_not_found" and "no-such-model" in other["message"]
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


# -- choices, prompt lists, logprobs, echo, penalties ---------------------------------


@pytest.fixture(scope="module")
def reference_model() -> torch.nn.Module:
    """The embedded model as loaded, with transformers' own attention (the engine's copy
    is switched to the kvstrata attention)."""
    return load_model("default")[0]


def direct_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's fp32 logits at every position (row p: token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def greedy_ids(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        out.append(int(direct_logprobs(model, out)[-1].argmax()))
    return out[len(ids) :]


def close(expected):
    """Logprobs through the engine's paged attention vs one plain forward (fp32)."""
    return pytest.approx(expected, rel=1e-5, abs=1e-5)


def top_dict(tokenizer, row: torch.Tensor, k: int) -> dict[str, float]:
    """OpenAI's completions top_logprobs entry: token text -> logprob, most likely first
    (a text two ids share keeps the likelier)."""
    best = torch.topk(row, k)
    out: dict[str, float] = {}
    for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
        out.setdefault(tokenizer.decode([t]), v)
    return out


def events_of(url: str, endpoint: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response (up to [DONE])."""
    chunks = []
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return chunks
                chunks.append(json.loads(data))
    raise AssertionError("the stream ended without [DONE]")


def test_n_seeded_choices_are_reproducible_and_differ(served):
    client = served.client()
    prompt = "# n choices share their prompt\n" + prompt_of(40, 700)  # not cached yet
    n_prompt = len(served.tokenizer(prompt)["input_ids"])

    def run(n: int, seed: int):
        return client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )

    cached = served.metric("kvstrata_cached_prompt_tokens_total")
    first = run(3, 5)
    # choices 1 and 2 started once choice 0 had computed the prompt: they reused its blocks
    shared = served.metric("kvstrata_cached_prompt_tokens_total") - cached
    assert shared == 2 * ((n_prompt - 1) // 16 * 16) > 0
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3  # sampled choices differ ...
    assert [c.text for c in run(3, 5).choices] == texts  # ... and are reproducible
    # choice i is the request with seed + i (vLLM's rule)
    assert [run(1, 5 + i).choices[0].text for i in range(3)] == texts
    # the prompt counts once, every choice's tokens count (OpenAI's usage)
    check_usage(first.usage, n_prompt, 3 * 8)


def test_a_prompt_list_equals_separate_requests(served):
    client = served.client()
    prompts = [prompt_of(30, 1000), prompt_of(50, 1200), prompt_of(20, 1400)]
    ids = [served.tokenizer(p)["input_ids"] for p in prompts]
    extra = {"ignore_eos": True}
    alone = [greedy(client, p, 6) for p in prompts]
    assert len(set(alone)) == 3
    batch = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, extra_body=extra
    )
    # one choice per (prompt, n), index = prompt_index * n + i
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [t for t in alone for _ in range(2)]
    check_usage(batch.usage, sum(map(len, ids)), 6 * 6)
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body=extra
    )
    assert [c.text for c in by_ids.choices] == alone
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True, extra_body=extra
        )
    )
    streamed = ["", "", ""]
    for chunk in chunks:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
    assert streamed == alone
    wait_idle(served.engine)


def test_logprobs_are_the_models_log_softmax(served, reference_model):
    """Completions (`logprobs: k`, with echo: the prompt's tokens too) and chat
    (`logprobs: true, top_logprobs: k`) report log_softmax of the model's logits."""
    client, tok = served.client(), served.tokenizer
    prompt = prompt_of(40, 2600)
    ids = tok(prompt)["input_ids"]
    full = ids + greedy_ids(reference_model, ids, 5)
    lp = direct_logprobs(reference_model, full)
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    (choice,) = out.choices
    lps = choice.logprobs
    assert choice.text.startswith(prompt)
    assert lps.tokens == [tok.decode([t]) for t in full]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:] == close([lp[i - 1, full[i]].item() for i in range(1, len(full))])
    for i in range(1, len(full)):
        want = top_dict(tok, lp[i - 1], 3)
        want[tok.decode([full[i]])] = lp[i - 1, full[i]].item()  # the token itself, always
        assert list(lps.top_logprobs[i]) == list(want)
        assert list(lps.top_logprobs[i].values()) == close(list(want.values()))
    assert lps.text_offset == [len("".join(lps.tokens[:i])) for i in range(len(full))]

    messages = [{"role": "user", "content": "def mean(xs):"}]
    chat_ids = tok(plain_chat_prompt(messages))["input_ids"]
    generated = greedy_ids(reference_model, chat_ids, 4)
    lp = direct_logprobs(reference_model, chat_ids + generated)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in generated]
    assert (
        bytes(b for c in content for b in c.bytes).decode(errors="replace")
        == reply.choices[0].message.content
    )
    for j, entry in enumerate(content):
        row = lp[len(chat_ids) - 1 + j]
        assert entry.logprob == close(row[generated[j]].item())
        best = torch.topk(row, 2)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([t]) for t in best.indices]
        assert [t.logprob for t in entry.top_logprobs] == close(best.values.tolist())


def test_echo_scores_the_prompt_like_lm_eval(served, reference_model):
    """lm-evaluation-harness' loglikelihood call: token-id prompts (context +
    continuation), echo, logprobs 1, max_tokens 0 (or 1, dropping the last token): the
    continuation's log-likelihood and whether it is greedy — even for a prompt whose
    blocks the prefix cache holds (scoring computes every prompt position)."""
    client, tok = served.client(), served.tokenizer
    context = tok(prompt_of(40, 3100))["input_ids"]
    endings = [prompt_of(12, 3140), "    return None\n"]
    prompts = [context + tok(e)["input_ids"] for e in endings]
    client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1)  # cached now
    body = {
        "model": MODEL,
        "prompt": prompts,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 0,
        "temperature": 0,
    }
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    assert response["usage"]["completion_tokens"] == 0
    assert response["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ctxlen = len(context)
    scores = []
    for choice, ids in zip(response["choices"], prompts, strict=True):
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(ids)
        lp = direct_logprobs(reference_model, ids)
        expected = sum(lp[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
        got = lps["token_logprobs"][ctxlen:]
        assert sum(got) == pytest.approx(expected, rel=1e-5, abs=1e-4)
        is_greedy = all(
            t == max(top.values()) for t, top in zip(got, lps["top_logprobs"][ctxlen:], strict=True)
        )
        assert is_greedy == all(lp[i - 1].argmax() == ids[i] for i in range(ctxlen, len(ids)))
        scores.append(got)
    # max_tokens 1, the last (generated) token dropped: what lm-eval sends today
    one = httpx.post(
        f"{served.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60
    ).json()
    for choice, got in zip(one["choices"], scores, strict=True):
        assert choice["logprobs"]["token_logprobs"][ctxlen:-1] == close(got)
    wait_idle(served.engine)


def test_streamed_choices_and_logprobs_reassemble_to_the_whole_response(served):
    completion = {
        "model": MODEL,
        "prompt": [prompt_of(30, 2000), prompt_of(25, 2300)],
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 21,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
    }
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "class Queue:"}],
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 4,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    options = {"stream": True, "stream_options": {"include_usage": True}}
    for endpoint, body in (("completions", completion), ("chat/completions", chat)):
        whole = httpx.post(f"{served.url}/v1/{endpoint}", json=body, timeout=60).json()
        chunks = events_of(served.url, endpoint, {**body, **options})
        *deltas, last = chunks
        assert last["choices"] == []
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert last["usage"][key] == whole["usage"][key]  # (cached: the 2nd is cached)
        got: dict[int, dict] = {}
        for chunk in deltas:
            (c,) = chunk["choices"]
            into = got.setdefault(c["index"], {"text": "", "lps": {}, "finish": []})
            into["finish"].append(c["finish_reason"])
            if endpoint == "completions":
                into["text"] += c["text"]
                for key, values in (c["logprobs"] or {}).items():
                    into["lps"].setdefault(key, []).extend(values)
            else:
                into["text"] += c["delta"].get("content") or ""
                content = (c["logprobs"] or {}).get("content", [])
                into["lps"].setdefault("content", []).extend(content)
        assert sorted(got) == [c["index"] for c in whole["choices"]]
        assert len({g["text"] for g in got.values()}) == len(got)  # the choices differ
        for c in whole["choices"]:
            mine = got[c["index"]]
            assert mine["finish"][-1] == c["finish_reason"] == "length"
            assert not any(mine["finish"][:-1])
            if endpoint == "completions":
                assert mine["text"] == c["text"]
                assert mine["lps"]["tokens"] == c["logprobs"]["tokens"]
                assert mine["lps"]["text_offset"] == c["logprobs"]["text_offset"]
                assert mine["lps"]["token_logprobs"][1:] == close(
                    c["logprobs"]["token_logprobs"][1:]
                )
                assert [list(t or {}) for t in mine["lps"]["top_logprobs"]] == [
                    list(t or {}) for t in c["logprobs"]["top_logprobs"]
                ]
            else:
                assert mine["text"] == c["message"]["content"]
                streamed, full = mine["lps"]["content"], c["logprobs"]["content"]
                assert [t["token"] for t in streamed] == [t["token"] for t in full]
                assert [t["logprob"] for t in streamed] == close([t["logprob"] for t in full])
    wait_idle(served.engine)


def test_penalties_and_logit_bias_reach_the_engine(served):
    """The request's penalties are the engine's (greedy too: OpenAI applies them at
    temperature 0); they change the output of a repetitive prompt."""
    from kvstrata.engine import SamplingParams

    client = served.client()
    prompt = "abcabcabcabcabcabcabcabc"
    plain = greedy(client, prompt, 10)
    fields = {
        "frequency_penalty": 1.0,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "min_p": 0.1,
        "logit_bias": {"120": 3.5},
    }
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={k: v for k, v in fields.items() if k != "frequency_penalty"},
        frequency_penalty=1.0,
    )
    direct = served.engine.generate(
        [prompt],
        SamplingParams(max_tokens=10, **{**fields, "logit_bias": {120: 3.5}}),
    )[0]
    assert out.choices[0].text == direct.text != plain


def test_the_openai_sdk_with_n_logprobs_and_a_prompt_list(served):
    client = served.client()
    messages = [{"role": "user", "content": "import json"}]
    extra = {"ignore_eos": True}
    common = dict(
        model=MODEL, messages=messages, n=2, max_tokens=5, temperature=1.0, seed=9,
        extra_body=extra,
    )  # fmt: skip
    chat = client.chat.completions.create(**common, logprobs=True, top_logprobs=3)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    for c in chat.choices:
        assert len(c.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
        assert (
            bytes(b for t in c.logprobs.content for b in t.bytes).decode(errors="replace")
            == c.message.content
        )
    stream = client.chat.completions.create(**common, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]

    comp = client.completions.create(
        model=MODEL,
        prompt=["def f(x):", "import sys"],
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body=extra,
    )
    assert [c.index for c in comp.choices] == [0, 1]
    for c in comp.choices:
        assert len(c.logprobs.tokens) == 3 and "".join(c.logprobs.tokens) == c.text
        assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
        assert c.logprobs.text_offset == [0, 1, 2]


def test_fields_clients_commonly_send_are_accepted(served):
    """What SDKs, LangChain and benchmark clients send at their defaults changes
    nothing; chat's add_generation_prompt and chat_template_kwargs reach the template."""
    client = served.client()
    prompt = prompt_of(30, 5000)
    common = {
        "user": "u-1",
        "seed": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": {},
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "stream": False,
        "n": 1,
        "metadata": {"run": "x"},
    }
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **common}
    response = httpx.post(f"{served.url}/v1/completions", json={**body, "logprobs": None})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy(client, prompt, 6)

    messages = [{"role": "user", "content": "def g():"}]
    chat_body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": False,
        "top_logprobs": None,
        "prediction": None,
        "modalities": ["text"],
        "add_generation_prompt": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tool_choice": "none",
        "response_format": {"type": "text"},
        **common,
    }
    response = httpx.post(f"{served.url}/v1/chat/completions", json=chat_body)
    assert response.status_code == 200, response.text
    reply = response.json()["choices"][0]
    assert reply["logprobs"] is None
    assert reply["message"]["content"] == greedy(client, plain_chat_prompt(messages), 6)
    no_turn = httpx.post(
        f"{served.url}/v1/chat/completions", json={**chat_body, "add_generation_prompt": False}
    ).json()
    rendered = plain_chat_prompt(messages, add_generation_prompt=False)
    assert rendered == "user: def g():\n"
    assert no_turn["usage"]["prompt_tokens"] == len(rendered.encode())  # a byte per token
    assert no_turn["choices"][0]["message"]["content"] == greedy(client, rendered, 6)


@pytest.fixture
def bos_tokenizer(served):
    """The served tokenizer, adding a <bos> in front of every prompt it encodes (as
    Llama's and Gemma's do) for the length of a test."""
    from tokenizers.processors import TemplateProcessing

    tok = served.tokenizer
    backend = tok.backend_tokenizer
    before = backend.post_processor
    backend.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)]
    )
    try:
        yield tok
    finally:
        backend.post_processor = before


def check_placed(text: str, lps: dict) -> None:
    """Every token's text is where text_offset says in the returned text, and the
    tokens' texts join to it."""
    for token, offset in zip(lps["tokens"], lps["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token
    assert lps["text_offset"] == sorted(lps["text_offset"])
    assert "".join(lps["tokens"]) == text


def test_token_texts_and_offsets_with_a_bos_and_characters_split_over_tokens(served, bos_tokenizer):
    """A tokenizer that adds <bos> (absent from the echoed text) and a byte-level one
    that splits é, € and 😀 over 2-4 tokens: each token's text is what it adds to the
    text (empty for all but a character's last byte), text_offset is where that text
    is, whole and streamed alike; chat's token / bytes likewise."""
    tok = bos_tokenizer
    prompt = "é€😀 x = 'ü'\n"
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(prompt.encode())
    # sampled, with the bytes of é and 😀 pushed up: the output splits characters too
    bias = {"195": 15, "169": 15, "240": 14, "159": 14, "152": 13, "128": 13}
    body = {
        "model": MODEL,
        "prompt": prompt,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 16,
        "temperature": 1.5,
        "seed": 2,
        "ignore_eos": True,
        "logit_bias": bias,
    }
    whole = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    (choice,) = whole["choices"]
    text, lps = choice["text"], choice["logprobs"]
    assert text.startswith(prompt) and any(ord(c) > 127 for c in text[len(prompt) :])
    assert lps["tokens"][:6] == ["", "", "é", "", "", "€"]  # <bos>, then é's 2 bytes, ...
    assert lps["text_offset"][:6] == [0, 0, 0, 1, 1, 1]
    check_placed(text, lps)
    for i, top in enumerate(lps["top_logprobs"][1:], 1):
        assert top[lps["tokens"][i]] == lps["token_logprobs"][i]  # the token itself
    streamed: dict = {"tokens": [], "text_offset": []}
    pieces = []
    for chunk in events_of(served.url, "completions", {**body, "stream": True}):
        (c,) = chunk["choices"]
        pieces.append(c["text"])
        for key in streamed:
            streamed[key] += (c["logprobs"] or {}).get(key, [])
    assert "".join(pieces) == text
    assert streamed == {key: lps[key] for key in streamed}

    # a prompt of token ids (its <bos> included) echoes its decode, <bos> and all
    by_ids = httpx.post(
        f"{served.url}/v1/completions", json={**body, "prompt": ids, "max_tokens": 4}, timeout=60
    ).json()["choices"][0]
    assert by_ids["text"].startswith("<bos>" + prompt)
    assert by_ids["logprobs"]["tokens"][:3] == ["<bos>", "", "é"]
    check_placed(by_ids["text"], by_ids["logprobs"])

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 16,
        "temperature": 1.5,
        "seed": 3,
        "ignore_eos": True,
        "logit_bias": bias,
    }
    reply = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60).json()
    content = reply["choices"][0]["message"]["content"]
    entries = reply["choices"][0]["logprobs"]["content"]
    assert any(ord(c) > 127 for c in content)
    assert "".join(e["token"] for e in entries) == content
    assert all(len(e["bytes"]) == 1 for e in entries)  # each token is one byte
    assert bytes(b for e in entries for b in e["bytes"]).decode(errors="replace") == content
    assert all(len(e["top_logprobs"]) == 2 for e in entries)  # exactly top_logprobs
    wait_idle(served.engine)


def test_token_texts_keep_a_sentencepiece_words_leading_space():
    """A Metaspace (SentencePiece) tokenizer that adds <s>, as Llama's: a word decoded
    alone loses its leading space, and "<s>" in front of it adds one. The tokens'
    texts are decoded in context, special tokens skipped, as the text is."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from kvstrata.engine.params import RequestOutput, TokenLogprobs
    from kvstrata.server.detokenizer import ChoiceTokens, TokenTexts, prompt_text
    from kvstrata.server.responses import chat_logprobs, completion_logprobs

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5, "▁é": 6}
    raw = Tokenizer(models.WordLevel({**vocab, "<s>": 7}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.add_special_tokens([AddedToken("<s>", special=True)])
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 7)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>")
    echo = "The capital is"
    prompt, out = tok(echo)["input_ids"], [4, 5, 6, 4]
    assert prompt == [7, 1, 2, 3] and tok.decode(prompt[:2]) == "<s> The"

    def lp(token: int) -> TokenLogprobs:
        return TokenLogprobs(token, -1.0, ((2, -0.5), (token, -1.0)))

    texts = TokenTexts(tok)
    pieces = ChoiceTokens(tok, texts, prompt, set())
    infos = pieces.prompt(prompt, [None, lp(1), lp(2), lp(3)], echo)
    outputs = [
        RequestOutput("r", out[:2], " Paris", logprobs=[lp(t) for t in out[:2]]),
        RequestOutput("r", out[2:], ". é Paris", "length", logprobs=[lp(t) for t in out[2:]]),
    ]
    for output in outputs:
        infos += pieces.generated(output)
    lps = completion_logprobs(infos)
    text = echo + " Paris. é Paris"
    assert lps["tokens"] == ["", "The", " capital", " is", " Paris", ".", " é", " Paris"]
    assert lps["text_offset"] == [0, 0, 3, 11, 14, 20, 21, 23]
    check_placed(text, lps)
    assert lps["top_logprobs"][4] == {" capital": -0.5, " Paris": -1.0}  # in context too
    chat = chat_logprobs(infos[4:], texts)["content"]
    assert [e["token"] for e in chat] == [" Paris", ".", " é", " Paris"]
    assert bytes(b for e in chat for b in e["bytes"]) == " Paris. é Paris".encode()
    # a prompt of token ids echoes <s> by name
    assert prompt_text(tok, prompt) == "<s>The capital is"
    again = ChoiceTokens(tok, texts, prompt, set())
    placed = again.prompt(prompt, [None] * 4, "<s>The capital is")
    assert [(i.text, i.offset) for i in placed] == [
        ("<s>", 0),
        ("The", 3),
        (" capital", 6),
        (" is", 14),
    ]


def test_top_logprobs_hold_the_chosen_token(served):
    """Completions: the chosen token is always in top_logprobs (OpenAI: up to
    logprobs + 1 entries; logprobs 0 gives it alone). Chat lists exactly top_logprobs."""
    prompt = prompt_of(30, 5400)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    zero = httpx.post(
        f"{served.url}/v1/completions", json={**body, "logprobs": 0, "temperature": 0}
    ).json()["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [
        {t: v} for t, v in zip(zero["tokens"], zero["token_logprobs"], strict=True)
    ]
    sampled = httpx.post(
        f"{served.url}/v1/completions",
        json={**body, "logprobs": 1, "temperature": 1.5, "seed": 2, "echo": True},
    ).json()["choices"][0]["logprobs"]
    tops = sampled["top_logprobs"]
    assert tops[0] is None
    rows = zip(sampled["tokens"], sampled["token_logprobs"], tops, strict=True)
    for token, value, top in list(rows)[1:]:
        assert top[token] == value and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in tops[1:])  # some token was not the likeliest
    chat = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8,
            "temperature": 1.5,
            "seed": 2,
            "logprobs": True,
            "top_logprobs": 1,
            "ignore_eos": True,
        },
    ).json()["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 1 for e in chat)
    assert any(e["top_logprobs"][0]["token"] != e["token"] for e in chat)


def test_echo_alone_is_not_scored_and_uses_the_prefix_cache(served):
    """echo with max_tokens 0 and no logprobs returns the prompt: computed (its cached
    blocks reused), not scored."""
    prompt = "# echo alone\n" + prompt_of(60, 5600)
    n_prompt = len(served.tokenizer(prompt)["input_ids"])
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0}
    first, second = (httpx.post(f"{served.url}/v1/completions", json=body).json() for _ in range(2))
    for out in (first, second):
        (choice,) = out["choices"]
        assert (choice["text"], choice["logprobs"], choice["finish_reason"]) == (
            prompt,
            None,
            "length",
        )
        assert out["usage"]["completion_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n_prompt - 1) // 16 * 16 > 0


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(served):
    prompt = prompt_of(40, 5800)
    n_prompt = len(served.tokenizer(prompt)["input_ids"])
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chunks, last = events_of(served.url, "completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == n_prompt for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6 and len(chunks) > 1
    assert all(
        c["usage"]["total_tokens"] == n_prompt + c["usage"]["completion_tokens"] for c in chunks
    )
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    chat = {**body, "messages": [{"role": "user", "content": prompt}]}
    del chat["prompt"]
    chat_chunks = events_of(served.url, "chat/completions", chat)
    assert all(c["usage"] is not None for c in chat_chunks)
    assert chat_chunks[0]["usage"]["completion_tokens"] == 0  # the role chunk
    # without include_usage there is no usage at all (vLLM's rule)
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all("usage" not in c for c in events_of(served.url, "completions", body))


def test_every_choice_is_checked_before_any_is_submitted(served):
    finished = served.metric("kvstrata_requests_finished_total", reason="abort")
    generated = served.metric("kvstrata_generation_tokens_total")
    body = {"model": MODEL, "prompt": ["import os", TOO_LONG], "max_tokens": 4}
    error = error_of(httpx.post(f"{served.url}/v1/completions", json=body, timeout=60), 400)
    assert "all tiers" in error["message"]
    wait_idle(served.engine)
    # prompt 0 never ran: nothing was submitted, so nothing was aborted
    assert served.metric("kvstrata_requests_finished_total", reason="abort") == finished
    assert served.metric("kvstrata_generation_tokens_total") == generated


def test_later_choices_start_when_the_first_has_computed_the_prompt(served):
    """A stop string holds text back (no output until the end): the other choices still
    start at choice 0's first token, so they run alongside it."""
    body = {
        "model": MODEL,
        "prompt": "# choices alongside\n" + prompt_of(40, 6000),
        "n": 3,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stop": ["#" * 60],
    }
    wait_idle(served.engine)
    seen = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(served.engine.stats()["running"])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    finally:
        done.set()
        watcher.join()
    assert len({c["text"] for c in out["choices"]}) == 1  # greedy: the same three
    assert max(seen) == 3


def test_choices_after_the_first_are_not_started_once_the_server_stops():
    """Choice 0's first output comes after stop_requests: the choices waiting for it
    are never submitted, they end as aborted."""
    import asyncio

    from kvstrata.engine.params import RequestOutput, SamplingParams
    from kvstrata.server.choices import Choices, Job

    class Engine:
        def __init__(self) -> None:
            self.submitted: list[tuple[str, dict]] = []
            self.callbacks: dict = {}

        def submit(self, prompt, params, *, request_id, on_output, salt, **extra):
            self.submitted.append((request_id, extra))
            self.callbacks[request_id] = on_output

        def abort(self, request_id) -> None:
            pass

    async def run(stopping: bool) -> tuple[list, list]:
        engine = Engine()
        jobs = [Job(i, 0, f"r-{i}", [1] * 40, SamplingParams(), "", None if i == 0 else 0)
                for i in range(3)]  # fmt: skip
        choices = Choices(engine, jobs, None, lambda: stopping)
        choices.start()
        assert engine.submitted == [("r-0", {"first_output": True})]
        engine.callbacks["r-0"](RequestOutput("r-0", [7]))
        got = [await choices.__anext__()]
        if stopping:
            got += [await choices.__anext__(), await choices.__anext__()]
        return [rid for rid, _ in engine.submitted], [(i, o.finish_reason) for i, o in got]

    assert asyncio.run(run(False)) == (["r-0", "r-1", "r-2"], [(0, None)])
    assert asyncio.run(run(True)) == (["r-0"], [(0, None), (1, "abort"), (2, "abort")])


def test_chat_template_kwargs_take_template_variables_only():
    from kvstrata.server.chat import template_options
    from kvstrata.server.errors import APIError

    class Tokenizer:  # an apply_chat_template with a parameter of its own
        def apply_chat_template(self, conversation, *, strict_roles=False, **kwargs):
            raise AssertionError("not called")

    for key in ("strict_roles", "chat_template", "tokenize", "return_offsets", "documents"):
        with pytest.raises(APIError) as refused:
            template_options({"chat_template_kwargs": {key: 1}}, Tokenizer())
        assert refused.value.param == f"chat_template_kwargs.{key}"
        assert "not a template variable" in refused.value.message
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    assert template_options(body, Tokenizer()) == (True, {"enable_thinking": False})


def test_a_slow_chat_template_does_not_hold_up_the_server(served, monkeypatch):
    """The template renders in a worker thread: /health answers meanwhile."""
    tok = served.tokenizer
    entered, release = threading.Event(), threading.Event()
    real = tok.apply_chat_template

    def slow(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    tok.apply_chat_template = slow
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x = 1"}], "max_tokens": 2}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            url = f"{served.url}/v1/chat/completions"
            reply = pool.submit(httpx.post, url, json=body, timeout=60)
            try:
                assert entered.wait(30)
                health = httpx.get(f"{served.url}/health", timeout=5)
                assert health.json() == {"status": "ok"}
            finally:
                release.set()
            assert reply.result().status_code == 200
    finally:
        del tok.apply_chat_template  # the class's again


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


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served, n):
    aborted = served.metric("kvstrata_requests_finished_total", reason="abort")
    body = {"model": MODEL, "prompt": prompt_of(60), "max_tokens": 900, "temperature": 0}
    events = []
    with (
        httpx.Client(base_url=served.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True, "n": n}) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 2:
                    break  # leaving the block closes the connection mid-stream
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    wait_idle(served.engine)
    # Freed because it was aborted, not because it ran to its 900 tokens: every choice
    # (the later ones start with choice 0's first output, before it is sent)
    assert served.metric("kvstrata_requests_finished_total", reason="abort") == aborted + n


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
    ("completions", {"prompt": "x", "n": 129}, 400, "n", ["n=129", "1 to 128"]),
    ("completions", {"prompt": ["x"] * 20, "n": 13}, 400, "n", ["20 prompts x n=13", "256"]),
    ("completions", {"prompt": "x", "echo": "yes"}, 400, "echo", ["'yes'"]),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", ["21", "0 to 20"]),
    ("completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", ["True", "chat"]),
    ("completions", {"prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty", ["=3"]),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", ["> 0"]),
    ("completions", {"prompt": "x", "min_p": 2}, 400, "min_p", ["min_p=2"]),
    ("completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens", ["3"]),
    ("completions", {"prompt": "x", "logit_bias": {"259": 1}}, 400, "logit_bias['259']",
     ["'259'", "[0, 259)"]),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias['5']",
     ["101", "-100 to 100"]),
    ("completions", {"prompt": "x", "skip_special_tokens": False}, 400, "skip_special_tokens",
     ["False"]),
    ("completions", {"prompt": "x", "best_of": 3}, 400, "best_of", ["use n"]),
    ("completions", {"prompt": ""}, 400, "prompt", ["non-empty"]),
    ("completions", {"prompt": ["a", ""]}, 400, "prompt[1]", ["non-empty"]),
    ("completions", {"prompt": [[5], [1, 999]]}, 400, "prompt[1][1]", ["999", "[0, 259)"]),
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
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens", ["echo"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs", ["logprobs: true"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
     400, "logprobs", ["true or false"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", ["not supported"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_object"}},
     400, "response_format", ["structured output"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"tokenize": True}},
     400, "chat_template_kwargs.tokenize", ["set by the server"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"chat_template": "{{ 'hi' }}"}},
     400, "chat_template_kwargs.chat_template", ["not a template variable"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"continue_final_message": True}},
     400, "chat_template_kwargs.continue_final_message", ["not a template variable"]),
    ("completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "logit_bias", ["301 entries", "at most 300"]),
    ("completions", {"prompt": "x", "max_tokens": -1, "frobnicate": 1}, 400, "max_tokens",
     [">= 0"]),
    ("completions", {"prompt": "x", "no_stop_trim": True}, 400, "no_stop_trim",
     ["false or null"]),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": True},
     400, "continue_final_message", ["not implemented"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "endpoint, body, status, param, words",
    BAD_REQUESTS,
    ids=[str(i) for i in range(len(BAD_REQUESTS))],
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


# what vllm-router and sglang-router add to every request they forward
ROUTER_FIELDS = {
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
}


def test_unknown_fields_are_ignored_named_in_a_header_and_logged_once(served, caplog):
    """As vLLM does: a field kvstrata does not know changes nothing, the response names
    it (X-Kvstrata-Ignored-Fields) and the log says so once per name; the fields routers
    add at their defaults are known (no header)."""
    url = f"{served.url}/v1/completions"
    plain = {"prompt": "import os", "max_tokens": 6, "temperature": 0}
    want = httpx.post(url, json=plain, timeout=60)
    assert want.status_code == 200 and "x-kvstrata-ignored-fields" not in want.headers
    text = want.json()["choices"][0]["text"]
    routed = httpx.post(url, json={**plain, **ROUTER_FIELDS}, timeout=60)
    assert routed.status_code == 200, routed.text
    assert "x-kvstrata-ignored-fields" not in routed.headers
    assert routed.json()["choices"][0]["text"] == text
    odd = {**plain, "frobnicate": 1, "zz_extra": {"a": [1]}, "echo_back": None}
    with caplog.at_level("WARNING", logger="kvstrata.server.routes"):
        for _ in range(2):
            got = httpx.post(url, json=odd, timeout=60)
            assert got.status_code == 200, got.text
            assert got.headers["x-kvstrata-ignored-fields"] == "echo_back, frobnicate, zz_extra"
            assert got.json()["choices"][0]["text"] == text
        typo = httpx.post(url, json={"prompt": "x", "max_tokens": 1, "temprature": 0}, timeout=60)
        assert typo.headers["x-kvstrata-ignored-fields"] == "temprature"
    logged = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(logged) == 1 and "--strict-fields" in logged[0]
    assert any("did you mean 'temperature'" in r.getMessage() for r in caplog.records)
    chat = {
        "messages": [{"role": "user", "content": "x", "weight": 2}],
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
    }
    got = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60)
    assert got.status_code == 200, got.text
    assert got.headers["x-kvstrata-ignored-fields"] == "echo, messages[0].weight"
    stream = httpx.post(url, json={**odd, "stream": True}, timeout=60)
    assert stream.status_code == 200
    assert stream.headers["x-kvstrata-ignored-fields"] == "echo_back, frobnicate, zz_extra"
    wait_idle(served.engine)


def test_strict_fields_refuses_an_unknown_field_naming_the_closest_known(one_thread):
    engine = make_engine()
    server, thread, url = serve_in_thread(build_app(engine, limits=ServeLimits(strict_fields=True)))
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "echo": True}
        error = error_of(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60), 400)
        assert error["param"] == "echo" and "unknown field" in error["message"]
        body = {"prompt": "x", "max_token": 3}
        error = error_of(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 400)
        assert error["param"] == "max_token" and "did you mean 'max_tokens'" in error["message"]
        body = {"prompt": "x", "stream": True, "stream_options": {"include_usagee": True}}
        error = error_of(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 400)
        assert error["param"] == "stream_options.include_usagee"
        assert "did you mean 'include_usage'" in error["message"]
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "x", **ROUTER_FIELDS}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        stop(server, thread)
        engine.shutdown()


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


def test_an_api_key_guards_the_v1_routes(served):
    """--api-key: /v1 requests need `Authorization: Bearer <key>` (OpenAI's 401 object
    otherwise); /health and /metrics stay open."""
    for bad in (" ", "key ", "café", ""):  # no HTTP client could send these
        with pytest.raises(ConfigError, match="api_key"):
            build_app(served.engine, api_key=bad)
    server, thread, url = serve_in_thread(build_app(served.engine, api_key="s3cret"))
    try:
        body = {"prompt": "def f", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = error_of(httpx.post(f"{url}/v1/completions", json=body, headers=headers), 401)
            assert refused["type"] == "authentication_error" and "s3cret" not in refused["message"]
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        out = client.completions.create(model=MODEL, prompt="def f", max_tokens=2)
        assert out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        lower = httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret"})
        assert lower.status_code == 200  # the scheme is case-insensitive
    finally:
        stop(server, thread)
    # mounted under a prefix (or behind a proxy's root_path): it still fails closed
    from starlette.applications import Starlette
    from starlette.routing import Mount

    mounted = Starlette(routes=[Mount("/api", build_app(served.engine, api_key="s3cret"))])
    server, thread, url = serve_in_thread(mounted)
    try:
        assert httpx.get(f"{url}/api/v1/models").status_code == 401
        assert httpx.post(f"{url}/api/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/api/health").status_code == 200
        key = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/api/v1/models", headers=key).status_code == 200
    finally:
        stop(server, thread)


def test_streamed_token_texts_never_cross_a_stop_string(served):
    """The engine holds text back while it may still become a stop string; the tokens'
    logprob entries wait with it, so a stream's tokens join to its text exactly."""
    for stop_string in ("the s", "ally", "y to"):
        body = {
            "model": MODEL, "prompt": "import os\nimport sys\nimport re\n", "max_tokens": 40,
            "temperature": 0, "logprobs": 2, "stop": [stop_string], "stream": True,
        }  # fmt: skip
        text, tokens, offsets = "", [], []
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    if choice.get("logprobs"):
                        tokens += choice["logprobs"]["tokens"]
                        offsets += choice["logprobs"]["text_offset"]
        assert "".join(tokens) == text, stop_string
        assert all(text[o : o + len(t)] == t for t, o in zip(tokens, offsets, strict=True))


def test_documents_are_reused_wherever_they_sit_and_refused_in_one_line(served):
    """`documents` (kvstrata's field): each found in the prompt and blended; a second
    request with the documents swapped finds them both; what cannot blend is a 400."""
    # small enough that both documents' blocks stay cached in this server's small tiers
    docs = [prompt_of(160, 0), prompt_of(130, 1000)]
    url = f"{served.url}/v1/completions"
    found = served.metric("kvstrata_blend_documents_total", outcome="found")
    for order in (docs, docs[::-1]):
        text = "# notes\n" + order[0] + "\n\n" + order[1] + "\n# so the answer is"
        body = {"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0}
        body |= {"documents": order, "blend_recompute": 0.3}
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    assert served.metric("kvstrata_blend_documents_total", outcome="found") - found >= 2
    assert served.metric("kvstrata_blend_tokens_total", kind="reused") > 0
    body = {"model": MODEL, "prompt": "# notes\nnothing here", "max_tokens": 1}
    error = error_of(httpx.post(url, json=body | {"documents": ["absent text"]}, timeout=60), 400)
    assert error["param"] == "documents[0]" and "verbatim" in error["message"]
    error = error_of(httpx.post(url, json=body | {"blend_recompute": 0.5}, timeout=60), 400)
    assert error["param"] == "blend_recompute"
    error = error_of(httpx.post(url, json=body | {"documents": []}, timeout=60), 400)
    assert error["param"] == "documents"
    wait_idle(served.engine)


def test_a_document_separator_marks_the_documents(served):
    """`document_separator`: the text between markers is a document (the markers go),
    in a completion's prompt and in chat contents; the documents are found again in
    another order; one-line 400s for what it cannot mark."""
    docs = [prompt_of(150, 2000), prompt_of(140, 3000)]  # both stay cached (small tiers)
    found = served.metric("kvstrata_blend_documents_total", outcome="found")
    url = f"{served.url}/v1/completions"
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "document_separator": "<doc>"}
    for a, b in (docs, docs[::-1]):
        prompt = f"# notes\n<doc>{a}<doc>\n<doc>{b}<doc>\n# so"
        response = httpx.post(url, json=body | {"prompt": prompt}, timeout=120)
        assert response.status_code == 200, response.text
    assert served.metric("kvstrata_blend_documents_total", outcome="found") - found >= 2
    chat = {k: v for k, v in body.items()}
    chat["messages"] = [{"role": "user", "content": f"read <doc>{docs[0]}<doc> and answer"}]
    response = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=120)
    assert response.status_code == 200, response.text
    bad = body | {"prompt": "no markers here"}
    error = error_of(httpx.post(url, json=bad, timeout=60), 400)
    assert error["param"] == "document_separator"
    both = body | {"prompt": "x<doc>y<doc>z", "documents": ["y"]}
    error = error_of(httpx.post(url, json=both, timeout=60), 400)
    assert error["param"] == "document_separator"
    wait_idle(served.engine)
