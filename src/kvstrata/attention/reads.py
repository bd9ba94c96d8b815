"""Read plans (flashinfer's plan / run split): at a sequence's first layer of a group in
a step, decide once which runs of its keys are read how — zero-copy arena views, staged
chunks, or the native kernel's descriptors as one `LayerDescs` array — and let every
other layer of the group reuse the plan (a layer only offsets the descriptors'
pointers and slices its arena views). A decode step that only grew the sequence's last
run patches last step's plan instead of rebuilding it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from kvstrata.attention.native import LayerDescs, encoded_field, raw_field
from kvstrata.blocks.manager import BlockManager, Run
from kvstrata.core.layout import BlockLayout
from kvstrata.model.groups import LayerGroup


@dataclass
class ReadPlan:
    """How one step reads keys [start, end) of one sequence in one layer group.

    pieces: (staged, run, lo, hi) of the runs read as torch parts (arena views, or
    staged chunks when `staged`), in order; native: descriptors of the runs the native
    decode kernel reads in place, `spans` their keys [lo, hi); runs: the table's runs it
    was built from."""

    runs: list[Run]
    pieces: list[tuple[bool, Run, int, int]]
    native: LayerDescs | None
    has_staged: bool = False
    spans: list[tuple[int, int]] = field(default_factory=list)
    _starts: Any = None  # the spans' first keys as a ctypes int64 array (`starts`)

    def starts(self) -> Any:
        """The spans' first keys, an int64 ctypes array built once per plan (every
        layer's selecting decode passes it)."""
        if self._starts is None:
            self._starts = (ctypes.c_int64 * len(self.spans))(*[lo for lo, _ in self.spans])
        return self._starts


