"""`Engine`: continuous batching of many requests over one `KVStore`.

One engine thread owns the store and the model's forwards. Each step it picks the
requests to run (`scheduler.plan_step`); its `StepRunner` (runner.py) packs their new
tokens — one per decode, a chunk per prefill — into one row (the transformers adapter's
`StepCache`), runs one forward, samples the next token of every request whose known
tokens are all in, and hands the new text to each request's callback. Requests arrive
(`submit`) and leave (`abort`) from any thread through a command queue; `generate` and
the async `stream` are built on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from kvstrata.config import CacheConfig
from kvstrata.core.blending import check_recompute
from kvstrata.core.errors import ConfigError, KvstrataError, UnsupportedModelError
from kvstrata.core.units import format_bytes
from kvstrata.engine.metrics import EngineMetrics
from kvstrata.engine.params import (
    EngineConfig,
    EngineStopped,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from kvstrata.engine.runner import StepRunner
from kvstrata.engine.scheduler import Request, Scheduler
from kvstrata.integrations.hf import enable
from kvstrata.integrations.hf.blend_store import PromptBlender
from kvstrata.integrations.hf.lean import lean_forward
from kvstrata.integrations.hf.linear import install as install_native_linear
from kvstrata.integrations.hf.step import StepCache
from kvstrata.store.events import EventSink, KVEventRecorder
from kvstrata.store.kvstore import KVStore
from kvstrata.workload.chunks import Chunks

log = logging.getLogger("kvstrata.engine")
IDLE_SNAPSHOT_S = 1.0  # an idle engine refreshes its stats snapshot this often
OnOutput = Callable[[RequestOutput], None]


class Engine:
    """Serve many requests at once from one model over one tiered KV store.

    Args:
        model: a transformers causal LM (switched to the "kvstrata" attention).
        tokenizer: its tokenizer (needed for text prompts, stop strings and text).
        cache_config: the store's CacheConfig (or give its fields as keywords).
        config: EngineConfig (batching, preemption).
        model_name: the name requests use (default: the config's path or type).
        prefix_caching: share cached prompt prefixes between requests.
        kv_events: where each step's KV events go (e.g. a ZMQ publisher); None: none
            are recorded. The engine does not shut it down.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        cache_config: CacheConfig | None = None,
        config: EngineConfig | None = None,
        *,
        model_name: str | None = None,
        prefix_caching: bool = True,
        kv_events: EventSink | None = None,
        **cache_fields: Any,
    ) -> None:
        if cache_config is None:
            cache_config = CacheConfig(**cache_fields)
        elif cache_fields:
            cache_config = cache_config.replace(**cache_fields)
        self.config = config or EngineConfig()
        self.model = enable(model).eval()
        self.tokenizer = tokenizer
        mc = model.config
        # default: the model directory's name (never a whole path), else its type
        path = str(getattr(mc, "_name_or_path", "") or "").rstrip("/\\")
        self.model_name = model_name or path.replace("\\", "/").rsplit("/", 1)[-1] or mc.model_type
        limit = getattr(mc, "max_position_embeddings", None)
        self.max_model_len: int | None = limit if isinstance(limit, int) else None
        self.vocab_size = int(getattr(mc, "vocab_size", 0) or 0)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.store = KVStore(mc, cache_config, prefix_caching=prefix_caching)
        self.metrics = EngineMetrics(self._snapshot_copy)
        self._kv_sink = kv_events
        self._kv_events: KVEventRecorder | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._snapshot: dict[str, Any] = {"running": 0, "waiting": 0, "preempted": 0}
        self._lock = threading.Lock()
        self._stop = False
        self._submit_lock = threading.Lock()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.sched: Scheduler | None = None
        self.runner: StepRunner | None = None
        self._blend_refusal: str | None = None  # why prompts with documents are refused
        self._threads = self.config.threads or torch.get_num_threads()
        self._thread = threading.Thread(target=self._main, name="kvstrata-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    # -- requests (any thread) ----------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError.field("prompt", prompt, "token ids (the engine has no tokenizer)")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ConfigError.field("prompt", prompt, "a string or a list of token ids")
        return list(prompt)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """RequestRejected when the request can never run (with the numbers)."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestRejected("prompt is empty: give at least one token")
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in prompt_ids):
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise RequestRejected(
                f"prompt token id {bad} is outside the model's vocabulary "
                f"(0..{self.vocab_size - 1})"
            )
        if self.vocab_size:
            for token, _ in params.logit_bias:
                if token >= self.vocab_size:
                    raise RequestRejected(
                        f"logit_bias token id {token} is outside the model's vocabulary "
                        f"(0..{self.vocab_size - 1})"
                    )
        total = n + params.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request needs {total} ({n} in the prompt + max_tokens {params.max_tokens}): "
                "shorten the prompt or lower max_tokens"
            )
        sched = self.sched
        assert sched is not None
        need = sched.blocks_for(total)
        if need > sched.capacity_blocks:
            bs, block = sched.block_size, sched.block_bytes
            raise RequestRejected(
                f"the request needs {need} blocks of {bs} tokens ({format_bytes(need * block)}) "
                f"for {total} tokens ({n} in the prompt + max_tokens {params.max_tokens}); all "
                f"tiers together hold {sched.capacity_blocks} "
                f"({format_bytes(sched.capacity_blocks * block)}): raise host_budget / "
                "disk_budget, or shorten the request"
            )

    def submit(
        self,
        prompt: str | list[int] | Chunks,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        on_output: OnOutput | None = None,
        salt: str | None = None,
        first_output: bool = False,
        blend_recompute: float | None = None,
    ) -> str:
        """Queue a request (thread-safe). Raises RequestRejected / ConfigError at once
        for a request that can never run. `on_output` is called from the engine
        thread with each new piece of output and last with `finish_reason` set.
        `first_output`: an output comes as soon as the first token is chosen — the
        prompt is computed and its full blocks are in the prefix cache — even when that
        token brings no text yet (otherwise outputs come with new text only).

        A `kvstrata.Chunks` prompt names its documents: their K/V are reused wherever
        they sit and `blend_recompute` of their tokens (default: the config's) are
        recomputed in context (docs/blend.md)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError.field("params", params, "a kvstrata.engine.SamplingParams")
        blend = None
        if isinstance(prompt, Chunks):
            if self._blend_refusal is not None:
                raise RequestRejected(self._blend_refusal)
            if params.prompt_logprobs is not None:
                raise ConfigError.field(
                    "prompt_logprobs",
                    params.prompt_logprobs,
                    "None for a prompt with documents (it has no logits before its end)",
                )
            ids, spans = prompt.encode(self.tokenizer)
            recompute = self.config.blend_recompute if blend_recompute is None else blend_recompute
            blend = (spans, check_recompute(recompute))
        elif blend_recompute is not None:
            raise ConfigError.field(
                "blend_recompute", blend_recompute, "omitted unless the prompt has documents"
            )
        else:
            ids = self.encode(prompt)
        self.check(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        salt = self.config.salt if salt is None else salt
        req = Request(rid, ids, params, on_output, salt, self.tokenizer, self.eos_ids)
        req.first_output = bool(first_output)
        req.blend = blend
        with self._submit_lock:  # nothing is queued behind the engine's "stop"
            if not self.is_running:
                raise EngineStopped(f"the engine is shut down{_why(self._error)}")
            self._commands.put(("add", req))
        return rid

    @property
    def blend_refusal(self) -> str | None:
        """Why prompts with documents are refused (the model cannot blend), or None."""
        return self._blend_refusal

    @property
    def is_running(self) -> bool:
        """The engine takes requests (not shut down, its thread alive)."""
        return not self._stop and self._error is None and self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe): its blocks are freed at the engine's next
        step and a last output with finish_reason "abort" follows."""
        self._commands.put(("abort", request_id))

    def generate(
        self,
        prompts: list[str | list[int] | Chunks],
        params: SamplingParams | list[SamplingParams] | None = None,
        timeout: float | None = None,
    ) -> list[RequestOutput]:
        """Run requests to the end (blocking); whole outputs in prompt order. After
        `timeout` seconds the unfinished ones are aborted and TimeoutError raised."""
        if threading.current_thread() is self._thread:
            raise KvstrataError("Engine.generate cannot be called from the engine thread")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError.field("params", len(plist), f"one per prompt ({len(prompts)})")
        results: list[RequestOutput] = []
        done = [threading.Event() for _ in prompts]

        def collector(i: int) -> OnOutput:
            def on_output(out: RequestOutput) -> None:
                res = results[i]
                res.token_ids += out.token_ids
                res.text += out.text
                res.finish_reason, res.error = out.finish_reason, out.error
                res.prompt_tokens, res.cached_tokens = out.prompt_tokens, out.cached_tokens
                res.completion_tokens = out.completion_tokens
                if out.logprobs is not None:
                    res.logprobs = (res.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    done[i].set()

            return on_output

        submitted = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
                results.append(RequestOutput(request_id=""))
                rid = self.submit(prompt, p, on_output=collector(i))
                results[i].request_id = rid
                submitted.append(rid)
            deadline = None if timeout is None else time.monotonic() + timeout
            for event in done:
                while not event.wait(0.5):
                    if not self._thread.is_alive():
                        raise KvstrataError("the engine stopped before the requests finished")
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"requests still running after {timeout} s")
        except BaseException:
            for rid in submitted:
                self.abort(rid)
            raise
        return results

    async def stream(
        self,
        prompt: str | list[int] | Chunks,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        salt: str | None = None,
        blend_recompute: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (new tokens and text each); leaving the
        loop early (break, cancellation, a client gone) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the event loop is gone: nobody is listening
                self.abort(out.request_id)

        rid = self.submit(
            prompt,
            params,
            request_id=request_id,
            on_output=on_output,
            salt=salt,
            blend_recompute=blend_recompute,
        )
        finished = False
        try:
            while True:
                out = await outputs.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def stats(self) -> dict[str, Any]:
        """A snapshot (thread-safe) taken by the engine after its latest step."""
        return self._snapshot_copy()

    def _snapshot_copy(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._snapshot)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread (running requests end with "abort") and close the
        store (its disk tier keeps the prefix cache). Idempotent."""
        with self._submit_lock:
            self._stop = True
            self._commands.put(("stop", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the engine thread ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            torch.set_num_threads(self._threads)  # OpenMP thread counts are per thread
            weights = next(self.model.parameters())
            self.store.build(weights.dtype, num_sequences=self.config.max_num_seqs)
            self.sched = Scheduler(self.store, self.config, self.metrics)
            self.runner = StepRunner(
                self.model,
                self.store,
                self.sched,
                StepCache(self.store),
                self.metrics,
                self.eos_ids,
                weights.device,
                self.abort,
                self.config.native_linear and install_native_linear(self.model) > 0,
                lean_forward(self.model) if self.config.lean_forward else None,
                self._prompt_blender(),
            )
            if self._kv_sink is not None:  # AllBlocksCleared, then what the disk kept
                self._kv_events = KVEventRecorder()
                self.store.record_events(self._kv_events)
                self._publish_events()
            self._take_snapshot()
        except BaseException as err:  # reported by the constructor
            self._error = err
            self.store.close()
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except BaseException as err:
            self._error = err
            log.exception("kvstrata engine stopped")
        finally:
            self._stop = True
            with self._submit_lock:  # requests queued before the stop end too
                self._drain_adds()
            self._finish_all("abort", f"the engine stopped{_why(self._error)}")
            self._take_snapshot()
            if self.runner is not None:
                self.runner.deliver()
            self._publish_events()
            self.store.close()

    def _prompt_blender(self) -> PromptBlender | None:
        """What blends prompts with documents; None (the reason kept) if it cannot."""
        try:
            return PromptBlender(self.model, self.store)
        except UnsupportedModelError as err:
            self._blend_refusal = str(err)
            return None

    def _loop(self) -> None:
        sched, runner = self.sched, self.runner
        assert sched is not None and runner is not None
        while not self._stop:
            wait = self.store.adapt()  # budgets under memory pressure, between steps
            if not sched.has_work():  # idle: sleep until a command comes...
                try:
                    idle = IDLE_SNAPSHOT_S if wait is None else min(IDLE_SNAPSHOT_S, wait)
                    self._command(*self._commands.get(timeout=idle))
                except queue.Empty:  # ...taking snapshots: the remote tier's write-behind
                    self._take_snapshot()  # goes on while idle, and stats() follow it
                    if self._kv_events is not None:
                        self._publish_events()
                    continue
            while True:
                try:
                    self._command(*self._commands.get_nowait())
                except queue.Empty:
                    break
            if self._stop:
                return
            if sched.has_work() and not runner.step():
                # nothing could run (cannot happen by the admission rules; never spin)
                with contextlib.suppress(queue.Empty):
                    self._command(*self._commands.get(timeout=0.05))
            if self._kv_events is not None:  # one batch per step, as vLLM's
                self._publish_events()
            self._take_snapshot()  # before the outputs go: a finished request's blocks
            runner.deliver()  # are already free in the stats its caller may read

    def _publish_events(self) -> None:
        if self._kv_events is not None and self._kv_sink is not None:
            wants_snapshot = getattr(self._kv_sink, "wants_snapshot", None)
            if wants_snapshot is not None and wants_snapshot():  # a subscriber joined
                self.store.record_events(self._kv_events)  # AllBlocksCleared + all held
            events = self._kv_events.take()
            if events:
                self._kv_sink.publish(time.time(), events)

    def _command(self, kind: str, arg: Any) -> None:
        sched = self.sched
        assert sched is not None
        if kind == "add":
            if not sched.add(arg):
                error = f"request_id {arg.id!r} is already running"
                self.runner.emit(arg, RequestOutput(arg.id, finish_reason="abort", error=error))
        elif kind == "abort":
            req = sched.requests.get(arg)
            if req is not None:
                self.runner.finish(req, "abort")
        elif kind == "stop":
            self._stop = True

    def _drain_adds(self) -> None:
        sched = self.sched
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and sched is not None:
                sched.add(arg)

    def _finish_all(self, reason: str, error: str | None) -> None:
        sched, runner = self.sched, self.runner
        if sched is None or runner is None:
            return
        for req in list(sched.requests.values()):
            with contextlib.suppress(KvstrataError):
                runner.finish(req, reason, error)

    def _take_snapshot(self) -> None:
        sched = self.sched
        assert sched is not None
        snap = sched.snapshot()
        with self._lock:
            self._snapshot = snap


def _why(error: BaseException | None) -> str:
    return f" ({type(error).__name__}: {error})" if error is not None else ""


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
