"""`kvstrata bench peer`: the workloads, the metric maths, the server command lines and
process handling, the vLLM-less path, and one real run of `kvstrata serve` (tiny model)
driven over HTTP by the openai client."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstrata.bench import peer
from kvstrata.bench.peer import command
from kvstrata.bench.peer import report as rep
from kvstrata.bench.peer import servers as srv
from kvstrata.bench.peer import workloads as wl
from kvstrata.core.errors import ConfigError, KvstrataError


def encode(text: str) -> list[int]:
    return list(text.encode())  # a byte "tokenizer": one id per byte


FRAME = wl.Frame.build(encode)
SMALL = wl.Sizes(
    docs=3, doc_tokens=50, question_tokens=5, docqa_out=4, users=2, rounds=3,
    system_tokens=20, turn_tokens=6, chat_out=3, requests=5, prompt_min=10, prompt_max=30,
    out_min=2, out_max=6, single_requests=2, single_prompt=12, single_out=5,
)  # fmt: skip


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    return parser.parse_args(list(argv))


def make_plans(repeats: int = 2) -> list[wl.RepeatRequests]:
    return wl.plans(wl.TokenPool(range(100_000)), FRAME, SMALL, repeats)


# -- workloads ----------------------------------------------------------------------------


def test_docqa_tile_order_and_prefix_sharing():
    plan = make_plans(1)[0]
    assert [r.key for r in plan.docqa_warm] == [f"r0/docqa/doc{d}/q0" for d in range(3)]
    assert [r.key for r in plan.docqa_query] == [
        f"r0/docqa/doc{d}/q{q}" for q in (1, 2) for d in range(3)
    ]
    docs = {r.key.split("/")[2]: r.prompt[: SMALL.doc_tokens] for r in plan.docqa_warm}
    assert len({tuple(d) for d in docs.values()}) == 3  # distinct documents
    q_len = len(FRAME.question_head) + SMALL.question_tokens + len(FRAME.question_tail)
    questions = set()
    for r in plan.docqa_warm + plan.docqa_query:
        assert r.prompt[: SMALL.doc_tokens] == docs[r.key.split("/")[2]]  # the doc is the prefix
        assert len(r.prompt) == SMALL.doc_tokens + q_len and r.max_tokens == SMALL.docqa_out
        questions.add(tuple(r.prompt[SMALL.doc_tokens :]))
    assert len(questions) == 9  # a different question each time


def test_each_repeat_has_fresh_text_and_the_same_system_prompt():
    a, b = make_plans(2)
    assert a.docqa_warm[0].prompt != b.docqa_warm[0].prompt
    firsts = {tuple(r.prompt[:10]) for p in (a, b) for r in p.throughput + p.single}
    assert len(firsts) == 2 * (SMALL.requests + SMALL.single_requests)  # no shared start
    assert a.chat.system == b.chat.system
    assert a.chat.system[: len(FRAME.system_head)] == FRAME.system_head
    assert len(a.chat.system) == len(FRAME.system_head) + SMALL.system_tokens


def test_throughput_and_single_sizes():
    plan = make_plans(1)[0]
    assert [len(r.prompt) for r in plan.throughput] == [10, 15, 20, 25, 30]
    assert sorted(r.max_tokens for r in plan.throughput) == [2, 3, 4, 5, 6]
    assert [r.max_tokens for r in plan.throughput] != [2, 3, 4, 5, 6]  # mixed, not sorted
    assert [(len(r.prompt), r.max_tokens) for r in plan.single] == [(12, 5), (12, 5)]


def test_tokens_needed_covers_the_plans():
    pool = wl.TokenPool(range(10**6))
    wl.plans(pool, FRAME, SMALL, 3)
    assert pool.at <= wl.tokens_needed(SMALL, 3)


def test_token_pool_wraps_around():
    pool = wl.TokenPool([1, 2, 3])
    assert pool.take(2) == [1, 2]
    assert pool.take(5) == [3, 1, 2, 3, 1]


class FakeClient:
    """An AsyncOpenAI stand-in: streams `answer` one character per chunk, then usage."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.completions = self

    async def create(self, **kw):
        self.prompts.append(list(kw["prompt"]))
        assert kw["stream"] and kw["stream_options"] == {"include_usage": True}
        assert kw["extra_body"] == {"ignore_eos": True, "min_tokens": kw["max_tokens"]}
        answer = f"A{len(self.prompts)}"[: kw["max_tokens"]].ljust(kw["max_tokens"], ".")

        async def chunks():
            for i, ch in enumerate(answer):
                choice = SimpleNamespace(
                    text=ch, finish_reason="length" if i == len(answer) - 1 else None
                )
                yield SimpleNamespace(choices=[choice], usage=None)
            details = SimpleNamespace(cached_tokens=7)
            usage = SimpleNamespace(
                completion_tokens=len(answer), prompt_tokens=len(kw["prompt"]),
                prompt_tokens_details=details,
            )  # fmt: skip
            yield SimpleNamespace(choices=[], usage=usage)

        return chunks()


