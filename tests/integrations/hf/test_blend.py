"""Blending (issue #52): a document's K/V reused at any position of a prompt, through the
store, for the engine and for a TieredCache. Exactness where it must be exact (moved
keys on every tier, r = 1, the blended K/V never found as a prefix, a failed blend),
one-line errors where it cannot apply."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_models import tiny_model
from kvstrata.core.blending import check_recompute
from kvstrata.core.errors import ConfigError, TierIOError
from kvstrata.engine import Engine, EngineConfig, RequestRejected, SamplingParams
from kvstrata.integrations.hf import TieredCache, blend_store, enable
from kvstrata.integrations.hf.blend import Blender
from kvstrata.integrations.hf.blend_store import blend_prompt, read_kv
from kvstrata.store.kvstore import KVStore
from kvstrata.workload.chunks import Chunks, find_documents

BS = 16


def ids_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


HEAD, DOC_A, DOC_B, TAIL = ids_of(1, 21), ids_of(2, 70), ids_of(3, 53), ids_of(4, 9)
SEP = [5, 6]


def prompt(docs: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    segs: list = [tuple(HEAD)]
    index = []
    for d in docs:
        index.append(len(segs))
        segs += [tuple(d), tuple(SEP)]
    segs.append(tuple(TAIL))
    return Chunks(tuple(segs), frozenset(index)).encode(None)


def reference(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, cache=DynamicCache()
    )
    return out[0, len(ids) :].tolist()


def layer0_keys(model, ids: list[int]) -> torch.Tensor:
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([ids]), cache=cache, use_cache=True)
    return cache.layers[0].keys[0]  # [Hkv, T, D]


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_moved_document_has_the_keys_full_prefill_computes_there(tier, tmp_path, one_thread):
    model = tiny_model("llama")
    ids, spans = prompt([DOC_B, DOC_A])
    s, e = spans[1]  # DOC_A, second in the prompt
    want = layer0_keys(model, ids)[:, s:e]  # layer 0's keys hold no context: only positions
    enable(model)
    fields = {
        "device": {},
        "host": {"host_budget": "1MiB"},
        "disk": {"disk_dir": str(tmp_path), "disk_budget": "4MiB"},
    }
    device = "1MiB" if tier == "device" else "96KiB"
    store = KVStore(
        model.config, block_size=BS, max_tokens=1024, device_budget=device, **fields[tier]
    )
    try:
        cache = TieredCache.from_store(store, prompt_ids=HEAD + DOC_A)
        with torch.inference_mode():
            model(torch.tensor([HEAD + DOC_A]), cache=cache)
        cache.close()  # its full blocks stay cached
        seq, matched = store.add_sequence(HEAD + DOC_A)
        assert matched >= len(HEAD) + BS
        if tier != "device":
            store.demote(seq)  # its blocks past the device's sink block go down
        runs = [r for r in store.runs(seq, 0) if r.tier == tier]
        lo = max(len(HEAD), min(r.token_start for r in runs))
        hi = min(matched, max(r.token_start + r.num_tokens for r in runs))
        assert hi - lo >= BS
        k, _ = read_kv(store, seq, lo, hi, torch.device("cpu"))
        store.free(seq)
    finally:
        store.close()
    h = len(HEAD)
    want = want[:, lo - h : hi - h]
    moved = Blender(model).move_keys(k[0], s - h)
    torch.testing.assert_close(moved, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(k[0], want, atol=1e-3)  # it did have to move


def test_recomputing_everything_is_a_full_prefill_through_a_tiered_cache(one_thread):
    model = tiny_model("qwen3")
    ids, spans = prompt([DOC_A, DOC_B])
    want = reference(model, ids, 12)
    enable(model)
    store = KVStore(model.config, block_size=BS, max_tokens=1024, device_budget="4MiB")
    try:
        for r in (1.0, 1.0):  # the second finds both documents and still recomputes all
            cache = TieredCache.from_store(store)
            rows = blend_prompt(model, cache, (ids, spans), recompute=r)
            got = model.generate(rows, cache=cache, max_new_tokens=12, do_sample=False)
            assert got[0, len(ids) :].tolist() == want
            assert cache.blend_result.reused == 0 and cache.blend_result.error is None
            cache.close()
        assert cache.blend_result.found == 2
    finally:
        store.close()


def engine_of(model, **config) -> Engine:
    cfg = EngineConfig(max_num_seqs=2, threads=1, **config)
    return Engine(model, None, config=cfg, block_size=BS, max_tokens=1024, device_budget="4MiB")


def test_the_engine_blends_and_never_serves_blended_kv_as_a_prefix(one_thread):
    model = tiny_model("llama")
    first, spans = prompt([DOC_A, DOC_B])
    second, _ = prompt([DOC_B, DOC_A])
    want_first = reference(model, first, 10)
    want_full = reference(model, second, 10)
    engine = engine_of(model, blend_recompute=0.0)
    params = SamplingParams(max_tokens=10)
    try:
        out = engine.generate([Chunks.of_ids(first, spans)], params)[0]
        assert out.error is None and len(out.token_ids) == 10
        chunks = Chunks.of_ids(second, prompt([DOC_B, DOC_A])[1])
        out = engine.generate([chunks], params)[0]
        assert out.error is None
        m = engine.metrics
        assert m.value("kvstrata_blend_documents_total", outcome="found") == 2
        assert m.value("kvstrata_blend_documents_total", outcome="computed") == 2
        assert m.value("kvstrata_blend_tokens_total", kind="reused") > 0
        # the same prompts without documents: exact, whatever the blends left cached
        plain = engine.generate([second, first], params)
        assert [o.token_ids for o in plain] == [want_full, want_first]
    finally:
        engine.shutdown()
    engine = engine_of(model, blend_recompute=1.0)  # every reused token recomputed
    try:
        outs = engine.generate([chunks, chunks], params)  # the second finds both documents
        assert [o.token_ids for o in outs] == [want_full, want_full]
        assert engine.metrics.value("kvstrata_blend_documents_total", outcome="found") == 2
    finally:
        engine.shutdown()


def _unreadable(*args, **kwargs):
    raise TierIOError("a block could not be read (test)")


@pytest.mark.parametrize(
    "family, cause, fields",
    [
        ("llama", "a document's block cannot be read", {}),
        ("mistral", "sliding layers (48 tokens) narrower than the prompt", {}),
        ("llama", "prefix caching is off", {"prefix_caching": False}),
    ],
)
def test_a_blend_that_cannot_run_prefills_the_prompt_exactly(
    family, cause, fields, one_thread, monkeypatch
):
    model = tiny_model(family)
    ids, spans = prompt([DOC_A, DOC_B])
    want = reference(model, ids, 8)
    if "read" in cause:
        monkeypatch.setattr(blend_store.PromptBlender, "_document", _unreadable)
    cfg = EngineConfig(max_num_seqs=2, threads=1)
    engine = Engine(
        model, None, config=cfg, block_size=BS, max_tokens=1024, device_budget="4MiB", **fields
    )
    try:
        out = engine.generate([Chunks.of_ids(ids, spans)], SamplingParams(max_tokens=8))[0]
        assert out.token_ids == want
        assert engine.metrics.value("kvstrata_blend_failed_total") == 1
    finally:
        engine.shutdown()


def test_what_cannot_blend_is_one_line(one_thread):
    ids, spans = prompt([DOC_A])
    engine = engine_of(tiny_model("phi3"))  # not a family the blending forward knows
    try:
        with pytest.raises(RequestRejected, match="model_type='phi3'.*without documents"):
            engine.submit(Chunks.of_ids(ids, spans))
    finally:
        engine.shutdown()
    engine = engine_of(tiny_model("llama"))
    try:
        with pytest.raises(ConfigError, match="blend_recompute=1.5 is invalid"):
            engine.submit(Chunks.of_ids(ids, spans), blend_recompute=1.5)
        with pytest.raises(ConfigError, match="blend_recompute=0.2 is invalid.*documents"):
            engine.submit(ids, blend_recompute=0.2)
        with pytest.raises(ConfigError, match="prompt_logprobs"):
            engine.submit(Chunks.of_ids(ids, spans), SamplingParams(prompt_logprobs=1))
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="blend_recompute=-0.1 is invalid"):
        EngineConfig(blend_recompute=-0.1)
    with pytest.raises(ConfigError, match="recompute=nan"):
        check_recompute(float("nan"), "recompute")


def test_chunks_find_their_documents_or_name_the_one_missing():
    text = "system\nDOC ONE\n\nDOC TWO\nquestion?"
    chunks = Chunks.of(text, ["DOC ONE", "DOC TWO"])
    assert chunks.segments == ("system\n", "DOC ONE", "\n\n", "DOC TWO", "\nquestion?")
    assert chunks.documents == {1, 3}
    with pytest.raises(ConfigError, match=r"documents\[1\]='DOC ONE' is invalid.*verbatim"):
        Chunks.of(text, ["DOC TWO", "DOC ONE"])  # out of order
    split = Chunks.split("sys<d>A<d>B<d>Q", "<d>")
    assert split.segments == ("sys", "A", "B", "Q") and split.documents == {1, 2}
    with pytest.raises(ConfigError, match="separator='<d>' is invalid.*found 1"):
        Chunks.split("sys<d>Q", "<d>")
    with pytest.raises(ConfigError, match="documents=3 is invalid.*after its last document"):
        Chunks(("a", "b", "c", "d"), frozenset({3}))
    # token ids: a document whose edge tokens merged with its neighbours is its inner part
    ids = [9, 9, 40, 11, 12, 13, 41, 9]
    found = find_documents(ids, [[10, 11, 12, 13, 14]])
    assert found.segments == ((9, 9, 40), (11, 12, 13), (41, 9))
    with pytest.raises(ConfigError, match=r"documents\[0\]='<3 tokens>' is invalid"):
        find_documents(ids, [[50, 51, 52]])


def test_blend_prompt_keeps_a_cached_prefix_and_refuses_what_it_cannot_fill(one_thread):
    model = tiny_model("llama")
    ids, spans = prompt([DOC_A, DOC_B])
    want = reference(model, ids, 8)
    enable(model)
    store = KVStore(model.config, block_size=BS, max_tokens=1024, device_budget="4MiB")
    try:
        cache = TieredCache.from_store(store)
        blend_prompt(model, cache, (ids, spans), recompute=1.0)
        cache.close()
        # the head and the first document are a cached prefix now: kept, the rest blended
        cache = TieredCache.from_store(store, prompt_ids=ids)
        assert cache.matched_tokens >= len(HEAD) + BS
        rows = blend_prompt(model, cache, (ids, spans), recompute=1.0)
        got = model.generate(rows, cache=cache, max_new_tokens=8, do_sample=False)
        assert got[0, len(ids) :].tolist() == want
        cache.close()
        with pytest.raises(ConfigError, match="recompute=2 is invalid"):
            blend_prompt(model, TieredCache.from_store(store), (ids, spans), recompute=2)
        two = TieredCache.from_store(store, prompt_ids=[ids, ids])
        with pytest.raises(ConfigError, match="a cache of one row"):
            blend_prompt(model, two, (ids, spans))
        two.close()
    finally:
        store.close()
    with pytest.raises(ConfigError, match=r"spans\[0\]=\(5, 3\) is invalid"):
        Chunks.of_ids(ids, [(5, 3)])
