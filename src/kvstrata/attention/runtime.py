"""The attention runtime of a store: where each run of keys is attended, and how.

Per store, decided once at build time:

    local   memory tiers whose raw arenas are attended in place (zero-copy views)
    native  tiers a CPU decode step reads in place through one native call
            (raw arenas and int8 / fp8 / int4 host blocks)
    staged  the rest (disk blocks, lossy blocks of other codecs, host RAM across
            PCIe): copied / decoded a chunk at a time through the Stager's two
            fixed buffers, the next chunk (or the next layer's first) prefetched

Per step (flashinfer's plan / run split): at a sequence's first layer of a group,
`_read_plan` decides once which runs are read how (zero-copy views, staged chunks,
the native kernel's descriptors as one `LayerDescs` array) and every other layer of
the group reuses it — a layer only offsets the descriptors' pointers and slices its
arena views. Per sequence and layer, `attend` combines the partials (merged with
log-sum-exp) with this step's new keys. Transformers-free: the HF adapter passes
queries and new K/V in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstrata.attention.math import masked_attention, merge_all, merge_sink, pack_gqa, unpack_gqa
from kvstrata.attention.native import (
    NATIVE_MAX_DIM,
    NATIVE_MAX_ROWS,
    LayerDescs,
    encoded_field,
    native_attention_batch,
    native_attention_desc,
    raw_field,
)
from kvstrata.attention.partials import partial_attention
from kvstrata.attention.staging import Stager
from kvstrata.blocks.manager import Run
from kvstrata.core.errors import TierIOError, UnsupportedModelError
from kvstrata.platform import native as _native
from kvstrata.tiers.memory import MemoryTier

if TYPE_CHECKING:
    from kvstrata.store.kvstore import KVStore

SMALL_PART_TOKENS = 2048


@dataclass
class ReadPlan:
    """How one step reads keys [start, end) of one sequence in one layer group.

    pieces: (staged, run, lo, hi) of the runs read as torch parts (arena views, or
    staged chunks when `staged`), in order; native: descriptors of the runs the native
    decode kernel reads in place; runs: the table's runs it was built from."""

    runs: list[Run]
    pieces: list[tuple[bool, Run, int, int]]
    native: LayerDescs | None
    has_staged: bool = False


@dataclass
class RowMask:
    """Padding of one batch row: keys before `first_valid` are padding; `dense` is
    the full boolean key mask when padding is not a prefix."""

    first_valid: int
    dense: torch.Tensor | None


