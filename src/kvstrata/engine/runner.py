"""The engine's model runner: one step on the engine thread — a forward over the batch
the scheduler planned (packed into one row by the transformers adapter's `StepCache`),
the recovery of a step that failed, sampling, and the requests' outputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.core.errors import OutOfBlocksError, TierIOError
from kvstrata.engine.metrics import EngineMetrics
from kvstrata.engine.params import RequestOutput, TokenLogprobs
from kvstrata.engine.sampling import sample, token_logprobs
from kvstrata.engine.scheduler import Request, Scheduler
from kvstrata.integrations.hf.blend_store import PromptBlender
from kvstrata.integrations.hf.lean import LeanForward
from kvstrata.integrations.hf.linear import native_projections
from kvstrata.integrations.hf.step import StepCache
from kvstrata.store.contract import EngineStore

log = logging.getLogger("kvstrata.engine")


class StepRunner:
    """Runs the engine's steps (on the engine thread only).

    Args:
        model: the causal LM (already switched to the kvstrata attention).
        store: the engine's store (abort_step / failure after a failed forward).
        sched: the scheduler that plans each step.
        step_cache: the packed-step Cache the forward writes through.
        metrics: the engine's counters.
        eos_ids: the model's end-of-sequence token ids.
        device: where the model's weights are.
        abort: queues an abort of a request id (for a consumer that failed).
        native_linear: small projections take the native kernel (hf.linear).
        lean: the model's lean packed-step forward (hf.lean), None: transformers'.
        blender: blends prompts with documents (hf.blend_store); None: the model
            cannot (the engine refuses such requests).
    """

    def __init__(
        self,
        model: Any,
        store: EngineStore,
        sched: Scheduler,
        step_cache: StepCache,
        metrics: EngineMetrics,
        eos_ids: set[int],
        device: torch.device,
        abort: Callable[[str], None],
        native_linear: bool = False,
        lean: LeanForward | None = None,
        blender: PromptBlender | None = None,
    ) -> None:
        self.model = model
        self.blender = blender
        self.lean = lean
        self.native_linear = native_linear
        self.store = store
        self.sched = sched
        self.step_cache = step_cache
        self.metrics = metrics
        self.eos_ids = eos_ids
        self.device = device
        self.abort = abort
        self.outbox: list[tuple[Request, RequestOutput]] = []

    def step(self) -> bool:
        """One forward over the planned batch; False when nothing could run."""
        sched = self.sched
        batch = sched.plan_step()
        for req, error in sched.take_failed():  # e.g. a storage error attaching a prefix
            self.finish(req, "abort", error)
        if not batch:
            return False
        t0 = time.perf_counter()
        if any(r.blend is not None for r, _ in batch):
            batch = self._blend(batch)
        seq_ids = [r.seq_id for r, _ in batch]
        counts = [n for _, n in batch]
        tokens = [r.tokens(r.computed, n) for r, n in batch]
        positions = [torch.arange(r.computed, r.computed + n) for r, n in batch]
        last = list(itertools.accumulate(counts))
        ready = [i for i, (r, n) in enumerate(batch) if r.computed + n == r.num_tokens]
        rows = [last[i] - 1 for i in ready]  # the logits kept: one per sampled token
        special = None  # the slow path: prompt logprobs or max_tokens 0 in the batch
        if any(r.special for r, _ in batch):
            special = _special_rows(batch, last, ready)
            rows, ready = special.rows, special.ready
        self.step_cache.begin(seq_ids, counts, tokens)
        try:
            with torch.inference_mode(), native_projections(self.native_linear):
                logits = self._forward(tokens, positions, rows)
        except Exception as err:
            self._recover(batch, err)
            return True
        for req, n in batch:
            req.computed += n
            (self.metrics.decode_tokens if req.out_ids else self.metrics.prefill_tokens).inc(n)
            if req.prompt_lps is not None and req.computed >= len(req.prompt_ids):
                req.prompt_scored = True  # (its rows are scored below, in this step)
        # sampled with per-request CPU generators
        logits = logits.float().cpu() if special is None else self._score_prompts(logits, special)
        reqs = [batch[i][0] for i in ready]
        adjust = None
        if any(r.adjuster is not None for r in reqs):  # penalties, logit_bias, min_tokens
            adjust = [None if r.adjuster is None else (r.adjuster, r.out_ids) for r in reqs]
        next_ids = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], adjust)
        if any(r.out_logprobs is not None for r in reqs):
            self._sampled_logprobs(logits, reqs, next_ids)
        now = time.perf_counter()
        for req, token in zip(reqs, next_ids, strict=True):
            self._accept(req, token, now)
        self.metrics.step.observe(time.perf_counter() - t0)
        return True

    def _blend(self, batch: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Blend the prompts with documents that start this step: their K/V up to the
        last prompt token reused / recomputed (hf.blend_store), which this step then
        computes like any prefill's last token. A blend that failed (out of blocks, a
        block that cannot be read) leaves exact K/V only: the rest is prefilled."""
        out = []
        for req, n in batch:
            spec, req.blend = req.blend, None
            if spec is not None and self.blender is not None and not req.out_ids:
                assert req.seq_id is not None
                with torch.inference_mode():
                    res = self.blender.blend(req.seq_id, req.prompt_ids, *spec, req.salt)
                req.computed = res.computed
                n = min(n, req.remaining)
                m = self.metrics
                m.blend_tokens.labels("reused").inc(res.reused)
                m.blend_tokens.labels("recomputed").inc(res.recomputed)
                m.blend_documents.labels("found").inc(res.found)
                m.blend_documents.labels("computed").inc(res.missed)
                if res.error is not None:
                    m.blend_failed.inc()
                    log.warning(
                        "kvstrata engine: blending %s failed (%s); prefilling it", req.id, res.error
                    )
            out.append((req, n))
        return out

    def _forward(
        self, tokens: list[list[int]], positions: list[torch.Tensor], rows: list[int]
    ) -> torch.Tensor:
        """The packed row's logits at `rows` ([len(rows), vocab])."""
        dev = self.device
        ids = torch.tensor([t for ts in tokens for t in ts], device=dev)[None]
        pos = torch.cat(positions).to(dev)[None]
        keep = torch.tensor(rows, dtype=torch.long, device=dev)
        if self.lean is not None:
            return self.lean(ids, pos, self.step_cache, keep)[0]
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            cache=self.step_cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits[0]

    def _recover(self, batch: list[tuple[Request, int]], err: Exception) -> None:
        """A failed forward: undo the step, then by cause — out of blocks: preempt the
        newest request (the batch's first fails when none is left); a block that could
        not be read (corrupt or missing, never served): recompute the sequence that owns
        it (all of the batch when unknown), the others only redo the step, with nothing
        charged to their retries; anything else ends the batch's requests."""
        sched = self.sched
        if isinstance(err, OutOfBlocksError):
            self._undo(batch, f"out of KV blocks: {err}")
            if not sched.relieve(batch):  # nothing left to preempt: the request fails
                self.finish(batch[0][0], "abort", f"out of KV blocks: {err}")
        elif isinstance(err, TierIOError):
            self._undo(batch, f"a block could not be read: {err}")
            owners = err.seq_ids & {r.seq_id for r, _ in batch}  # none known: all of them
            for req, _ in batch:
                if owners and req.seq_id not in owners:
                    continue
                if req.id in sched.requests and not sched.recompute(req):
                    self.finish(req, "abort", f"a block could not be read, twice: {err}")
        else:
            self._undo(batch, f"the model step failed: {err}")
            log.exception("kvstrata engine: a step failed", exc_info=err)
            for req, _ in batch:
                self.finish(req, "abort", f"the model step failed: {err}")

    def _score_prompts(self, logits: torch.Tensor, special: _SpecialRows) -> torch.Tensor:
        """Record the prompt logprobs of this step's prompt chunks, end the requests
        that only score their prompt (max_tokens 0); the rows to sample from (CPU)."""
        for req, first, count, pos in special.scores:
            assert req.prompt_lps is not None and req.params.prompt_logprobs is not None
            targets = req.prompt_ids[pos + 1 : pos + 1 + count]
            req.prompt_lps[pos + 1 : pos + 1 + count] = token_logprobs(
                logits[first : first + count], targets, req.params.prompt_logprobs
            )
        for req in special.scored_only:
            self.finish(req, "length")
        return logits[special.sample_rows].float().cpu()

    def _sampled_logprobs(
        self, logits: torch.Tensor, reqs: list[Request], next_ids: list[int]
    ) -> None:
        """Append the raw logprobs of the tokens just chosen to the requests that ask."""
        want = [j for j, r in enumerate(reqs) if r.out_logprobs is not None]
        top = max(reqs[j].params.logprobs or 0 for j in want)
        entries = token_logprobs(logits[want], [next_ids[j] for j in want], top)
        for j, entry in zip(want, entries, strict=True):
            req = reqs[j]
            k = req.params.logprobs or 0
            assert req.out_logprobs is not None
            req.out_logprobs.append(
                entry if k == top else TokenLogprobs(entry.token_id, entry.logprob, entry.top[:k])
            )

    def _undo(self, batch: list[tuple[Request, int]], why: str) -> None:
        """Undo a failed step; a request whose sequence cannot be restored ends. (A step
        that failed before the store placed it, e.g. out of blocks, has nothing to undo:
        its requests go on.)"""
        self.store.abort_step([r.seq_id for r, _ in batch])
        for req, _ in batch:
            failure = self.store.failure(req.seq_id)
            if failure is not None and req.id in self.sched.requests:
                self.finish(req, "abort", f"{why}; its KV could not be restored ({failure})")

    def _accept(self, req: Request, token: int, now: float) -> None:
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.tpot.observe(now - req.last_token_at)
        req.last_token_at = now
        req.out_ids.append(token)
        self.metrics.generation_tokens.inc()
        p = req.params
        stop_token = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        # min_tokens: the stop tokens were blocked; stop strings are looked for once
        # that many tokens are out (vLLM: a stop string may end with token min_tokens)
        check = len(req.out_ids) >= p.min_tokens
        text, stopped = ("", False) if stop_token else req.text.push([token], check)
        if stop_token or stopped:
            return self.finish(req, "stop", delta=text)
        if len(req.out_ids) >= p.max_tokens:
            return self.finish(req, "length", delta=text)
        first = req.first_output and len(req.out_ids) == 1
        if req.on_output is not None and (text or req.emit_tokens or first):
            ids, logprobs = req.take_new()
            self.emit(req, RequestOutput(req.id, ids, text, logprobs=logprobs))

    def finish(self, req: Request, reason: str, error: str | None = None, delta: str = "") -> None:
        sched = self.sched
        if sched.requests.get(req.id) is not req:
            return  # already ended (e.g. by a failed step's undo)
        sched.remove(req)
        text = delta + req.text.flush() if reason != "abort" else delta
        now = time.perf_counter()
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(now - req.arrival)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self.metrics.cached_tokens.inc(req.cached)
        ids, logprobs = req.take_new()
        out = RequestOutput(req.id, ids, text, reason, error=error, logprobs=logprobs)
        self.emit(req, out)

    def emit(self, req: Request, out: RequestOutput) -> None:
        out.prompt_tokens, out.cached_tokens = len(req.prompt_ids), req.cached
        out.completion_tokens = len(req.out_ids)
        if (
            req.prompt_lps is not None
            and not req.prompt_lps_sent
            and req.computed >= len(req.prompt_ids)
        ):
            out.prompt_logprobs, req.prompt_lps_sent = list(req.prompt_lps), True
        if req.on_output is not None:
            self.outbox.append((req, out))

    def deliver(self) -> None:
        """Hand the step's outputs to their callbacks."""
        outbox, self.outbox = self.outbox, []
        for req, out in outbox:
            try:
                req.on_output(out)
            except Exception:  # a broken consumer must not stop the engine
                log.exception("kvstrata engine: on_output of %s failed; aborting it", req.id)
                if not out.finished:
                    self.abort(req.id)


