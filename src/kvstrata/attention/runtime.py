"""The attention runtime of a store: where each run of keys is attended, and how.

Per store, decided once at build time:

    local   memory tiers whose raw arenas are attended in place (zero-copy views)
    native  tiers a CPU decode step reads in place through one native call
            (raw arenas and int8 / fp8 / int4 host blocks)
    staged  the rest (disk blocks, lossy blocks of other codecs, host RAM across
            PCIe): copied / decoded a chunk at a time through the Stager's two
            fixed buffers, the next chunk (or the next layer's first) prefetched

Per step (flashinfer's plan / run split): at a sequence's first layer of a group, the
`ReadPlanner` (attention.reads) decides once which runs are read how (zero-copy views,
staged chunks, the native kernel's descriptors as one `LayerDescs` array) and every
other layer of the group reuses it — a layer only offsets the descriptors' pointers and slices its
arena views. Per sequence and layer, `attend` combines the partials (merged with
log-sum-exp) with this step's new keys. Transformers-free: the HF adapter passes
queries and new K/V in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstrata.attention.math import masked_attention, merge_all, merge_sink, pack_gqa, unpack_gqa
from kvstrata.attention.native import (
    NATIVE_MAX_DIM,
    NATIVE_MAX_ROWS,
    native_attention_batch,
    native_attention_desc,
)
from kvstrata.attention.partials import causal_new, partial_where_kv_lives
from kvstrata.attention.reads import ReadPlan, ReadPlanner
from kvstrata.attention.selection.attend import native_selected, read_keys, selected_partials
from kvstrata.attention.selection.control import SelectionControl
from kvstrata.attention.selection.sharing import BlockHashes
from kvstrata.attention.staging import Stager
from kvstrata.blocks.manager import BlockManager, Run
from kvstrata.config import CacheConfig
from kvstrata.core.errors import KvstrataError, TierIOError, UnsupportedModelError
from kvstrata.core.layout import BlockLayout
from kvstrata.model.groups import LayerGroup
from kvstrata.platform import native as _native
from kvstrata.tiers.memory import MemoryTier

SMALL_PART_TOKENS = 2048


def _local_tiers(tiers: list, device: torch.device, cold_attention: str) -> set[str]:
    """Memory tiers whose raw arenas are attended in place (zero-copy views): those on
    the compute device, and host arenas too when the CPU computes ('auto') or when
    asked ('local'); only the device tier with 'stage'."""
    if cold_attention == "stage":
        return {tiers[0].name}
    return {
        t.name
        for t in tiers
        if isinstance(t, MemoryTier)
        and t.zero_copy
        and (
            t.device == device
            or cold_attention == "local"
            or (cold_attention == "auto" and device.type == "cpu")
        )
    }


def _native_tiers(
    tiers: list, layout: BlockLayout, local: set[str], cold_attention: str
) -> set[str]:
    """Tiers a CPU decode step reads in place in one native call: the local CPU arenas
    and, unless staging is asked for, the quantized host tiers whose codec the kernel
    reads (they are then never staged in decode)."""
    native = {t.name for t in tiers if t.name in local and t.device.type == "cpu"}
    if cold_attention != "stage":
        native |= {
            t.name
            for t in tiers
            if isinstance(t, MemoryTier)
            and t.device.type == "cpu"
            and not t.zero_copy
            and t.codec.attend_format("k", layout) is not None
            and t.codec.attend_format("v", layout) is not None
        }
    return native


@dataclass
class RowMask:
    """Padding of one batch row: keys before `first_valid` are padding; `dense` is
    the full boolean key mask when padding is not a prefix."""

    first_valid: int
    dense: torch.Tensor | None


class AttentionRuntime(SelectionControl):
    """Attention over a store's tiers (see the module docstring)."""

    # Decode on the CPU through kvstrata/platform/csrc/attention.cpp when it is available
    # (set False on the class, or on an instance before build, to use torch partials).
    native_attention = True

    def __init__(
        self,
        manager: BlockManager,
        layout: BlockLayout,
        config: CacheConfig,
        device: torch.device,
        groups: list[LayerGroup],
        layer_map: list[tuple[int, int]],
        native: bool | None = None,
    ) -> None:
        """Args: the store's block manager (with its tiers), block layout, config,
        device, layer groups and `layer_map` (model layer -> (group, local layer));
        `native`: use the native CPU decode attention (None: the class default)."""
        self.manager = mgr = manager
        self.layout = layout
        cc = config
        self.device = device
        self.groups = groups
        self.layer_map = layer_map
        state = mgr.state
        tiers = [state.tiers[n] for n in state.tier_order]
        self.tiers = state.tiers
        self.device_name = tiers[0].name
        self._lone: bool | None = None  # one sequence in the store (this step)
        self.closed = False
        self.batched_decodes = 0  # (sequence, layer) decodes attended by `decode_batch`
        # tiers whose raw arenas take token writes and zero-copy views directly
        self.arena_tiers = {t.name for t in tiers if isinstance(t, MemoryTier) and t.zero_copy}
        self.local = _local_tiers(tiers, device, cc.cold_attention)
        # lower tiers read in place on the compute device itself (host RAM when the CPU
        # computes; not host RAM a GPU step reaches with cold_attention="local"): a
        # running sequence's blocks there cost what resident ones do
        self.in_place = {
            t.name for t in tiers[1:] if t.name in self.local and t.device.type == device.type
        }
        use_native = self.native_attention if native is None else native
        self.native: set[str] = set()
        if (
            use_native
            and device.type == "cpu"
            and max(layout.head_dim, layout.dim_v) <= NATIVE_MAX_DIM
            and _native.available()
        ):
            self.native = _native_tiers(tiers, layout, self.local, cc.cold_attention)
        staged = any(t.name not in self.local for t in tiers)
        bs = cc.block_size
        # two buffers of at most the whole cache each: more could never be filled
        tokens = min(cc.staging_tokens, 2 * -(-cc.max_tokens // bs) * bs)
        self.stager = (
            Stager(self.tiers, layout, device, tokens, self.device_name) if staged else None
        )
        self.reads = ReadPlanner(mgr, layout, groups, self.local, self.native)
        blocks = state.pool.blocks  # selection's summaries follow the blocks' hashes
        self._hashes = BlockHashes(
            lambda b: getattr(blocks.get(b), "block_hash", None), layout.block_size
        )
        self.selector = self.prefetch = None
        self.set_selection(cc)
        state.on_truncate = self._truncate

    @property
    def step_tokens(self) -> dict[int, int]:
        """New tokens per sequence this step."""
        return self.reads.step_tokens

    def begin_step(self, num_new: dict[int, int]) -> None:
        """A forward step of `num_new[seq_id]` tokens per sequence starts (the store has
        placed them): read plans are built afresh, once, at each sequence's first layer."""
        self.reads.begin_step(num_new)
        self._lone = None
        if self.selector is not None:
            self.selector.forget(self.manager.state.tables.get)
        if self.prefetch is not None:
            self.prefetch.settle()
            self.prefetch.forget(self.manager.state.tables.get)

    @property
    def staging_bytes(self) -> int:
        return self.stager.nbytes if self.stager else 0

    def transfer_stats(self) -> dict[str, Any] | None:
        return self.stager.engine.stats.as_dict() if self.stager else None

    def close(self) -> None:
        """The store closed: its tiers are gone, any further attention raises."""
        self.closed = True
        if self.prefetch is not None:
            self.prefetch.close()
        if self.stager is not None:
            self.stager.close()

    # -- the step's read plans ------------------------------------------------------------
    def _parts(self, layer: int, plan: ReadPlan, seq_id: int):
        """(k, v) parts of a read plan's non-native pieces for model layer `layer`, in
        order.

        Where the data may be attended in place, parts are zero-copy views of the
        arenas, and consecutive small ones (< SMALL_PART_TOKENS together, e.g. the
        sink block and the two halves of the device ring) are joined into one copy:
        a partial costs a kernel launch, thread synchronisation and a merge, more
        than copying a few blocks. Cold runs come through the stager's buffers; such
        a view is valid only until the generator resumes (the buffer is reused)."""
        _group, local = self.layer_map[layer]
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

    def _first_chunk(self, local: int, run: Run, end: int) -> tuple:
        first, count, _ = self.stager.chunks(run, run.token_start, end)[0]
        return (local, run.tier, first, count)

    def _next_layer_chunk(self, layer: int, seq_id: int) -> tuple | None:
        """The first cold chunk layer + 1 will read for a lone sequence with one cold
        run: loading it can start as soon as this layer's last cold chunk is in (its
        buffer is free then), overlapping this layer's attention."""
        if self.stager is None or layer + 1 >= len(self.layer_map):
            return None
        if self._lone is None:  # every sequence has one block table per group
            self._lone = len(self.manager.state.tables) == len(self.groups)
        if not self._lone:
            return None
        group, local = self.layer_map[layer + 1]
        cold = self.reads.cold_history(seq_id, group)
        return self._first_chunk(local, *cold[0]) if len(cold) == 1 else None

    def prefetch_next_layer(self, layer: int, seq_ids: list[int]) -> None:
        """After layer `layer`'s attention: start loading the first cold chunk that
        layer + 1 will need (a no-op when `_next_layer_chunk` already started it)."""
        if self.stager is None or layer + 1 >= len(self.layer_map):
            return
        group, local = self.layer_map[layer + 1]
        for seq_id in sorted(seq_ids):
            if self._selecting(seq_id, self.groups[group], layer + 1):
                continue  # it reads only the blocks the next layer's query chooses
            cold = self.reads.cold_history(seq_id, group)
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
        select: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Partials (out, lse) of packed queries qp over keys [start, end), which every
        query sees: one native call for the runs readable in place (CPU, few query
        rows), one torch partial per other part (staged chunks, device arenas).
        `select`: a decode that attends only the keys the selector chooses."""
        native = bool(self.native) and qp.shape[1] <= NATIVE_MAX_ROWS
        group, local = self.layer_map[layer]
        plan = self.reads.read_plan(group, seq_id, start, end, native)
        if select and self.selector is not None and layer >= self.selector.dense_layers:
            choice = self.selector.prepare(
                (seq_id, group),
                self.manager.state.tables[(seq_id, group)],
                len(self.groups[group].layers),
                local,
                qp,
                start,
                end,
                lambda lo, hi: read_keys(self, local, group, seq_id, lo, hi),
            )
            if choice is not None:
                fused = native_selected(self, local, plan, choice, qp, scale, softcap)
                if fused is not None:
                    return [fused]
                chosen = self.selector.ranges(choice, qp)
                return selected_partials(
                    self, local, group, seq_id, plan, chosen, qp, scale, softcap
                )
        parts = [
            partial_where_kv_lives(qp, k, v, scale, softcap)
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

    def _selecting(self, seq_id: int, group: LayerGroup, layer: int) -> bool:
        """Whether this step's decode of `seq_id` selects blocks in model layer `layer`
        (of `group`)."""
        sel = self.selector
        if sel is None or group.window is not None or self.step_tokens.get(seq_id) != 1:
            return False
        if layer < sel.dense_layers:
            return False
        return self.selector.bounds(0, self.manager.num_tokens((seq_id, 0))) is not None

    def _group_of(self, layer: int, sliding_window: int | None):
        """The layer group of model layer `layer`, checked against the model's window
        (and the store still open: every layer's attention starts here)."""
        if self.closed:
            raise KvstrataError("this KVStore is closed: create a new one")
        group = self.groups[self.layer_map[layer][0]]
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
        gi, local = self.layer_map[layer]
        # once per step and group: the runs are fixed once the step's tokens are placed
        # (layer 0), and begin_step clears the plans
        dense = self.selector is None or layer < self.selector.dense_layers
        key = ("batch", gi, tuple(seq_ids), dense)
        batch = self.reads.plans.get(key)
        if batch is None:
            done, descs, strides, nparts = [], [], [], []
            for i, sid in enumerate(seq_ids):
                total = self.manager.num_tokens((sid, 0))
                if self.step_tokens.get(sid) != 1 or self._selecting(sid, self.groups[gi], layer):
                    continue
                start = total - sliding_window if sliding_window and sliding_window < total else 0
                plan = self.reads.read_plan(gi, sid, start, total, native=True)
                if plan.pieces or plan.native is None:
                    continue
                done.append(i)
                descs.append(plan.native.at(0))
                strides.append(plan.native.at(1) - plan.native.at(0))
                nparts.append(plan.native.num_parts)
            batch = self.reads.plans[key] = (
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
        num_q, total = q.shape[1], self.manager.num_tokens((seq_id, 0))
        past = total - num_q
        hkv, hq = self.layout.num_kv_heads, q.shape[0]
        first_valid = row_mask.first_valid if row_mask else 0
        window = sliding_window if sliding_window and sliding_window < total else None
        dense = row_mask.dense if row_mask else None
        acc = None
        sel = self.selector
        if sel is not None and num_q > 1 and group.window is None and layer >= sel.dense_layers:
            gi, local = self.layer_map[layer]
            table = self.manager.state.tables[(seq_id, gi)]
            self.selector.observe((seq_id, gi), table, len(group.layers), local, new_k, past)
        if num_q == 1 and dense is None:
            start = first_valid if window is None else max(first_valid, total - window)
            qp, select = pack_gqa(q, hkv), window is None and group.window is None
            parts = self._history_partials(layer, seq_id, qp, start, total, scale, softcap, select)
            acc = merge_all(parts) if parts else None
        elif dense is None and window is None and first_valid <= past:
            qp = pack_gqa(q, hkv)
            parts = self._history_partials(layer, seq_id, qp, first_valid, past, scale, softcap)
            parts.append(causal_new(q, new_k, new_v, scale, softcap, hkv))
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
            plan = self.reads.read_plan(group.index, seq_id, start, past, native=False)
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