def test_chat_history_grows_by_turn_and_answer():
    plan = make_plans(1)[0].chat
    client = FakeClient()
    records = asyncio.run(srv.chat(client, "m", plan, encode, "r0/chat"))
    assert len(records) == SMALL.users * SMALL.rounds
    assert all(r["completion_tokens"] == SMALL.chat_out == r["max_tokens"] for r in records)
    assert all(r["cached_tokens"] == 7 and r["finish_reason"] == "length" for r in records)
    by_key = {r["key"]: r for r in records}
    for u in range(SMALL.users):
        history = list(plan.system)
        for rnd in range(SMALL.rounds):
            prompt = history + plan.turns[u][rnd]
            assert prompt in client.prompts
            assert by_key[f"r0/chat/user{u}/round{rnd}"]["prompt_tokens"] == len(prompt)
            history = prompt + encode(by_key[f"r0/chat/user{u}/round{rnd}"]["text"])
    assert wl.chat_bound(plan) >= max(len(p) for p in client.prompts) + SMALL.chat_out


def test_batch_keeps_order_and_limit():
    reqs = make_plans(1)[0].docqa_query
    client = FakeClient()
    records = asyncio.run(srv.batch(client, "m", reqs, 2))
    assert [r["key"] for r in records] == [r.key for r in reqs]
    assert client.prompts[0] == reqs[0].prompt and client.prompts[1] == reqs[1].prompt
    assert all(r["error"] is None and r["ttft_s"] >= 0 for r in records)


def test_working_set_and_max_model_len():
    plans = make_plans(2)
    plan = plans[0]
    q = len(plan.docqa_warm[0].prompt) - SMALL.doc_tokens
    assert wl.working_set_tokens(plan, ["docqa", "throughput"], SMALL) == 3 * 50 + 9 * (q + 4)
    assert wl.working_set_tokens(plan, ["throughput"], SMALL) == sum(
        len(r.prompt) + r.max_tokens for r in plan.throughput
    )
    assert wl.working_set_tokens(plan, ["single"], SMALL) == 17
    assert wl.max_model_len(plans, ["single"], None) == 256
    assert wl.max_model_len(plans, ["single"], 100) == 100  # the model's positions cap it
    big = wl.shrink(SMALL, doc_tokens=300)
    plans = wl.plans(wl.TokenPool(range(10_000)), FRAME, big, 1)
    assert wl.max_model_len(plans, ["docqa"], None) == 512  # 300 + question + 4, rounded up


# -- metric maths -------------------------------------------------------------------------


def test_request_times_from_synthetic_timestamps():
    ttft, tpot = wl.request_times(10.0, [10.5, 10.6, 10.7, 10.9], 5)
    assert ttft == pytest.approx(0.5) and tpot == pytest.approx(0.4 / 4)
    assert wl.request_times(1.0, [1.2], 1)[0] == pytest.approx(0.2)
    assert math.isnan(wl.request_times(1.0, [1.2], 1)[1])
    assert all(math.isnan(x) for x in wl.request_times(1.0, [], 0))