class AttentionRuntime:
    """Attention over a store's tiers (see the module docstring)."""

    # Decode on the CPU through kvstrata/platform/csrc/attention.cpp when it is available
    # (set False on the class, or on an instance before build, to use torch partials).
    native_attention = True

    def __init__(self, store: KVStore, native: bool | None = None) -> None:
        self.store = store
        mgr = store.manager
        assert mgr is not None and store.layout is not None
        self.manager = mgr
        self.layout = layout = store.layout
        cc = store.config
        self.device = store.device
        tiers = [mgr.tiers[n] for n in mgr.tier_order]
        self.tiers = mgr.tiers
        self.device_name = tiers[0].name
        self.step_tokens: dict[int, int] = {}  # new tokens per sequence this step
        self._plans: dict[tuple, Any] = {}  # this step's read plans and cold runs
        self._lone: bool | None = None  # one sequence in the store (this step)
        # the last read plan of each (group, sequence, native), with its step number and
        # bounds: the next step patches it when only the sequence's last run grew
        self._last: dict[tuple, tuple[int, int, int, ReadPlan]] = {}
        self._step_no = 0
        self.batched_decodes = 0  # (sequence, layer) decodes attended by `decode_batch`
        # tiers whose raw arenas take token writes and zero-copy views directly
        self.arena_tiers = {t.name for t in tiers if isinstance(t, MemoryTier) and t.zero_copy}
        self.local = {
            t.name
            for t in tiers
            if isinstance(t, MemoryTier)
            and t.zero_copy
            and (
                t.device == self.device
                or cc.cold_attention == "local"
                or (cc.cold_attention == "auto" and self.device.type == "cpu")
            )
        }
        if cc.cold_attention == "stage":
            self.local = {self.device_name}
        # Decode steps on the CPU: one native call over every run readable in place,
        # quantized host blocks included (they are then never staged in decode).
        self.native: set[str] = set()
        use_native = self.native_attention if native is None else native
        if (
            use_native
            and self.device.type == "cpu"
            and max(layout.head_dim, layout.dim_v) <= NATIVE_MAX_DIM
            and _native.available()
        ):
            self.native = {t.name for t in tiers if t.name in self.local and t.device.type == "cpu"}
            if cc.cold_attention != "stage":
                self.native |= {
                    t.name
                    for t in tiers
                    if isinstance(t, MemoryTier)
                    and t.device.type == "cpu"
                    and not t.zero_copy
                    and t.codec.attend_format("k", layout) is not None
                    and t.codec.attend_format("v", layout) is not None
                }
        staged = any(t.name not in self.local for t in tiers)
        bs = cc.block_size
        self.stager = (
            # two buffers of at most the whole cache each: more could never be filled
            Stager(
                self.tiers,
                layout,
                self.device,
                min(cc.staging_tokens, 2 * -(-cc.max_tokens // bs) * bs),
                self.device_name,
            )
            if staged
            else None
        )

    @property
    def staging_bytes(self) -> int:
        return self.stager.nbytes if self.stager else 0

    def transfer_stats(self) -> dict[str, Any] | None:
        return self.stager.engine.stats.as_dict() if self.stager else None

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()

    # -- the step's read plans ------------------------------------------------------------
    def begin_step(self, num_new: dict[int, int]) -> None:
        """A forward step of `num_new[seq_id]` tokens per sequence starts (the store has
        placed them): read plans are built afresh, once, at each sequence's first layer."""
        self.step_tokens = num_new
        self._plans.clear()
        self._lone = None
        self._step_no += 1
        # sequences that left: forget them (each keeps at most 2 plans per group)
        if len(self._last) > 4 * len(self.store.groups) * max(1, len(num_new)):
            self._last = {k: v for k, v in self._last.items() if k[1] in num_new}

    def _read_plan(self, group: int, seq_id: int, start: int, end: int, native: bool) -> ReadPlan:
        """What reading keys [start, end) of a sequence in a layer group takes, built
        at the step's first layer of the group and reused by the others."""
        runs = self.manager.runs((seq_id, group))
        key = (group, seq_id, start, end, native)
        plan = self._plans.get(key)
        if plan is not None and plan.runs is runs:
            return plan
        plan = self._grown_plan(group, seq_id, start, end, native, runs)
        if plan is None:
            plan = self._build_plan(group, start, end, native, runs)
        self._plans[key] = plan
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
        prev.native.set_tokens(
            prev.native.num_parts - 1, min(end, tail.token_start + tail.num_tokens) - lo
        )
        return ReadPlan(runs, prev.pieces, prev.native, prev.has_staged)

    def _build_plan(
        self, group: int, start: int, end: int, native: bool, runs: list[Run]
    ) -> ReadPlan:
        layers = len(self.store.groups[group].layers)
        pieces: list[tuple[bool, Run, int, int]] = []
        first: list[tuple] = []
        second: list[tuple] = []
        for run in runs:
            lo = max(start, run.token_start)
            hi = min(end, run.token_start + run.num_tokens)
            if lo >= hi:
                continue
            if native and run.tier in self.native:
                first.append(self._native_part(0, run, lo, hi))
                if layers > 1:
                    second.append(self._native_part(1, run, lo, hi))
            else:
                pieces.append((run.tier not in self.local, run, lo, hi))
        descs = LayerDescs(first, second if layers > 1 else None, layers) if first else None
        has_staged = any(staged for staged, *_ in pieces)
        return ReadPlan(runs, pieces, descs, has_staged)

    def _parts(self, layer: int, plan: ReadPlan, seq_id: int):
        """(k, v) parts of a read plan's non-native pieces for model layer `layer`, in
        order.

        Where the data may be attended in place, parts are zero-copy views of the
        arenas, and consecutive small ones (< SMALL_PART_TOKENS together, e.g. the
        sink block and the two halves of the device ring) are joined into one copy:
        a partial costs a kernel launch, thread synchronisation and a merge, more
        than copying a few blocks. Cold runs come through the stager's buffers; such
        a view is valid only until the generator resumes (the buffer is reused)."""
        _group, local = self.store.layer_map[layer]
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        pending_tokens = 0

        def flush():
            if len(pending) == 1:
                return pending[0]
            return (
                torch.cat([k for k, _ in pending], dim=1),
                torch.cat([v for _, v in pending], dim=1),
            )

        then = self._next_layer_chunk(layer, seq_id) if plan.has_staged else None
        for staged, run, lo, hi in plan.pieces:
            if staged:
                if pending:
                    yield flush()
                    pending, pending_tokens = [], 0
                last = then is not None and then[1:3] == (run.tier, run.first_slot)
                yield from self.stager.parts(local, run, lo, hi, then if last else None)
                continue
            k, v = self.tiers[run.tier].layer_view(local, run.first_slot, run.num_slots)
            off = run.token_start
            k, v = k[:, lo - off : hi - off], v[:, lo - off : hi - off]
            n = hi - lo
            if pending and (
                pending_tokens + n > SMALL_PART_TOKENS or k.device != pending[0][0].device
            ):
                yield flush()
                pending, pending_tokens = [], 0
            if n >= SMALL_PART_TOKENS:
                yield k, v
            else:
                pending.append((k, v))
                pending_tokens += n
        if pending:
            yield flush()

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

    def _cold_history(self, seq_id: int, group: int) -> list[tuple[Run, int]]:
        """Cold runs holding history (tokens before this step) as (run, end token);
        this step's blocks may not be written for later layers yet. Runs the native
        decode attention reads in place are not cold. Once per step and group."""
        key = ("cold", group, seq_id)
        cold = self._plans.get(key)
        if cold is None:
            past = self.store.num_tokens(seq_id) - self.step_tokens.get(seq_id, 0)
            cold = self._plans[key] = [
                (r, min(past, r.token_start + r.num_tokens))
                for r in self.manager.runs((seq_id, group))
                if r.tier not in self.local and r.tier not in self.native and r.token_start < past
            ]
        return cold

    def _first_chunk(self, local: int, run: Run, end: int) -> tuple:
        first, count, _ = self.stager.chunks(run, run.token_start, end)[0]
        return (local, run.tier, first, count)

    def _next_layer_chunk(self, layer: int, seq_id: int) -> tuple | None:
        """The first cold chunk layer + 1 will read for a lone sequence with one cold
        run: loading it can start as soon as this layer's last cold chunk is in (its
        buffer is free then), overlapping this layer's attention."""
        store = self.store
        if self.stager is None or layer + 1 >= len(store.layer_map):
            return None
        if self._lone is None:
            self._lone = len(store.sequence_ids) == 1
        if not self._lone:
            return None
        group, local = store.layer_map[layer + 1]
        cold = self._cold_history(seq_id, group)
        return self._first_chunk(local, *cold[0]) if len(cold) == 1 else None

    def prefetch_next_layer(self, layer: int, seq_ids: list[int]) -> None:
        """After layer `layer`'s attention: start loading the first cold chunk that
        layer + 1 will need (a no-op when `_next_layer_chunk` already started it)."""
        if self.stager is None or layer + 1 >= len(self.store.layer_map):
            return
        group, local = self.store.layer_map[layer + 1]
        for seq_id in sorted(seq_ids):
            cold = self._cold_history(seq_id, group)
            if cold:
                self.stager.prefetch(self._first_chunk(local, *cold[0]))
                return

    # -- attention ------------------------------------------------------------------------
    def _history_partials(
        self,
        layer: int,
        seq_id: int,
        qp: torch.Tensor,
        start: int,
        end: int,
        scale: float,
        softcap: float | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Partials (out, lse) of packed queries qp over keys [start, end), which every
        query sees: one native call for the runs readable in place (CPU, few query
        rows), one torch partial per other part (staged chunks, device arenas)."""
        native = bool(self.native) and qp.shape[1] <= NATIVE_MAX_ROWS
        group, local = self.store.layer_map[layer]
        plan = self._read_plan(group, seq_id, start, end, native)
        parts = [
            _partial_where_kv_lives(qp, k, v, scale, softcap)
            for k, v in self._parts(layer, plan, seq_id)
        ]
        if plan.native is not None:
            descs = plan.native
            parts.append(
                native_attention_desc(
                    qp, descs.at(local), descs.num_parts, self.layout.dim_v, scale, softcap
                )
            )
        return parts

    def _group_of(self, layer: int, sliding_window: int | None):
        """The layer group of model layer `layer`, checked against the model's window."""
        group = self.store.groups[self.store.layer_map[layer][0]]
        if group.window is not None and sliding_window != group.window:
            raise UnsupportedModelError(
                f"layer {layer}: the model attends with sliding_window={sliding_window} but "
                f"its config gives window {group.window}; the cache drops keys outside "
                f"the configured window, so they must agree"
            )
        return group

    def decode_batch(
        self,
        layer: int,
        seq_ids: list[int],
        q: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Decode attention of several sequences (one new token each, already stored)
        in one native call, q [S, Hq, D] in `seq_ids` order.

        Only sequences whose keys the native kernel reads entirely in place take part
        (no staged or device-arena piece): returns (the indices into `seq_ids` done,
        their outputs [len(done), Hq, Dv]); the caller attends the others one by one
        (`attend`). The descriptor addresses are gathered once per step and group."""
        self._group_of(layer, sliding_window)  # the window check
        num, hq, _ = q.shape
        hkv = self.layout.num_kv_heads
        rows = hq // hkv
        if not self.native or rows > NATIVE_MAX_ROWS or num < 2:
            return [], None
        gi, local = self.store.layer_map[layer]
        # once per step and group: the runs are fixed once the step's tokens are placed
        # (layer 0), and begin_step clears the plans
        key = ("batch", gi, tuple(seq_ids))
        batch = self._plans.get(key)
        if batch is None:
            done, descs, strides, nparts = [], [], [], []
            for i, sid in enumerate(seq_ids):
                total = self.store.num_tokens(sid)
                if self.step_tokens.get(sid) != 1:
                    continue
                start = total - sliding_window if sliding_window and sliding_window < total else 0
                plan = self._read_plan(gi, sid, start, total, native=True)
                if plan.pieces or plan.native is None:
                    continue
                done.append(i)
                descs.append(plan.native.at(0))
                strides.append(plan.native.at(1) - plan.native.at(0))
                nparts.append(plan.native.num_parts)
            batch = self._plans[key] = (
                done,
                np.array(descs, dtype=np.uint64),
                np.array(strides, dtype=np.uint64),
                np.array(nparts, dtype=np.intc),
            )
        done, base, stride, nparts = batch
        if len(done) < 2:
            return [], None
        qd = q[done] if len(done) < num else q
        out, lse = native_attention_batch(
            qd.reshape(len(done), hkv, rows, -1),
            base + stride * np.uint64(local),
            nparts,
            self.layout.dim_v,
            scale,
            softcap,
        )
        self.batched_decodes += len(done)
        out = out.reshape(len(done), hq, -1)
        if sinks is not None:
            merged = merge_sink((out.transpose(0, 1), lse.reshape(len(done), hq).T), sinks)
            out = merged.transpose(0, 1)
        return done, out

    def attend(self, layer: int, seq_id: int, *args: Any) -> torch.Tensor:
        """`_attend`; a block that cannot be read raises its TierIOError with `seq_ids`
        naming this sequence (the caller recomputes its owner only)."""
        try:
            return self._attend(layer, seq_id, *args)
        except TierIOError as err:
            err.seq_ids = err.seq_ids | {seq_id}
            raise

    def _attend(
        self,
        layer: int,
        seq_id: int,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        scale: float,
        row_mask: RowMask | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of one sequence's queries q [Hq, Q, D] over its cached keys in
        model layer `layer`.

        Returns [Hq, Q, Dv]."""
        group = self._group_of(layer, sliding_window)
        num_q, total = q.shape[1], self.store.num_tokens(seq_id)
        past = total - num_q
        hkv, hq = self.layout.num_kv_heads, q.shape[0]
        first_valid = row_mask.first_valid if row_mask else 0
        window = sliding_window if sliding_window and sliding_window < total else None
        dense = row_mask.dense if row_mask else None
        acc = None
        if num_q == 1 and dense is None:
            start = first_valid if window is None else max(first_valid, total - window)
            parts = self._history_partials(
                layer, seq_id, pack_gqa(q, hkv), start, total, scale, softcap
            )
            acc = merge_all(parts) if parts else None
        elif dense is None and window is None and first_valid <= past:
            qp = pack_gqa(q, hkv)
            parts = self._history_partials(layer, seq_id, qp, first_valid, past, scale, softcap)
            parts.append(_causal_new(q, new_k, new_v, scale, softcap, hkv))
            acc = merge_all(parts)
        else:
            start = 0 if dense is not None else first_valid
            if window is not None:
                start = max(start, past - window + 1)
            # a sliding group holds keys from its first live block on (older ones are
            # outside every window still to come, so the mask would exclude them anyway)
            runs = self.manager.runs((seq_id, group.index))
            start = min(max(start, runs[0].token_start if runs else 0), past)
            # clone: staged views are only valid until the generator moves on
            plan = self._read_plan(group.index, seq_id, start, past, native=False)
            parts = [(k.clone(), v.clone()) for k, v in self._parts(layer, plan, seq_id)]
            keys = torch.cat([k for k, _ in parts] + [new_k], dim=1)
            values = torch.cat([v for _, v in parts] + [new_v], dim=1)
            kpos = torch.arange(start, total, device=q.device)
            qpos = torch.arange(past, total, device=q.device)
            allowed = kpos[None, :] <= qpos[:, None]
            if window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - sliding_window
            if dense is not None:
                allowed &= dense[start:total].to(q.device)[None, :]
            allowed &= kpos[None, :] >= first_valid
            out, lse = masked_attention(q, keys, values, scale, allowed, softcap)
            acc = (out.reshape(hkv, -1, out.shape[-1]), lse.reshape(hkv, -1))
        if acc is None:  # no visible key at all (a padding query)
            return q.new_zeros((hq, num_q, self.layout.dim_v))
        if sinks is not None:
            return merge_sink((unpack_gqa(acc[0], hq), acc[1].reshape(hq, num_q)), sinks)
        return unpack_gqa(acc[0], hq)


def _partial_where_kv_lives(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention computed on the device that holds k/v: host blocks attended
    in place on the CPU (FlexGen's "CPU attention"), only q and the partial result
    ([Hkv, R*Q, D] + LSE, tiny in decode) cross the link."""
    if k.device == q.device:
        return partial_attention(q, k, v, scale, softcap)
    out, lse = partial_attention(q.to(k.device), k, v, scale, softcap)
    return out.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True)


def _causal_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this step's queries over this step's keys (square),
    returned packed ([Hkv, R*Q, Dv], [Hkv, R*Q]). On the CPU and CUDA an LSE-returning
    fused kernel (memory linear in Q: the math path's [Hq, Q, Q] scores would take
    16 GiB at a 32k-token prompt); soft-capping and Dv != D take the math path."""
    hq, nq, _ = q.shape
    r = hq // num_kv_heads
    out = None
    if softcap is None and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        kx = k.repeat_interleave(r, dim=0) if r > 1 else k
        vx = v.repeat_interleave(r, dim=0) if r > 1 else v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], kx[None], vx[None], 0.0, True, scale=scale
        )
        out, lse = out[0], lse[0]
    elif softcap is None and q.is_cuda and k.shape[-1] == v.shape[-1]:
        kx = k.repeat_interleave(r, dim=0) if r > 1 else k
        vx = v.repeat_interleave(r, dim=0) if r > 1 else v
        try:  # compute_log_sumexp=True, dropout 0, is_causal=True
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q[None], kx[None], vx[None], None, True, 0.0, True, scale=scale
            )[:2]
            out, lse = out[0], lse[0, :, :nq]  # its LSE is padded to a multiple of 32
        except RuntimeError as err:  # e.g. a head dim it does not support
            import warnings

            why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            warnings.warn(
                f"kvstrata: memory-efficient causal attention failed ({why}); using the "
                f"math path ([Hq, Q, Q] fp32 scores: {hq * nq * nq * 4:,} bytes)",
                RuntimeWarning,
                stacklevel=2,
            )
            out = None
    if out is None:
        allowed = torch.ones(nq, nq, dtype=torch.bool, device=q.device).tril()
        out, lse = masked_attention(q, k, v, scale, allowed, softcap)
    return out.reshape(num_kv_heads, r * nq, -1), lse.reshape(num_kv_heads, r * nq)


def write_plan(runtime: AttentionRuntime, writes: list, batch: int) -> list[tuple]:
    """Turn one group's token writes into what every layer of this step does, once
    per step: ("slice", tier, first, count) for a contiguous single-sequence write,
    ("rows", tier, rows, src) for scattered rows of an arena tier, ("blocks", tier,
    slots, src) for whole new blocks of an encoded tier."""
    plan: list[tuple] = []
    bs = runtime.layout.block_size
    for tw in writes:
        tier = runtime.tiers[tw.tier]
        src = tw.src.to(runtime.device)
        if tw.tier not in runtime.arena_tiers:
            plan.append(("blocks", tier, (tw.rows[::bs] // bs).tolist(), src))
        elif tw.contiguous is not None and batch == 1:
            plan.append(("slice", tier, *tw.contiguous))
        else:
            plan.append(("rows", tier, tw.rows.to(tier.device), src))
    return plan


def write_layer(plan: list[tuple], local: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store one layer's new K/V ([B, Hkv, T, D]) as the step's write plan says."""
    batch, heads, num_new, _ = k.shape
    flat_k = flat_v = None
    for kind, tier, a, b in plan:
        if kind == "slice":
            tier.k_arena[local, :, a : a + b].copy_(k[0, :, :b])
            tier.v_arena[local, :, a : a + b].copy_(v[0, :, :b])
            continue
        if flat_k is None:
            flat_k = k.transpose(0, 1).reshape(heads, batch * num_new, -1)
            flat_v = v.transpose(0, 1).reshape(heads, batch * num_new, -1)
        new_k, new_v = flat_k.index_select(1, b), flat_v.index_select(1, b)
        if kind == "rows":
            tier.k_arena[local].index_copy_(1, a, new_k.to(tier.device))
            tier.v_arena[local].index_copy_(1, a, new_v.to(tier.device))
        else:
            tier.write_layer(local, a, new_k, new_v)
