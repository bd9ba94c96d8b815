"""The choices of one request (prompts x n), each its own engine request: `Job`, their
fan-out and outputs merged back on the event loop (`Choices`), one choice's response as
its outputs come (`ChoiceState`), and the `usage` they add up to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.core.errors import KvstrataError
from kvstrata.engine.params import RequestOutput, SamplingParams
from kvstrata.server.detokenizer import ChoiceTokens, TokenInfo
from kvstrata.server.responses import usage
from kvstrata.server.validation import Logprobs
from kvstrata.workload.chunks import Chunks


@dataclass
class Job:
    """One choice of a request: choice `index` (prompt_index * n + i), its engine
    request id, prompt and params; `echo_text`: the prompt's text (completions' echo);
    `after`: the choice whose first output it waits for (None: it starts at once)."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    echo_text: str
    after: int | None = None
    chunks: Chunks | None = None  # the prompt with its documents (blended), if any
    blend_recompute: float | None = None


class Choices:
    """The engine requests of one HTTP request, their outputs merged in arrival order as
    `(choice index, RequestOutput)` until all have finished. A choice with `after` is
    submitted on that choice's first output (`first_output`), so it reuses the prompt's
    blocks from the prefix cache; once `stopping()` it ends as aborted instead.
    `abort()` aborts the ones not finished."""

    def __init__(
        self,
        engine: Any,
        jobs: list[Job],
        salt: str | None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.salt = salt
        self.stopping = stopping
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.open: set[str] = set()  # submitted or waiting, not finished
        self.waiting: dict[int, list[Job]] = {}  # choice index -> the jobs after it

    def start(self) -> None:
        for job in self.jobs:
            if job.after is not None:
                self.waiting.setdefault(job.after, []).append(job)
        self._submit([job for job in self.jobs if job.after is None])
        self.open.update(job.request_id for job in self.jobs)

    def _submit(self, jobs: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        try:
            for job in jobs:
                extra: dict[str, Any] = {"first_output": True} if job.index in self.waiting else {}
                if job.chunks is not None:
                    extra["blend_recompute"] = job.blend_recompute
                self.engine.submit(
                    job.prompt_ids if job.chunks is None else job.chunks,
                    job.params,
                    request_id=job.request_id,
                    on_output=self._callback(loop, job.index),
                    salt=self.salt,
                    **extra,
                )
                self.open.add(job.request_id)
        except BaseException:
            self.abort()
            raise

    def _callback(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable:
        def on_output(out: RequestOutput) -> None:  # the engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            except RuntimeError:  # the event loop is gone: nobody is listening
                self.engine.abort(out.request_id)

        return on_output

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.open:
            raise StopAsyncIteration
        index, out = await self.queue.get()
        if out.finished:
            self.open.discard(out.request_id)
        if index in self.waiting and out.finish_reason != "abort":
            later = self.waiting.pop(index)
            if self.stopping():  # never started: they end as aborted (a 503)
                for job in later:
                    ended = RequestOutput(job.request_id, finish_reason="abort")
                    self.queue.put_nowait((job.index, ended))
            else:
                self._submit(later)
        return index, out

    def abort(self) -> None:
        self.waiting.clear()
        for request_id in self.open:  # (one never submitted: the engine ignores it)
            self.engine.abort(request_id)
        self.open.clear()


class ChoiceState:
    """One choice's response as its outputs come: the echoed prompt in front of the
    first piece, the tokens whose logprobs each piece reports (`ChoiceTokens`:
    each token's text and offset in the choice's text), the final output."""

    def __init__(self, job: Job, logprobs: Logprobs, tokens: ChoiceTokens | None = None) -> None:
        self.job = job
        self.echo = logprobs.echo
        self.pieces = tokens  # set when logprobs are asked for
        self.started = False
        self.generated = 0  # characters of generated text so far
        self.text: list[str] = []  # every piece (whole responses)
        self.tokens: list[TokenInfo] = []
        self.held: list[TokenInfo] = []  # generated tokens past the text sent
        self.final: RequestOutput | None = None

    async def take(self, out: RequestOutput) -> tuple[str, list[TokenInfo]]:
        """The text of `out` and its tokens with their logprobs (empty unless asked
        for), the echoed prompt (and its tokens) in front of the first: in a worker
        thread when it places a whole echoed prompt's tokens (a few decodes each)."""
        if not self.started and self.echo and self.pieces is not None:
            return await asyncio.to_thread(self._take, out)
        return self._take(out)

    def _take(self, out: RequestOutput) -> tuple[str, list[TokenInfo]]:
        text, tokens = out.text, []
        self.generated += len(out.text)
        if not self.started:
            self.started = True
            if self.echo:
                text = self.job.echo_text + text
                if self.pieces is not None:
                    prompt = out.prompt_logprobs or [None] * len(self.job.prompt_ids)
                    tokens += self.pieces.prompt(self.job.prompt_ids, prompt, self.job.echo_text)
        if self.pieces is not None:
            # a token goes out once the text sent covers it: the engine holds back text
            # that may still become a stop string, and a stop string cuts it at the end
            self.held += self.pieces.generated(out)
            if out.finished:
                self.pieces.clip(self.held, self.generated)
                sent = len(self.held)
            else:  # up to the first token past the text sent
                end = self.pieces.base + self.generated
                past = (i for i, t in enumerate(self.held) if t.offset + len(t.text) > end)
                sent = next(past, len(self.held))
            tokens += self.held[:sent]
            del self.held[:sent]
        if out.finished:
            self.final = out
        return text, tokens

    def running_usage(self, out: RequestOutput | None) -> dict[str, Any]:
        """This choice's usage so far (continuous_usage_stats; vLLM's numbers: its
        prompt's tokens and the tokens it generated so far)."""
        if out is None:
            return usage(len(self.job.prompt_ids), 0, 0)
        return usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


def usage_of(states: list[ChoiceState], n: int) -> dict[str, Any]:
    """`usage` of finished choices: each prompt once (its first choice's numbers), the
    completion tokens of every choice."""
    finals = [s.final for s in states]
    assert all(f is not None for f in finals)
    firsts = [f for i, f in enumerate(finals) if i % n == 0]
    return usage(
        sum(f.prompt_tokens for f in firsts),
        sum(f.completion_tokens for f in finals),
        sum(f.cached_tokens for f in firsts),
    )


async def collect(outputs: Choices, states: list[ChoiceState]) -> RequestOutput | None:
    """Run every choice to its end, gathering its text and logprobs into `states`;
    the output of a choice the engine aborted (None when all finished)."""
    async for index, out in outputs:
        if out.finish_reason == "abort":
            return out
        state = states[index]
        text, tokens = await state.take(out)
        state.text.append(text)
        state.tokens.extend(tokens)
    if any(s.final is None for s in states):
        raise KvstrataError("the engine ended the request without a final output")
    return None
