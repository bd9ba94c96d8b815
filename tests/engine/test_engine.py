"""The serving engine: ragged continuous batching over one store, exact against
transformers' DynamicCache, preemption by demotion, cancellation, sampling."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import DynamicCache

from hf_models import reference_attn, tiny_model
from kvstrata.core.errors import ConfigError
from kvstrata.engine import Engine, EngineConfig, RequestRejected, SamplingParams

BS = 16


def reference(family: str, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens of transformers' own generate with a DynamicCache (fp32)."""
    model = tiny_model(family, attn=reference_attn(family))
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=max_new, do_sample=False, cache=DynamicCache(config=model.config)
    )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 64, 9, 81, 33, 120][:n]
    return [torch.randint(3, 97, (m,), generator=g).tolist() for m in lengths]


def wait_until(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "qwen2", "gpt_oss"])
def test_concurrent_requests_equal_solo_and_dynamic_cache(family):
    ps = prompts(8)
    lengths = [12, 20, 7, 25, 30, 5, 18, 10]
    params = [SamplingParams(max_tokens=m) for m in lengths]
    with Engine(
        tiny_model(family, attn=reference_attn(family)),
        block_size=BS,
        host_budget="8MiB",
        device_budget="64KiB",
        config=EngineConfig(max_batched_tokens=48, preemption="off"),
    ) as engine:
        together = engine.generate(ps, params)
        batched = engine.store.runtime.batched_decodes
        solo = [engine.generate([p], [sp])[0] for p, sp in zip(ps, params, strict=True)]
        stats = engine.stats()
    # the decodes of a step were attended together in one native call (where it runs)
    assert batched > 0 or not engine.store.runtime.native
    for i, (a, b) in enumerate(zip(together, solo, strict=True)):
        assert a.token_ids == b.token_ids, f"request {i}: batched != solo"
        assert a.finish_reason in ("length", "stop")
        assert a.prompt_tokens == len(ps[i])
    for i in (0, 5, 7):  # against transformers itself (each call builds a model)
        assert together[i].token_ids == reference(family, ps[i], lengths[i])[: lengths[i]]
    # nothing leaked: every block is free or an evictable prefix-cache block
    assert stats["live_blocks"] == 0 and stats["sequences"] == 0 and stats["running"] == 0
    moved = stats["store"]["bytes_moved"]
    assert sum(moved.values()) > 0, "the small device budget should have spilled blocks"


BLOCK_BYTES = 2 * 2 * 16 * 2 * 4 * BS  # layers * kv heads * head dim * (K,V) * fp32 * tokens
PER_SEQ = 80 // BS  # blocks of one finished 40 + 40-token request


def six_requests_over_a_two_request_device(**fields) -> tuple[list[list[int]], Engine]:
    """Six 40-token prompts (40 new tokens each) and an engine whose device holds the
    KV of two of them; `fields` add the lower tiers."""
    ps = [p[:40] + [5] * max(0, 40 - len(p)) for p in prompts(6, seed=1)]
    engine = Engine(
        tiny_model("llama"),
        block_size=BS,
        device_budget=2 * PER_SEQ * BLOCK_BYTES,
        prefix_caching=False,
        config=EngineConfig(max_num_seqs=6, max_batched_tokens=64),
        **fields,
    )
    return ps, engine


def test_preemption_demotes_and_resumes_without_recompute():
    """Host blocks staged (as across PCIe): a running request's KV must fit the device,
    so the newer requests are preempted (demoted) and resume."""
    params = SamplingParams(max_tokens=40)
    ps, engine = six_requests_over_a_two_request_device(host_budget="8MiB", cold_attention="stage")
    with engine:
        outs = engine.generate(ps, params)
        stats = engine.stats()
        m = engine.metrics
        preemptions = m.value("kvstrata_preemptions_total")
        demoted = m.value("kvstrata_demoted_blocks_total")
        resumed = m.value("kvstrata_resumed_total")
        prefill = m.value("kvstrata_prefill_tokens_total")
        decode = m.value("kvstrata_decode_tokens_total")
        solo = [engine.generate([p], params)[0] for p in ps]
    assert [o.token_ids for o in outs] == [s.token_ids for s in solo]
    assert outs[0].token_ids == reference("llama", ps[0], 40)
    assert preemptions >= 1 and resumed >= 1
    assert demoted >= 1
    assert stats["store"]["bytes_moved"].get("device->host", 0) >= demoted * BLOCK_BYTES
    # demotion, not recomputation: every prompt token was fed once, every generated
    # token (but each request's last) once
    assert prefill == sum(len(p) for p in ps)
    assert decode == sum(len(o.token_ids) - 1 for o in outs)
    assert stats["live_blocks"] == 0 and stats["sequences"] == 0