def test_percentiles_and_summary():
    assert wl.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert wl.percentile(list(range(101)), 0.99) == 99
    assert math.isnan(wl.percentile([], 0.5))
    rec = lambda i, **kw: {  # noqa: E731
        "key": str(i), "prompt_tokens": 100, "max_tokens": 8, "completion_tokens": 8,
        "cached_tokens": 64, "ttft_s": 0.1 * (i + 1), "tpot_s": 0.01 * (i + 1),
        "error": None, **kw,
    }  # fmt: skip
    records = [rec(i) for i in range(4)] + [rec(4, completion_tokens=5), rec(5, error="x")]
    s = wl.summarize(records, 2.0)
    assert s["requests"] == 6 and s["errors"] == 1 and s["complete"] == 4
    assert s["output_tokens"] == 37 and s["output_tokens_per_s"] == 18.5
    assert s["cached_tokens"] == 5 * 64 and s["prompt_tokens"] == 500
    assert s["ttft_p50_s"] == pytest.approx(0.3) and s["ttft_p99_s"] == pytest.approx(0.5)
    assert s["tpot_p50_s"] == pytest.approx(0.03)
    assert wl.summarize([rec(0, cached_tokens=None)], 1.0)["cached_tokens"] is None
    med = wl.median_over_repeats([s, {**s, "wall_s": 4.0}, {**s, "wall_s": 3.0}])
    assert med["wall_s"] == 3.0 and med["requests"] == 18 and med["repeats"] == 3


def test_output_agreement():
    assert wl.common_prefix("abcd", "abxy") == 0.5
    assert wl.common_prefix("", "") == 1.0 and wl.common_prefix("ab", "abcd") == 0.5
    a = {"k1": "same", "k2": "abcd", "only_a": "x"}
    b = {"k1": "same", "k2": "abzz", "only_b": "y"}
    assert wl.agreement(a, b) == {"requests": 2, "identical": 0.5, "prefix": 0.75}
    assert wl.agreement(a, {}) is None


# -- servers ------------------------------------------------------------------------------


def test_connector_config_matches_the_integration():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (.venv-vllm has it)")
    from kvstrata.integrations.vllm import kv_transfer_config
    from kvstrata.integrations.vllm.stats import PREFIX

    assert srv.connector_config() == kv_transfer_config(host_budget="2GiB")
    fields = {"host_codec": "int8", "disk_dir": "/d", "disk_budget": "8GiB"}
    assert srv.connector_config(**fields) == kv_transfer_config(host_budget="2GiB", **fields)
    assert srv.METRICS_PREFIX == PREFIX  # the names the bench reads are the ones we export


def test_command_lines(tmp_path):
    quarter = srv.KVSize("quarter", 2560, 2560 * 46080)
    cmd = srv.vllm_command(tmp_path / "py", tmp_path, 1234, "vllm_kvstrata", quarter, 1792)
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert flags["--block-size"] == "64" and flags["--dtype"] == "float32"
    assert flags["--kv-cache-memory-bytes"] == str(2560 * 46080)
    assert flags["--max-model-len"] == "1792" and flags["--max-num-seqs"] == "8"
    assert "--enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert json.loads(flags["--kv-transfer-config"]) == srv.connector_config()
    assert "--kv-transfer-config" not in srv.vllm_command(tmp_path, tmp_path, 1, "vllm", quarter, 9)
    host = srv.kvstrata_command(tmp_path, 1, "kvstrata_host", quarter, 46080)
    assert host[1:4] == ["-m", "kvstrata.cli", "serve"]
    assert host[-4:] == ["--device-budget", str(quarter.bytes), "--host-budget", "4GiB"]
    tiny = srv.KVSize("quarter", 512, 512 * 46080)
    int8 = srv.kvstrata_command(tmp_path, 1, "kvstrata_int8", tiny, 46080)
    assert "int8" in int8 and int8[int8.index("--device-budget") + 1] == str(90 * 2**20)
    fits = srv.kvstrata_command(tmp_path, 1, "kvstrata", srv.KVSize("fits", 32768, 1), 46080)
    assert fits[-2:] == ["--max-tokens", "32768"]