@dataclass
class _SpecialRows:
    """The logits a step with prompt-logprob or score-only requests keeps: `rows`
    (packed positions), `scores` (request, first kept row, rows, first position: the
    logits at position p score prompt token p + 1), `sample_rows` (kept rows of the
    requests that choose a token, in `ready` order), `scored_only` (max_tokens 0
    requests whose prompt is done: they end without a token)."""

    rows: list[int]
    ready: list[int]
    scores: list[tuple[Request, int, int, int]]
    sample_rows: list[int]
    scored_only: list[Request]


def _special_rows(
    batch: list[tuple[Request, int]], last: list[int], ready: list[int]
) -> _SpecialRows:
    special = _SpecialRows([], [], [], [], [])
    is_ready = set(ready)
    for i, (req, n) in enumerate(batch):
        if req.prompt_lps is not None and not req.prompt_scored:
            end = min(req.computed + n, len(req.prompt_ids) - 1)  # positions that score
            if end > req.computed:
                start = last[i] - n  # the packed row of the request's first new token
                special.scores.append((req, len(special.rows), end - req.computed, req.computed))
                special.rows.extend(range(start, start + end - req.computed))
        if i not in is_ready:
            continue
        if req.params.max_tokens == 0:
            special.scored_only.append(req)
            continue
        special.ready.append(i)
        special.sample_rows.append(len(special.rows))
        special.rows.append(last[i] - 1)
    return special