def test_host_blocks_read_in_place_let_more_requests_run_than_the_device_holds():
    """The host tier read where it lies (the CPU computes): a running request's older
    blocks live there instead of its being preempted, so as many run as the device
    holds floors for (10 blocks, 3 each: three), not only the two whose whole KV it
    holds; the tokens equal each request's alone."""
    params = SamplingParams(max_tokens=40)
    ps, engine = six_requests_over_a_two_request_device(host_budget="8MiB")
    with engine:
        outs = engine.generate(ps, params)
        stats = engine.stats()
        preemptions = engine.metrics.value("kvstrata_preemptions_total")
        solo = [engine.generate([p], params)[0] for p in ps]
    assert [o.token_ids for o in outs] == [s.token_ids for s in solo]
    assert outs[0].token_ids == reference("llama", ps[0], 40)
    assert preemptions == 0 and stats["peak_running"] == 3
    assert stats["store"]["bytes_moved"].get("device->host", 0) > 0  # they did spill
    assert stats["live_blocks"] == 0 and stats["sequences"] == 0


def test_spilling_into_a_small_host_tier_preempts_the_rest_to_disk(tmp_path):
    """The in-place host tier holds a little more than the device: the requests that
    fit run with their older blocks there, the newest that outgrow it are preempted
    (their blocks demoted past the full host tier to disk) and resume from there;
    every output equals its solo run."""
    params = SamplingParams(max_tokens=40)
    ps, engine = six_requests_over_a_two_request_device(
        host_budget=3 * BLOCK_BYTES, disk_dir=str(tmp_path), disk_budget="1MiB"
    )
    with engine:
        outs = engine.generate(ps, params, timeout=300)
        stats = engine.stats()
        preemptions = engine.metrics.value("kvstrata_preemptions_total")
        solo = [engine.generate([p], params, timeout=120)[0] for p in ps]
    assert [o.token_ids for o in outs] == [s.token_ids for s in solo]
    assert all(o.error is None and o.finish_reason in ("length", "stop") for o in outs)
    assert preemptions >= 1 and stats["peak_running"] >= 2
    assert (
        stats["store"]["bytes_moved"].get("host->disk", 0)
        + stats["store"]["bytes_moved"].get("device->disk", 0)
        > 0
    )
    assert stats["live_blocks"] == 0 and stats["sequences"] == 0


@pytest.mark.parametrize("preemption", ["off", "demote"])
@pytest.mark.parametrize("device_blocks", [8, 12, 20])
def test_tight_device_budgets_finish_every_request(preemption, device_blocks):
    """However tight the device (down to one open block per sequence), every request
    finishes with its solo output: no livelock when a step cannot be placed."""
    ps = prompts(8, seed=5)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    block = BLOCK_BYTES
    with Engine(
        tiny_model("llama"),
        block_size=BS,
        device_budget=device_blocks * block,
        host_budget="8MiB",
        config=EngineConfig(max_num_seqs=8, max_batched_tokens=40, preemption=preemption),
    ) as engine:
        together = engine.generate(ps, sp, timeout=300)
        solo = [engine.generate([p], sp, timeout=120)[0] for p in ps[:3]]
        assert engine.stats()["live_blocks"] == 0
    assert [o.token_ids for o in together[:3]] == [o.token_ids for o in solo]
    assert [(o.finish_reason, o.error) for o in together] == [("length", None)] * 8