def test_backend_variants_command_lines(tmp_path):
    quarter = srv.KVSize("quarter", 2560, 2560 * 46080)

    def extra(variant: str, disk=None) -> dict:
        cmd = srv.vllm_command(tmp_path / "py", tmp_path, 1, variant, quarter, 1792, disk)
        config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert config["kv_connector_extra_config"]["spec_name"] == "KvstrataOffloadingSpec"
        return config["kv_connector_extra_config"]

    assert extra("vllm_kvstrata_int8")["host_codec"] == "int8"
    assert extra("vllm_kvstrata_int8")["host_budget"] == "2GiB"
    disk = extra("vllm_kvstrata_disk", tmp_path / "d")
    assert disk["host_budget"] == str(quarter.bytes)  # the host tier: as large as vLLM's KV
    assert disk["disk_dir"] == str(tmp_path / "d") and disk["disk_budget"] == "8GiB"
    assert "host_codec" not in extra("vllm_kvstrata")
    # opt-in: the default run leaves them out; at "fits" they do not run
    assert set(srv.BACKEND_VARIANTS) - set(srv.DEFAULT_VARIANTS) == {
        "vllm_kvstrata_int8", "vllm_kvstrata_disk"
    }  # fmt: skip
    assert not set(srv.BACKEND_VARIANTS) & set(srv.AT_SIZE["fits"])