class ReadPlanner:
    """The read plans of one store's steps.

    Args:
        manager: the block manager (runs and lengths of sequences).
        layout: the block layout of every tier.
        groups: the store's layer groups.
        local: tiers whose arenas are attended in place (zero-copy views).
        native: tiers the native decode kernel reads in place.
    """

    def __init__(
        self,
        manager: BlockManager,
        layout: BlockLayout,
        groups: list[LayerGroup],
        local: set[str],
        native: set[str],
    ) -> None:
        self.manager = manager
        self.tiers = manager.state.tiers
        self.layout = layout
        self.groups = groups
        self.local = local
        self.native = native
        self.step_tokens: dict[int, int] = {}  # new tokens per sequence this step
        self.plans: dict[tuple, Any] = {}  # this step's read plans, cold runs, batches
        # the last read plan of each (group, sequence, native), with its step number and
        # bounds: the next step patches it when only the sequence's last run grew
        self._last: dict[tuple, tuple[int, int, int, ReadPlan]] = {}
        self._step_no = 0

    def begin_step(self, num_new: dict[int, int]) -> None:
        """A forward step of `num_new[seq_id]` tokens per sequence starts (the store has
        placed them): read plans are built afresh, once, at each sequence's first layer."""
        self.step_tokens = num_new
        self.plans.clear()
        self._step_no += 1
        # sequences that left: forget them (each keeps at most 2 plans per group)
        if len(self._last) > 4 * len(self.groups) * max(1, len(num_new)):
            self._last = {k: v for k, v in self._last.items() if k[1] in num_new}

    def read_plan(self, group: int, seq_id: int, start: int, end: int, native: bool) -> ReadPlan:
        """What reading keys [start, end) of a sequence in a layer group takes, built
        at the step's first layer of the group and reused by the others."""
        runs = self.manager.runs((seq_id, group))
        key = (group, seq_id, start, end, native)
        plan = self.plans.get(key)
        if plan is not None and plan.runs is runs:
            return plan
        plan = self._grown_plan(group, seq_id, start, end, native, runs)
        if plan is None:
            plan = self._build_plan(group, start, end, native, runs)
        self.plans[key] = plan
        self._last[(group, seq_id, native)] = (self._step_no, start, end, plan)
        return plan

    def _grown_plan(
        self, group: int, seq_id: int, start: int, end: int, native: bool, runs: list[Run]
    ) -> ReadPlan | None:
        """The sequence's plan of an earlier step with its last part's token count
        raised, when that is all that changed (a decode step that stayed in the last
        block's run, read natively): no descriptor is rebuilt. Else None."""
        last = self._last.get((group, seq_id, native))
        if last is None or not runs:
            return None
        step_no, p_start, p_end, prev = last
        old = prev.runs
        if (
            step_no == self._step_no  # patching in place: never a plan of this step
            or p_start != start
            or end < p_end
            or prev.native is None
            or len(old) != len(runs)
        ):
            return None
        tail, o_tail = runs[-1], old[-1]
        if (
            tail.tier not in self.native
            or (tail.tier, tail.first_slot, tail.token_start)
            != (o_tail.tier, o_tail.first_slot, o_tail.token_start)
            or old[-2::-1] != runs[-2::-1]
            or (len(old) > 1 and old[-2].token_start + old[-2].num_tokens > p_end)
        ):
            return None
        lo = max(start, tail.token_start)
        if lo >= min(p_end, o_tail.token_start + o_tail.num_tokens):
            return None  # the tail had no part last step
        hi = min(end, tail.token_start + tail.num_tokens)
        prev.native.set_tokens(prev.native.num_parts - 1, hi - lo)
        spans = [*prev.spans[:-1], (lo, hi)]
        return ReadPlan(runs, prev.pieces, prev.native, prev.has_staged, spans)

    def _build_plan(
        self, group: int, start: int, end: int, native: bool, runs: list[Run]
    ) -> ReadPlan:
        layers = len(self.groups[group].layers)
        pieces: list[tuple[bool, Run, int, int]] = []
        spans: list[tuple[int, int]] = []
        first: list[tuple] = []
        second: list[tuple] = []
        for run in runs:
            lo = max(start, run.token_start)
            hi = min(end, run.token_start + run.num_tokens)
            if lo >= hi:
                continue
            if native and run.tier in self.native:
                spans.append((lo, hi))
                first.append(self._native_part(0, run, lo, hi))
                if layers > 1:
                    second.append(self._native_part(1, run, lo, hi))
            else:
                pieces.append((run.tier not in self.local, run, lo, hi))
        descs = LayerDescs(first, second if layers > 1 else None, layers) if first else None
        has_staged = any(staged for staged, *_ in pieces)
        return ReadPlan(runs, pieces, descs, has_staged, spans)

    def _native_part(self, local: int, run: Run, lo: int, hi: int) -> tuple:
        """(tokens, K descriptor, V descriptor) of tokens [lo, hi) of a run, in place."""
        tier = self.tiers[run.tier]
        off = run.token_start
        if tier.zero_copy:
            k, v = tier.layer_view(local, run.first_slot, run.num_slots)
            a, b = lo - off, hi - off
            return hi - lo, raw_field(k[:, a:b]), raw_field(v[:, a:b])
        row0 = run.first_slot * self.layout.block_size + lo - off
        a = tier.arenas
        fields = [
            encoded_field(
                tier.codec.attend_format(kind, self.layout),
                a[f"{kind}.data"][local],
                a[f"{kind}.scale"][local],
                a[f"{kind}.zero"][local] if f"{kind}.zero" in a else None,
                row0,
            )
            for kind in ("k", "v")
        ]
        return hi - lo, *fields

    def cold_history(self, seq_id: int, group: int) -> list[tuple[Run, int]]:
        """Cold runs holding history (tokens before this step) as (run, end token);
        this step's blocks may not be written for later layers yet. Runs the native
        decode attention reads in place are not cold. Once per step and group."""
        key = ("cold", group, seq_id)
        cold = self.plans.get(key)
        if cold is None:
            past = self.manager.num_tokens((seq_id, 0)) - self.step_tokens.get(seq_id, 0)
            cold = self.plans[key] = [
                (r, min(past, r.token_start + r.num_tokens))
                for r in self.manager.runs((seq_id, group))
                if r.tier not in self.local and r.tier not in self.native and r.token_start < past
            ]
        return cold