def test_cancel_frees_blocks_at_once():
    model = tiny_model("llama")
    first = threading.Event()
    finals = []

    def on_output(out):
        first.set()
        if out.finished:
            finals.append(out)

    with Engine(model, block_size=BS, config=EngineConfig(preemption="off")) as engine:
        rid = engine.submit(
            prompts(1)[0], SamplingParams(max_tokens=3000, ignore_eos=True), on_output=on_output
        )
        assert first.wait(30)
        assert wait_until(lambda: engine.stats()["live_blocks"] > 0)
        engine.abort(rid)
        assert wait_until(lambda: bool(finals))
        assert finals[0].finish_reason == "abort" and finals[0].error is None
        assert finals[0].completion_tokens < 3000
        assert wait_until(lambda: engine.stats()["sequences"] == 0)
        assert engine.stats()["live_blocks"] == 0


def test_stream_left_early_aborts_the_request():
    model = tiny_model("llama")
    with Engine(model, block_size=BS) as engine:

        async def consume() -> int:
            got = 0
            async for out in engine.stream(prompts(1)[0], SamplingParams(max_tokens=3000)):
                got += len(out.token_ids)
                if got >= 3:
                    break
            return got

        assert asyncio.run(consume()) >= 3
        assert wait_until(lambda: engine.stats()["sequences"] == 0)
        assert engine.stats()["live_blocks"] == 0
        assert engine.metrics.value("kvstrata_requests_finished_total", reason="abort") == 1


def test_stream_deltas_add_up_to_the_whole_output():
    from kvstrata.workload.zoo import load_model

    model, tok = load_model("default")
    with Engine(model, tok, block_size=BS) as engine:
        prompt = 'def add(a, b):\n    """Add two numbers and return the sum."""\n'
        whole = engine.generate([prompt], SamplingParams(max_tokens=30))[0]

        async def consume():
            return [o async for o in engine.stream(prompt, SamplingParams(max_tokens=30))]

        parts = asyncio.run(consume())
    assert "".join(p.text for p in parts) == whole.text
    assert [t for p in parts for t in p.token_ids] == whole.token_ids
    assert parts[-1].finished and not any(p.finished for p in parts[:-1])
    assert parts[-1].cached_tokens > 0  # the same prompt again: its full blocks are reused