def test_backend_counters_are_read_from_metrics(tmp_path):
    """kvstrata's counters as a vLLM server's /metrics shows them (prometheus_client's
    own exposition of labelled counters), summed over vLLM's engine labels."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    hits = Counter("vllm:kvstrata_hits", "h", ["tier", "engine", "model_name"], registry=registry)
    hits.labels("host", "0", "m").inc(5)
    hits.labels("disk", "0", "m").inc(7)
    hits.labels("disk", "1", "m").inc(1)
    Counter("vllm:kvstrata_misses", "m", ["engine"], registry=registry).labels("0").inc(2)
    Counter("vllm:prompt_tokens", "other", registry=registry).inc(100)
    body = generate_latest(registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = srv.Server("vllm_kvstrata", "quarter", [], httpd.server_port, tmp_path / "l")
        assert server.kvstrata_counters() == {
            "hits{tier=host}": 5.0, "hits{tier=disk}": 8.0, "misses": 2.0
        }  # fmt: skip
    finally:
        httpd.shutdown()
        httpd.server_close()
    gone = srv.Server("vllm_kvstrata", "quarter", [], srv.free_port(), tmp_path / "l2")
    assert gone.kvstrata_counters() is None  # a server that died: no counters, no crash


def test_a_disk_variants_scratch_directory_is_removed_at_stop(tmp_path):
    scratch = tmp_path / "disk"
    scratch.mkdir()
    (scratch / "block").write_bytes(b"x")
    srv.Server("vllm_kvstrata_disk", "quarter", [], 1, tmp_path / "log", scratch=scratch).stop()
    assert not scratch.exists()


def test_server_that_exits_reports_its_log(tmp_path):
    code = "import sys; print('ValueError: the root cause'); print('x\\n' * 40); sys.exit(3)"
    server = srv.Server("vllm", "fits", [sys.executable, "-c", code], srv.free_port(),
                        tmp_path / "log")  # fmt: skip
    with pytest.raises(KvstrataError, match="exited with code 3") as info:
        server.start(60)
    # the last lines, and the error line above them (a long traceback hides it)
    assert "ValueError: the root cause\n...\nx\nx\n" in str(info.value)


def test_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    code = "import time; print('loading', flush=True); time.sleep(60)"
    server = srv.Server("kvstrata", "fits", [sys.executable, "-c", code], srv.free_port(),
                        tmp_path / "log")  # fmt: skip
    with pytest.raises(KvstrataError, match="did not answer /health within 1 s.*loading"):
        server.start(1)
    assert server.proc is not None and server.proc.poll() is not None


# -- the command --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--sizes", "fits,huge"], "sizes"),
        (["--variants", "sglang"], "variants"),
        (["--only", ""], "only"),
        (["--repeats", "0"], "repeats"),
        (["--docs", "0"], "docs"),
        (["--kvstrata-args=--threads '2"], "kvstrata_args"),
    ],
)
def test_bad_flags_are_config_errors(argv, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        peer.run(args_of(*argv))


def test_no_variant_at_the_sizes_is_a_config_error():
    with pytest.raises(ConfigError, match="none of them runs at --sizes quarter"):
        peer.run(args_of("--variants", "kvstrata", "--sizes", "quarter", "--no-vllm"))


def test_without_vllm_the_vllm_side_is_skipped(tmp_path, capsys, monkeypatch):
    def no_run(o):
        raise AssertionError("nothing should run")

    monkeypatch.setattr(command, "measure", no_run)
    missing = str(tmp_path / "no-venv" / "python")
    assert peer.run(args_of("--variants", "vllm,vllm_kvstrata", "--vllm-python", missing)) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "vLLM side skipped" in out and missing in out
    o = command._options(args_of("--vllm-python", missing))
    assert command._settle_vllm(o) and o.variants == ["kvstrata", "kvstrata_host", "kvstrata_int8"]
    assert o.vllm_skipped.endswith("(make venv-vllm creates it)")
    o = command._options(args_of("--no-vllm", "--variants", "vllm,kvstrata"))
    assert command._settle_vllm(o) and o.variants == ["kvstrata"] and o.vllm_skipped == "--no-vllm"


def test_quick_docqa_against_kvstrata_serve(tmp_path, capsys):
    """One real run: `kvstrata serve` (tiny model) in its own process, over HTTP."""
    path = tmp_path / "peer.json"
    argv = ["--quick", "--variants", "kvstrata", "--only", "docqa", "--model", "tiny",
            "--json", str(path), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert peer.run(args_of(*argv)) == 0
    report = json.loads(path.read_text())
    assert list(report["sizes"]) == ["fits"] and report["repeats"] == 1
    fits = report["sizes"]["fits"]
    assert fits["commands"]["kvstrata"].split()[1:4] == ["-m", "kvstrata.cli", "serve"]
    rounds = fits["rounds"]["kvstrata"]
    assert set(rounds) == {"docqa_warm", "docqa_query"}
    quick = wl.QUICK
    for phase, count in (("docqa_warm", quick.docs), ("docqa_query", 2 * quick.docs)):
        (result,) = rounds[phase]
        assert result["wall_s"] > 0 and result["errors"] == 0
        assert result["requests"] == result["complete"] == len(result["records"]) == count
        for rec in result["records"]:
            assert rec["completion_tokens"] == rec["max_tokens"] == quick.docqa_out
            assert rec["finish_reason"] == "length" and rec["text"]
            assert 0 < rec["ttft_s"] < result["wall_s"] and rec["tpot_s"] > 0
        assert result["output_tokens_per_s"] == pytest.approx(
            count * quick.docqa_out / result["wall_s"]
        )
    # cold documents, then every question a prefix hit on its document's whole blocks
    assert rounds["docqa_warm"][0]["cached_tokens"] == 0
    hits = [r["cached_tokens"] for r in rounds["docqa_query"][0]["records"]]
    shared = quick.doc_tokens + len(wl.QUESTION_HEAD.encode())  # the byte tokenizer
    assert hits == [shared // 64 * 64] * (2 * quick.docs)
    out = capsys.readouterr().out
    assert "docqa_query" in out and "command:" in out


def test_compare_and_report_against_vllm(capsys):
    def result(wall: float, ttft: float, texts: list[str]) -> dict:
        records = [
            {"key": f"k{i}", "prompt_tokens": 100, "max_tokens": 4, "completion_tokens": 4,
             "cached_tokens": 64, "ttft_s": ttft, "tpot_s": 0.01, "error": None, "text": t}
            for i, t in enumerate(texts)
        ]  # fmt: skip
        return {**wl.summarize(records, wall), "records": records}

    rounds = {
        "vllm": {"chat": [result(2.0, 0.4, ["ab", "cd"]), result(4.0, 0.2, ["ab", "cd"])]},
        "kvstrata": {"chat": [result(1.0, 0.1, ["ab", "cx"]), result(2.0, 0.3, ["ab", "cx"])]},
    }
    summary = wl.compare(rounds)
    assert summary["reference"] == "vllm"
    assert summary["variants"]["vllm"]["chat"]["ratios"] is None
    row = summary["variants"]["kvstrata"]["chat"]
    assert row["wall_s"] == 1.5 and row["requests"] == 4 and row["cached_tokens"] == 256
    assert row["ratios"]["wall_s"] == pytest.approx(1.5 / 3.0)
    assert row["ratios"]["ttft_p50_s"] == pytest.approx(0.2 / 0.3)
    assert row["ratios"]["output_tokens_per_s"] == pytest.approx(6.0 / 3.0)
    assert row["agreement"] == {"requests": 2, "identical": 0.5, "prefix": 0.75}
    kv = {"name": "fits", "tokens": 1024, "bytes": 2**20}
    report = {
        "command": "kvstrata bench peer", "model": "tiny", "working_set_tokens": 512,
        "repeats": 2, "sizes": {"fits": {"kv": kv, "summary": summary, "startup_s": {}}},
        "notes": [], "vllm_skipped": None, "machine_warning": None, "log_dir": "/tmp/x",
    }  # fmt: skip
    assert wl.failures(report) == 0
    rep.print_report(report)
    out = capsys.readouterr().out
    assert "fits: ratio (variant ÷ vllm)" in out and "chat wall s" in out
    assert "lower is better" in out and "higher is better" in out and "50 % / 75 %" in out
    assert "kvstrata under vLLM" not in out  # no backend variant ran


def test_backend_counters_summed_over_repeats_and_printed(capsys):
    def result(wall: float, counters: dict | None = None) -> dict:
        records = [{"key": "k", "prompt_tokens": 100, "max_tokens": 4, "completion_tokens": 4,
                    "cached_tokens": 64, "ttft_s": 0.1, "tpot_s": 0.01, "error": None,
                    "text": "ab"}]  # fmt: skip
        out = {**wl.summarize(records, wall), "records": records}
        return out if counters is None else {**out, "kvstrata": counters}

    rounds = {
        "vllm": {"docqa_queries": [result(2.0), result(2.0)]},
        "vllm_kvstrata_disk": {
            "docqa_queries": [
                result(1.0, {"lookups": 10.0, "hits{tier=disk}": 6.0, "misses": 1.0}),
                result(1.0, {"lookups": 10.0, "hits{tier=disk}": 4.0, "hits{tier=host}": 3.0}),
                result(1.0),  # its /metrics did not answer: left out of the sums
            ]
        },
    }
    result_ = {"rounds": rounds, "summary": wl.compare(rounds)}
    command._add_backend_counters(result_)
    row = result_["summary"]["variants"]["vllm_kvstrata_disk"]["docqa_queries"]
    assert row["kvstrata"] == {"lookups": 20.0, "hits{tier=disk}": 10.0, "misses": 1.0,
                               "hits{tier=host}": 3.0}  # fmt: skip
    assert "kvstrata" not in result_["summary"]["variants"]["vllm"]["docqa_queries"]
    kv = {"name": "quarter", "tokens": 1024, "bytes": 2**20}
    report = {
        "command": "kvstrata bench peer", "model": "tiny", "working_set_tokens": 512,
        "repeats": 2, "sizes": {"quarter": {"kv": kv, "summary": result_["summary"],
                                            "startup_s": {}}},
        "notes": [], "vllm_skipped": None, "machine_warning": None, "log_dir": "/tmp/x",
    }  # fmt: skip
    rep.print_report(report)
    out = capsys.readouterr().out
    assert "kvstrata under vLLM" in out
    backend_table = out[out.index("kvstrata under vLLM") :]
    line = next(x for x in backend_table.splitlines() if "│ vllm_kvstrata_disk" in x)
    cells = [c.strip() for c in line.split("│")[1:-1]]
    # workload, variant, lookups, host hits, disk hits, misses, reads, no room, corrupt
    assert cells == ["docqa_queries", "vllm_kvstrata_disk", "20", "3", "10", "1", "0", "0", "0"]


def test_vllm_runs_on_every_core_unless_the_caller_chose(monkeypatch):
    from kvstrata.bench.peer.servers import server_env

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert server_env("vllm")["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in server_env("kvstrata")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert server_env("vllm_kvstrata")["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert server_env("kvstrata")["PYTHONHASHSEED"] == "0"


def test_repo_root_is_the_checkout():
    """The default vLLM interpreter is the checkout's .venv-vllm (found from the module's
    own path, which moved once: the root must still hold pyproject.toml)."""
    assert (srv.repo_root() / "pyproject.toml").is_file()
    python, _ = srv.find_vllm(None, False)
    assert python is None or Path(python).parent.parent == srv.repo_root() / ".venv-vllm"
