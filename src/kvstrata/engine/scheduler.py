"""Which requests run in the next step, and how many tokens each brings.

Runs in the engine thread (it owns the store). Policy, per step:

1. Running requests, oldest first, keep their place while their KV fits the device
   budget (`preemption="demote"`) — with the lower tiers the step's attention reads
   in place at the device's speed (`Capacity.in_place_blocks`: host RAM when the CPU
   computes), whose blocks are as good as resident — and their floors fit the
   device; a newer one that no longer fits is preempted:
   its full blocks are demoted to host / disk by `KVStore.demote` — nothing is
   recomputed or dropped — and it waits, first in line, to resume where it stopped.
   The oldest always runs (if it alone outgrows the device, placement spills its
   oldest blocks down, as for any sequence).
2. Every running decode brings its one token; prompts being prefilled take chunks
   of what is left of `max_batched_tokens`, oldest first.
3. Preempted requests resume, then waiting ones start (their cached prefix is
   attached from the store), while there is room: `max_num_seqs`, the step's token
   budget, the device budget (with `preemption="off"`, the floor each running
   sequence pins there: sinks, open block, residual window above a lossy tier), and
   — for a new request — all tiers together, where each admitted request reserves
   the blocks of its prompt + max_tokens, so a running request never runs out of
   blocks.
4. A step the store still cannot place (OutOfBlocksError) is undone, the newest
   running request is preempted and fewer run at once until one finishes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from kvstrata.core.errors import KvstrataError
from kvstrata.engine.params import SamplingParams, TokenLogprobs
from kvstrata.engine.sampling import LogitsAdjuster, TextOutput, make_generator
from kvstrata.store.contract import EngineStore

log = logging.getLogger("kvstrata.engine")
MAX_RECOMPUTES = 2  # storage errors one request survives before it is ended

if TYPE_CHECKING:
    from kvstrata.engine.metrics import EngineMetrics
    from kvstrata.engine.params import EngineConfig


class Request:
    """One request's state in the engine."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Any,
        salt: str,
        tokenizer: Any = None,
        eos_ids: Any = (),
    ) -> None:
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.on_output = on_output
        self.salt = salt
        self.arrival = time.perf_counter()
        self.seq_id: int | None = None
        self.cached = 0  # prompt tokens found in the prefix cache
        self.computed = 0  # tokens in the store
        self.out_ids: list[int] = []
        self.sent_ids = 0
        self.text = TextOutput(tokenizer, params.stop, prompt_ids)
        self.emit_tokens = tokenizer is None  # no text: every token is news
        self.generator = make_generator(params)
        # None unless the request asks for them (the plain path checks only these)
        stop_ids = [*params.stop_token_ids, *(() if params.ignore_eos else eos_ids)]
        self.adjuster = (
            LogitsAdjuster(params, prompt_ids, stop_ids) if params.adjusts_logits else None
        )
        self.out_logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # prompt_lps[i]: logprobs of prompt token i given the ones before (filled as the
        # prompt's chunks are computed); None unless asked for
        self.prompt_lps: list[TokenLogprobs | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None
        )
        self.prompt_lps_sent = False
        # every prompt position is scored (the whole prompt was computed once): a
        # recomputed request may then reuse cached blocks and scores nothing again
        self.prompt_scored = False
        self.first_output = False  # an output at the first token, text or not (submit)
        # the engine's slow path of a step: this request needs more than one logits row
        # and a sampled token (prompt logprobs, or max_tokens 0)
        self.special = params.prompt_logprobs is not None or params.max_tokens == 0
        self.reserve = 0  # blocks reserved in all tiers together
        self.recomputes = 0  # times its KV was dropped after a storage error
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        # a prompt with documents: (their token spans, the share recomputed), until
        # its blend ran (or was given up)
        self.blend: tuple[list[tuple[int, int]], float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    @property
    def remaining(self) -> int:
        """Known tokens not in the store yet (1 for a decode)."""
        return self.num_tokens - self.computed

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt + output (no copy of either whole)."""
        n = len(self.prompt_ids)
        head = self.prompt_ids[start : start + count] if start < n else []
        return head + self.out_ids[max(0, start - n) : max(0, start + count - n)]

    def take_new_ids(self) -> list[int]:
        new = self.out_ids[self.sent_ids :]
        self.sent_ids = len(self.out_ids)
        return new

    def take_new(self) -> tuple[list[int], list[TokenLogprobs] | None]:
        """The output tokens not sent yet, and their logprobs (None: not asked for)."""
        start = self.sent_ids
        new = self.take_new_ids()
        if self.out_logprobs is None:
            return new, None
        return new, self.out_logprobs[start : start + len(new)]


class Scheduler:
    """The engine's queues and the step plan (see the module docstring)."""

    def __init__(self, store: EngineStore, config: EngineConfig, metrics: EngineMetrics) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        capacity = store.capacity()
        self.block_size = capacity.block_size
        self.block_bytes = capacity.block_bytes
        self.capacity_blocks = capacity.total_blocks
        # what every running sequence pins on the device: sinks, the residual window
        # above a lossy tier, the open block and one more while a step crosses a block
        self.floor_blocks = capacity.floor_blocks
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.reserved = 0
        self.failed: list[tuple[Request, str]] = []  # requests that could not start
        self.cap = config.max_num_seqs  # lowered after a step ran out of blocks
        self.peak_running = 0

    def take_failed(self) -> list[tuple[Request, str]]:
        failed, self.failed = self.failed, []
        return failed

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks (all layer groups) one sequence of `num_tokens` tokens holds."""
        return self.store.blocks_held(num_tokens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def add(self, req: Request) -> bool:
        """Queue a request; False when its id is taken (the engine ends it)."""
        if req.id in self.requests:
            return False
        self.requests[req.id] = req
        self.waiting.append(req)
        return True

    def remove(self, req: Request) -> None:
        """Forget a finished or aborted request; its blocks are freed now (hashed
        ones stay in the prefix cache)."""
        if self.requests.pop(req.id, None) is None:
            return
        for queue in (self.running, self.preempted):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.seq_id is not None and self.store.has_sequence(req.seq_id):
            self.store.free(req.seq_id)
        if req.seq_id is not None:
            self.cap = min(self.cap + 1, self.config.max_num_seqs)
        req.seq_id = None
        self.reserved -= req.reserve
        req.reserve = 0

    # -- the step plan ------------------------------------------------------------------------
    def device_need(self, req: Request, num_tokens: int) -> int:
        """Device slots a running request takes: all its blocks (`demote`: its KV is
        kept resident), at least the floor every running sequence pins there."""
        if self.config.preemption == "demote":
            return max(self.blocks_for(num_tokens), self.floor_blocks)
        return self.floor_blocks

    def plan_step(self) -> list[tuple[Request, int]]:
        cfg = self.config
        demote = cfg.preemption == "demote"
        room, seats, _ = self._room()
        chunk = cfg.max_batched_tokens
        used = 0
        keep: list[Request] = []
        for req in self.running:
            need = self.device_need(req, req.computed + min(req.remaining, chunk))
            if demote and keep and (used + need > room or len(keep) >= seats):
                self._preempt(req)
                continue
            used += need
            keep.append(req)
        self.running = keep
        batch: list[tuple[Request, int]] = [(r, 1) for r in keep if r.remaining == 1]
        left = chunk - len(batch)
        for req in keep:
            if req.remaining > 1 and left > 0:
                n = min(req.remaining, left)
                batch.append((req, n))
                left -= n
        while len(self.running) < min(cfg.max_num_seqs, self.cap) and left > 0:
            req = self._admit(used, left, *self._room())  # after this step's preemptions
            if req is None:
                break
            n = min(req.remaining, left)
            used += self.device_need(req, req.computed + n)
            batch.append((req, n))
            left -= n
        return batch

    def _room(self) -> tuple[int, int, bool]:
        """(blocks the running requests may hold where a step reads them in place, how
        many may run with their floors on the device — both after the preempted ones —
        and whether there are in-place tiers below the device)."""
        cap = self.store.capacity()
        in_place = cap.in_place_blocks > 0
        room = cap.device_blocks + cap.in_place_blocks
        room -= sum(self._held(r, in_place) for r in self.preempted)
        return room, cap.device_blocks // max(1, self.floor_blocks) - len(self.preempted), in_place

    def _held(self, req: Request, in_place: bool) -> int:
        """What a preempted request still takes from the running ones' room: its floor
        (sinks, open block) on the device, and its demoted blocks where in-place tiers
        take them first."""
        if in_place:
            return max(self.blocks_for(req.computed), self.floor_blocks)
        return self.floor_blocks

    def _admit(self, used: int, left: int, room: int, seats: int, in_place: bool) -> Request | None:
        """Resume the oldest preempted request, else start the oldest waiting one, if
        it fits; None when nothing can start this step."""
        full = len(self.running) >= seats
        if self.preempted:
            req = self.preempted[0]
            need = self.device_need(req, req.computed + min(req.remaining, left))
            # its own share of what the preempted hold comes back as it resumes
            room += self._held(req, in_place)
            if self.running and (used + need > room or len(self.running) > seats):
                return None
            self.preempted.pop(0)
            self.metrics.resumed.inc()
        elif self.waiting:
            req = self.waiting[0]
            if self._shares_a_prefill(req):
                return None  # it starts once those blocks are computed, and reuses them
            reserve = self.blocks_for(len(req.prompt_ids) + req.params.max_tokens)
            if self.reserved + reserve > self.capacity_blocks and self.requests_admitted():
                return None  # all tiers are promised to the requests running now
            need = self.device_need(req, min(len(req.prompt_ids), left))
            if self.running and (used + need > room or full):
                return None
            self.waiting.popleft()
            known = req.prompt_ids + req.out_ids if req.out_ids else req.prompt_ids
            # Prompt logprobs need the logits of every prompt position, and a cached
            # prefix has none: such a request computes its whole prompt (no lookup; its
            # blocks are still hashed, so later requests reuse them). One recomputed
            # after its prompt was scored (prompt_lps complete, sent at most once and
            # never again) needs no logits from it: it looks its prefix up like any.
            lookup = req.prompt_lps is None or req.prompt_scored
            try:
                req.seq_id, matched = self.store.add_sequence(known, salt=req.salt, lookup=lookup)
            except KvstrataError as err:
                self.failed.append((req, f"could not start: {err}"))
                return None
            if not req.recomputes:
                req.cached = matched
            req.computed = matched
            req.reserve = reserve
            self.reserved += reserve
        else:
            return None
        self.running.append(req)
        self.running.sort(key=lambda r: r.arrival)  # oldest first: preempted last
        self.peak_running = max(self.peak_running, len(self.running))
        return req

    def _shares_a_prefill(self, req: Request) -> bool:
        """Whether a running request is prefilling full blocks this one's prompt starts
        with (same tenant salt), not computed yet: this one waits for them instead of
        computing them a second time (e.g. users arriving together with one system
        prompt). Its prefix lookup at admission then finds them."""
        if not self.store.prefix_caching or req.out_ids or req.prompt_lps is not None:
            return False
        bs, mine = self.block_size, req.prompt_ids
        for other in self.running:
            theirs = other.prompt_ids
            if other.salt != req.salt or other.computed >= len(theirs) or theirs[:bs] != mine[:bs]:
                continue
            shared = bs  # full blocks in common (the last token is always computed)
            limit = min(len(theirs), len(mine) - 1) // bs * bs
            while (
                shared + bs <= limit and theirs[shared : shared + bs] == mine[shared : shared + bs]
            ):
                shared += bs
            if other.computed < shared <= len(mine) - 1:
                return True
        return False

    def recompute(self, req: Request) -> bool:
        """A step could not read one of its blocks: drop the request's sequence (its
        verified full blocks stay in the prefix cache; a checked hit never serves a
        bad block) and queue it first, to compute again what is missing from its
        prompt and output so far. False after MAX_RECOMPUTES (the caller ends it)."""
        if req.recomputes >= MAX_RECOMPUTES:
            return False
        req.recomputes += 1
        self.metrics.recomputes.inc()
        if req in self.running:
            self.running.remove(req)
        if req in self.preempted:
            self.preempted.remove(req)
        if req.seq_id is not None and self.store.has_sequence(req.seq_id):
            self.store.free(req.seq_id)
        req.seq_id, req.computed = None, 0
        self.reserved -= req.reserve
        req.reserve = 0
        self.waiting.appendleft(req)
        return True

    def requests_admitted(self) -> bool:
        return bool(self.running or self.preempted)

    def _preempt(self, req: Request) -> None:
        try:
            moved = self.store.demote(req.seq_id)
        except (KvstrataError, OSError) as err:  # e.g. a full disk: blocks stay put
            log.warning("kvstrata engine: demoting %s failed (%s); it waits as is", req.id, err)
            moved = 0
        self.metrics.preemptions.inc()
        self.metrics.demoted_blocks.inc(moved)
        self.preempted.append(req)
        self.preempted.sort(key=lambda r: r.arrival)

    def relieve(self, batch: list[tuple[Request, int]]) -> bool:
        """A step ran out of blocks: preempt the newest running request (False when
        only one runs: nothing to make room with)."""
        if len(self.running) < 2:
            return False
        # fewer at once until a request finishes (else it would resume, and fail, at once)
        self.cap = len(self.running) - 1
        req = max(self.running, key=lambda r: r.arrival)
        self.running.remove(req)
        self._preempt(req)
        return True

    def snapshot(self) -> dict[str, Any]:
        usage = self.store.usage()
        occupancy = usage.occupancy
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preempted": len(self.preempted),
            "live_blocks": sum(o["used_blocks"] - o["cached_blocks"] for o in occupancy.values()),
            "sequences": len(self.store.sequence_ids),
            "peak_running": self.peak_running,
            "reserved_blocks": self.reserved,
            "capacity_blocks": self.capacity_blocks,
            "evicted_cached_blocks": usage.evicted_cached_blocks,
            "store": self.store.stats(),
        }