def test_stop_strings_cut_the_text():
    from kvstrata.workload.zoo import load_model

    model, tok = load_model("default")
    with Engine(model, tok, block_size=BS) as engine:
        free = engine.generate(["class Stack:"], SamplingParams(max_tokens=60))[0]
        at = next(i for i in range(10, len(free.text) - 3) if not free.text[i : i + 3].isspace())
        stop = free.text[at : at + 3]
        cut = engine.generate(["class Stack:"], SamplingParams(max_tokens=60, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]


def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny_model("llama")
    ps = prompts(4, seed=3)
    sp = SamplingParams(max_tokens=15, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    with Engine(model, block_size=BS) as engine:
        alone = engine.generate([ps[0]], sp)[0]
        batched = engine.generate(ps, [sp] + [SamplingParams(max_tokens=9)] * 3)[0]
        other_seed = engine.generate(
            [ps[0]], SamplingParams(max_tokens=15, temperature=0.8, seed=8)
        )
    assert alone.token_ids == batched.token_ids
    assert other_seed[0].token_ids != alone.token_ids


def test_prefix_cache_survives_a_restart(tmp_path):
    ps = prompts(8)[7:]  # 120 tokens
    sp = SamplingParams(max_tokens=10)
    kwargs = dict(block_size=BS, host_budget="1MiB", disk_dir=str(tmp_path), disk_budget="8MiB")
    with Engine(tiny_model("llama"), **kwargs) as engine:
        first = engine.generate(ps, sp)[0]
    with Engine(tiny_model("llama"), **kwargs) as engine:
        again = engine.generate(ps, sp)[0]
        hits = engine.stats()["store"]["prefix"]["hit_tokens_by_tier"]
    assert first.cached_tokens == 0
    assert again.cached_tokens == 112 and hits.get("disk", 0) > 0
    assert again.token_ids == first.token_ids


def test_lossy_host_codec_runs_and_reports():
    model = tiny_model("llama")
    with Engine(
        model,
        block_size=BS,
        device_budget="64KiB",
        host_budget="8MiB",
        host_codec="int8",
        residual_tokens=16,
        sink_tokens=0,
        config=EngineConfig(max_num_seqs=4, preemption="off"),
    ) as engine:
        outs = engine.generate(prompts(4), SamplingParams(max_tokens=20))
        host = engine.stats()["store"]["tiers"]["host"]
    exact = [reference("llama", p, 20) for p in prompts(4)[:2]]
    assert host["peak_used_blocks"] > 0  # blocks really went through the int8 tier
    # the first token comes from the prefill's own (exact) K/V, whatever the codec
    assert [o.token_ids[0] for o in outs[:2]] == [e[0] for e in exact]
    agree = [
        sum(a == b for a, b in zip(o.token_ids, e, strict=False)) / len(e)
        for o, e in zip(outs, exact, strict=False)
    ]
    assert all(len(o.token_ids) >= 1 for o in outs)
    assert all(0.0 <= a <= 1.0 for a in agree)


def test_bad_requests_are_refused_at_once():
    model = tiny_model("llama", max_position_embeddings=256)
    with Engine(model, block_size=BS, host_budget="1MiB") as engine:
        with pytest.raises(RequestRejected, match="maximum context length is 256"):
            engine.submit([5] * 200, SamplingParams(max_tokens=100))
        with pytest.raises(RequestRejected, match="prompt is empty"):
            engine.submit([], SamplingParams())
        with pytest.raises(RequestRejected, match="vocabulary"):
            engine.submit([5, 1000], SamplingParams())
        with pytest.raises(ConfigError, match="no tokenizer"):
            engine.submit("text", SamplingParams())
        with pytest.raises(RequestRejected, match="logit_bias token id 97 is outside"):
            engine.submit([5, 6], SamplingParams(logit_bias={97: 1.0}))
        # the engine still serves
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].completion_tokens
    with (
        Engine(tiny_model("llama"), block_size=BS, device_budget="64KiB", max_tokens=128) as engine,
        pytest.raises(RequestRejected, match="needs 20 blocks .* all tiers together hold 8 "),
    ):
        engine.submit([5] * 300, SamplingParams(max_tokens=10))
    for field, kwargs in [
        ("max_tokens", {"max_tokens": -1}),
        ("temperature", {"temperature": -1}),
        ("top_p", {"top_p": 0}),
        ("top_k", {"top_k": -2}),
        ("stop", {"stop": [""]}),
        ("seed", {"seed": -1}),
        ("logprobs", {"logprobs": 21}),
        ("frequency_penalty", {"frequency_penalty": 2.5}),
        ("presence_penalty", {"presence_penalty": -3}),
        ("repetition_penalty", {"repetition_penalty": 0}),
        ("min_p", {"min_p": 1.5}),
        ("min_tokens", {"max_tokens": 4, "min_tokens": 5}),
        ("logit_bias", {"logit_bias": {5: 200}}),
        ("logit_bias", {"logit_bias": {-1: 1}}),
        ("logit_bias=<301 entries>", {"logit_bias": {t: 1.0 for t in range(301)}}),
    ]:
        with pytest.raises(ConfigError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ConfigError, match="preemption"):
        EngineConfig(preemption="swap")


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on():
    model = tiny_model("llama")
    mlp = model.model.layers[1].mlp
    calls = {"n": 0}
    original = mlp.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    mlp.forward = flaky
    with Engine(model, block_size=BS) as engine:
        failed = engine.generate([prompts(1)[0]], SamplingParams(max_tokens=10))[0]
        assert failed.finish_reason == "abort" and "injected fault" in failed.error
        assert engine.stats()["live_blocks"] == 0
        ok = engine.generate([prompts(1)[0]], SamplingParams(max_tokens=10))[0]
    mlp.forward = original
    assert ok.token_ids == reference("llama", prompts(1)[0], 10)


def test_text_output_keeps_the_leading_space_and_settles_utf8():
    """Metaspace tokenizers drop the space of a decode's first token: the output is
    decoded after the prompt's last tokens, as a whole decode of prompt + output."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvstrata.engine.sampling import TextOutput

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5, "▁é": 6}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    prompt, out = [1, 2, 3], [4, 5, 6, 4]
    assert tok.decode(out) == "Paris. é Paris"  # alone: the space is lost
    text = TextOutput(tok, (), prompt)  # (the prompt's last 5 tokens are the context)
    pieces = [text.push([t])[0] for t in out] + [text.flush()]
    whole = tok.decode(prompt + out)
    assert "".join(pieces) == whole[len(tok.decode(prompt)) :] == " Paris. é Paris"
    stopped = TextOutput(tok, (". é",), prompt)
    got = [stopped.push([t]) for t in out]
    assert [stop for _, stop in got] == [False, False, True, False]
    assert "".join(t for t, _ in got[:3]) == " Paris"  # held back, then cut at the stop


def test_an_unreadable_block_is_recomputed_never_served(monkeypatch):
    """A block read that fails its check mid-generation (BlockCorruptError from the
    attention) undoes the step; the requests compute their KV again and give the
    tokens of an undisturbed run. A read that keeps failing ends the request."""
    from kvstrata.attention.runtime import AttentionRuntime
    from kvstrata.core.errors import BlockCorruptError

    ps, sp = prompts(3, seed=9), SamplingParams(max_tokens=12)
    calls = {"n": 0, "fail_at": None}

    def failing(real):  # one attention (alone or batched decodes) reads a bad block
        def attend(self, *args, **kwargs):
            calls["n"] += 1
            if calls["fail_at"] is not None and calls["n"] >= calls["fail_at"]:
                if calls["fail_at"] > 0:
                    calls["fail_at"] = None  # once
                raise BlockCorruptError("injected: checksum mismatch")
            return real(self, *args, **kwargs)

        return attend

    for name in ("attend", "decode_batch"):
        monkeypatch.setattr(AttentionRuntime, name, failing(getattr(AttentionRuntime, name)))
    kwargs = dict(block_size=BS, device_budget="64KiB", host_budget="8MiB")
    with Engine(tiny_model("llama"), **kwargs) as engine:
        want = engine.generate(ps, sp)
        calls["fail_at"] = calls["n"] + 40  # mid-generation: some tokens are out already
        got = engine.generate(ps, sp)
        assert engine.metrics.value("kvstrata_recomputes_total") >= 1
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        calls["fail_at"] = -1  # every read fails from now on
        broken = engine.generate([ps[0]], sp)[0]
        assert broken.finish_reason == "abort" and "could not be read" in broken.error
        calls["fail_at"] = None
        assert engine.generate([ps[0]], sp)[0].token_ids == want[0].token_ids
        assert engine.stats()["live_blocks"] == 0


def test_running_out_of_blocks_preempts_one_request_and_loses_none(monkeypatch):
    """A step that runs out of blocks before the store placed it (nothing to undo)
    preempts the newest request; every request still finishes with the tokens of an
    undisturbed run — none is ended for it."""
    from kvstrata.core.errors import OutOfBlocksError
    from kvstrata.store.kvstore import KVStore

    ps, sp = prompts(4, seed=5), SamplingParams(max_tokens=10)
    real = KVStore.extend
    calls = {"n": 0, "fail_at": None}

    def extend(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise OutOfBlocksError("injected: no free block in any tier")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVStore, "extend", extend)
    kwargs = dict(block_size=BS, device_budget="64KiB", host_budget="8MiB")
    with Engine(tiny_model("llama"), **kwargs) as engine:
        want = engine.generate(ps, sp)
        calls["fail_at"] = calls["n"] + 6  # mid-generation, all four running
        got = engine.generate(ps, sp)
        assert engine.metrics.value("kvstrata_preemptions_total") >= 1
        assert engine.stats()["live_blocks"] == 0
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# -- logprobs, prompt scoring, penalties ---------------------------------------------------


def close(expected):
    """fp32 logprobs through the engine's paged attention vs one plain forward."""
    return pytest.approx(expected, rel=1e-5, abs=1e-5)


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's fp32 logits at every position of `ids` (one forward,
    no cache): row p is the distribution of token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_and_prompt_logprobs_equal_the_models_log_softmax():
    """Sampled-token and prompt logprobs are log_softmax of the model's own logits —
    also for a prompt prefilled in several chunks whose blocks the prefix cache holds
    (a prompt-logprob request computes its whole prompt) — and asking for them changes
    no token. max_tokens 0 scores the prompt and generates nothing."""
    prompt = prompts(4, seed=11)[3]  # 64 tokens: 4 blocks, prefilled in chunks of 24
    reference_model = tiny_model("llama")
    with Engine(
        tiny_model("llama"), block_size=BS, config=EngineConfig(max_batched_tokens=24)
    ) as engine:
        plain = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        scored = engine.generate([prompt], sp)[0]
        only = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        sampled = engine.generate(
            [prompt],
            SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=0, ignore_eos=True),
        )[0]
        again = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    assert again.cached_tokens == 48  # the plain path still uses the prefix cache
    assert scored.token_ids == plain.token_ids  # logprobs change nothing
    assert scored.cached_tokens == 0 and only.cached_tokens == 0
    lp = direct_logprobs(reference_model, prompt + scored.token_ids)
    n = len(prompt)
    # prompt tokens: the first has no prefix, token i is scored by the logits at i - 1
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == n
    for i in range(1, n):
        entry = scored.prompt_logprobs[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == close(lp[i - 1, prompt[i]].item())
        best = torch.topk(lp[i - 1], 2)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == close(best.values.tolist())
    # generated tokens: the logits at the position before each
    assert len(scored.logprobs) == len(scored.token_ids) == 6
    for j, entry in enumerate(scored.logprobs):
        row = lp[n - 1 + j]
        assert entry.token_id == scored.token_ids[j]
        assert entry.logprob == close(row[entry.token_id].item())
        assert entry.token_id == entry.top[0][0]  # greedy: the most likely token
        assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()
    # the prompt alone
    assert only.token_ids == [] and only.finish_reason == "length"
    assert only.completion_tokens == 0 and only.logprobs is None
    assert [e and e.logprob for e in only.prompt_logprobs] == pytest.approx(
        [e and e.logprob for e in scored.prompt_logprobs]
    )
    assert all(e.top == () for e in only.prompt_logprobs[1:])
    # sampled tokens: raw logprobs (before temperature) of the tokens drawn
    lp = direct_logprobs(reference_model, prompt + sampled.token_ids)
    for j, entry in enumerate(sampled.logprobs):
        assert entry.logprob == close(lp[n - 1 + j, entry.token_id].item())
        assert entry.top == ()


def penalized_reference(model, prompt: list[int], steps: int, sp: SamplingParams) -> list[int]:
    """Greedy decoding with OpenAI's / vLLM's penalties, by hand: a full forward per
    token, then logit_bias, repetition (prompt + output), frequency and presence
    (output) penalties on the last position's logits, argmax."""
    out: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().tolist()
        for token, bias in sp.logit_bias:
            logits[token] += bias
        seen = set(prompt) | set(out)
        for t in range(len(logits)):
            if t in seen:
                rp = sp.repetition_penalty
                logits[t] = logits[t] / rp if logits[t] > 0 else logits[t] * rp
            count = out.count(t)
            logits[t] -= sp.frequency_penalty * count + sp.presence_penalty * (count > 0)
        out.append(max(range(len(logits)), key=lambda t: (logits[t], -t)))
    return out


def test_penalties_logit_bias_min_tokens_and_min_p():
    prompt = [5, 6, 7, 8] * 6  # repetitive: greedy decoding repeats itself
    reference_model = tiny_model("llama")
    penalties = SamplingParams(
        max_tokens=12,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={9: 2.0},
    )
    with Engine(tiny_model("llama"), block_size=BS) as engine:
        plain = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        penalized = engine.generate([prompt], penalties)[0]
        freq_only = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0)
        frequency = engine.generate([prompt], freq_only)[0]
        biased = engine.generate(
            [prompt], SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={50: 100})
        )[0]
        # a stop token that greedy decoding reaches at its 2nd token: min_tokens blocks it
        stop = plain.token_ids[1]
        stopped = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop]))
        held = engine.generate(
            [prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop], min_tokens=5)
        )[0]
        # min_p 1: only the most likely token survives, so sampling is greedy
        top_only = engine.generate(
            [prompt],
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.5, min_p=1.0, seed=1),
        )[0]
        # penalties with seeded sampling: reproducible (alone or in a batch), and not
        # the unpenalised draw of the same seed
        sampled = dict(max_tokens=12, ignore_eos=True, temperature=1.0, seed=11)
        seeded = SamplingParams(**sampled, frequency_penalty=2.0, presence_penalty=1.0)
        pen_alone = engine.generate([prompt], seeded)[0]
        pen_batch = engine.generate([prompts(1)[0], prompt], [SamplingParams(), seeded])[1]
        unpenalised = engine.generate([prompt], SamplingParams(**sampled))[0]
    assert len(set(plain.token_ids)) < len(plain.token_ids)  # it repeats
    assert plain.token_ids == penalized_reference(reference_model, prompt, 12, SamplingParams())
    assert penalized.token_ids == penalized_reference(reference_model, prompt, 12, penalties)
    assert penalized.token_ids != plain.token_ids
    assert frequency.token_ids == penalized_reference(reference_model, prompt, 12, freq_only)
    assert frequency.token_ids != plain.token_ids
    assert biased.token_ids == [50] * 4
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) <= 2
    assert stop not in held.token_ids[:5] and len(held.token_ids) >= 5
    assert top_only.token_ids == plain.token_ids
    assert pen_alone.token_ids == pen_batch.token_ids != unpenalised.token_ids


def test_min_p_applies_after_temperature():
    """min_p compares probabilities after temperature (vLLM's order): a high
    temperature flattens the distribution and keeps more tokens, a low one fewer."""
    from kvstrata.engine.sampling import filtered_logits

    logits = torch.tensor([2.0, 1.0, 0.0, -3.0])

    def kept(temperature: float) -> int:
        row = filtered_logits(logits, SamplingParams(temperature=temperature, min_p=0.3))
        return int(torch.isfinite(row).sum())

    # probability / the best's = exp((logit - 2) / T), kept when >= 0.3; before the
    # temperature it would be exp(logit - 2) for every T: two tokens each time
    assert [kept(0.5), kept(1.0), kept(2.0)] == [1, 2, 3]


def test_logit_bias_is_one_tensor_op(monkeypatch):
    """300 logit_bias entries (OpenAI's limit) are added at once, not entry by entry."""
    from kvstrata.engine.sampling import LogitsAdjuster

    bias = {t: float(t % 7 - 3) for t in range(0, 600, 2)}
    adjuster = LogitsAdjuster(SamplingParams(logit_bias=bias, ignore_eos=True), [1, 2], [])
    logits = torch.randn(1000)
    want = logits.clone()
    for t, b in bias.items():
        want[t] += b
    writes = {"n": 0}
    real = torch.Tensor.__setitem__

    def counting(self, key, value):
        writes["n"] += 1
        return real(self, key, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", counting)
    for _ in range(3):  # every step
        assert torch.equal(adjuster.apply(logits, [5]), want)
    assert writes["n"] == 0


def test_prompt_logprobs_are_computed_a_bounded_number_of_rows_at_a_time(monkeypatch):
    from kvstrata.engine import sampling

    logits = torch.randn(600, 50)
    ids = torch.randint(0, 50, (600,)).tolist()
    want = torch.log_softmax(logits, dim=-1)
    rows = []
    real = torch.log_softmax

    def spy(x, *args, **kwargs):
        rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    got = sampling.token_logprobs(logits, ids, 2)
    assert max(rows) <= sampling.LOGPROB_ROWS and sum(rows) == 600
    assert [e.logprob for e in got] == pytest.approx(want[range(600), ids].tolist(), abs=1e-6)
    best = torch.topk(want, 2)
    assert [[t for t, _ in e.top] for e in got] == best.indices.tolist()


def test_min_tokens_boundary_first_output_and_a_prompt_alone():
    """Stop strings are looked for from the min_tokens-th token on (vLLM: a stop string
    may end with it); `first_output` sends an output at the first token even when it
    brings no text; max_tokens 0 computes the prompt alone, from the prefix cache."""
    from kvstrata.workload.zoo import load_model

    model, tok = load_model("default")
    prompt = "def area(radius):\n    return"
    with Engine(model, tok, block_size=BS) as engine:
        free = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert len(free.text) == 12  # one byte token per character
        # a character first written by token k (k >= 2): the stop string
        k = next(k for k in range(2, 12) if free.text[k - 1] not in free.text[: k - 1])
        stop = free.text[k - 1]
        runs = [
            engine.generate(
                [prompt], SamplingParams(max_tokens=12, stop=[stop], min_tokens=m, ignore_eos=True)
            )[0]
            for m in (k, k + 1)
        ]

        outs: list = []
        done = threading.Event()

        def on_output(out) -> None:
            outs.append(out)
            if out.finished:
                done.set()

        held = SamplingParams(
            max_tokens=6, stop=["#" * 30], ignore_eos=True
        )  # no text till the end
        engine.submit(prompt, held, on_output=on_output, first_output=True)
        assert done.wait(30)
        alone = engine.generate([prompt], SamplingParams(max_tokens=0))[0]
    at, after = runs
    assert (at.finish_reason, at.text, len(at.token_ids)) == ("stop", free.text[: k - 1], k)
    assert len(after.token_ids) > k and after.text.startswith(free.text[:k])
    assert [(len(o.token_ids), o.text) for o in outs] == [(1, ""), (5, free.text[:6])]
    assert (alone.token_ids, alone.finish_reason, alone.prompt_logprobs) == ([], "length", None)
    assert alone.cached_tokens == 16  # (28 prompt tokens: its full block was cached)


def test_a_request_recomputed_after_scoring_its_prompt_reuses_the_prefix_cache(monkeypatch):
    """Prompt logprobs need every position computed (no prefix-cache lookup), but once
    the prompt is scored a storage-error recompute looks its prefix up like any request;
    the tokens and prompt logprobs are those of an undisturbed run."""
    from kvstrata.attention.runtime import AttentionRuntime
    from kvstrata.core.errors import BlockCorruptError
    from kvstrata.store.kvstore import KVStore

    prompt = prompts(4, seed=2)[3]  # 64 tokens
    sp = SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=1, logprobs=0)
    calls = {"n": 0, "fail_at": None}
    lookups = []

    def failing(real):
        def attend(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise BlockCorruptError("injected: checksum mismatch")
            return real(self, *args, **kwargs)

        return attend

    for name in ("attend", "decode_batch"):
        monkeypatch.setattr(AttentionRuntime, name, failing(getattr(AttentionRuntime, name)))
    real_add = KVStore.add_sequence

    def add_sequence(self, token_ids=None, salt="", lookup=True):
        lookups.append(lookup)
        return real_add(self, token_ids, salt=salt, lookup=lookup)

    monkeypatch.setattr(KVStore, "add_sequence", add_sequence)
    with Engine(tiny_model("llama"), block_size=BS) as engine:
        want = engine.generate([prompt], sp)[0]
        lookups.clear()
        calls["fail_at"] = calls["n"] + 10  # a few tokens in: the prompt is scored
        got = engine.generate([prompt], sp)[0]
        assert engine.metrics.value("kvstrata_recomputes_total") == 1
    assert lookups == [False, True]
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert [e and (e.token_id, e.logprob) for e in got.prompt_logprobs] == [
        e and (e.token_id, pytest.approx(e.logprob)) for e in want.prompt_logprobs
    ]


def test_requests_arriving_together_with_one_prefix_compute_it_once():
    """Users that arrive at once with the same system prompt: the first computes its
    full blocks, the others wait for them and reuse them (not all four computing them in
    the same steps); the tokens equal those of requests run alone."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 97, (70,), generator=g).tolist()  # 4 full blocks + 6
    ps = [system + torch.randint(3, 97, (9,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    config = EngineConfig(max_batched_tokens=32)  # the prompt takes 3 steps to compute
    with Engine(tiny_model("llama"), block_size=BS, config=config) as engine:
        together = engine.generate(ps, params)
    assert together[0].cached_tokens == 0
    assert [o.cached_tokens for o in together[1:]] == [64, 64, 64]
    with Engine(tiny_model("llama"), block_size=BS, prefix_caching=False) as engine:
        alone = [engine.generate([p], params)[0] for p in ps]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
