"""The native decode kernel's side of attention: descriptors of raw and encoded K/V
fields (`raw_field`, `encoded_field`), the per-step `LayerDescs` arrays, and the calls
into kvstrata/platform/csrc/attention.cpp that attend all parts of a decode step at once,
reading quantized host blocks in place (no partial per part, no merge, no staging copy).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvstrata.core.formats import FieldDesc, FieldFormat, PartDesc
from kvstrata.platform.native import load

# -- native decode attention ------------------------------------------------------------------
NATIVE_MAX_ROWS = 64  # packed query rows per KV head (R * new tokens)
NATIVE_MAX_DIM = 512


def raw_field(t: torch.Tensor) -> FieldDesc | None:
    """Descriptor of a raw K or V view [Hkv, T, D] (rows contiguous, on the CPU), or
    None when the native kernel cannot read it in place."""
    fmt = FieldFormat.raw(t.dtype)
    if fmt is None or t.device.type != "cpu" or (t.stride(-1) != 1 and t.shape[-1] > 1):
        return None
    es = t.element_size()
    return FieldDesc(
        data=t.data_ptr(),
        data_head_stride=t.stride(0) * es,
        data_row_stride=t.stride(1) * es,
        format=fmt,
    )


def encoded_field(
    fmt: tuple[FieldFormat, int],
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    row0: int,
) -> FieldDesc | None:
    """Descriptor of a codec's fields for one layer ([Hkv, rows, cols] arenas, rows
    contiguous, CPU), starting at arena token row `row0`; `fmt` is the codec's
    `attend_format` (format, group); `zero` None for codecs without a zero point (fp8)."""
    zero = scale if zero is None else zero
    if any(t.device.type != "cpu" or not t[0].is_contiguous() for t in (data, scale, zero)):
        return None
    code, group = fmt
    return FieldDesc(
        data=data.data_ptr(),
        scale=scale.data_ptr(),
        zero=zero.data_ptr(),
        data_head_stride=data.stride(0) * data.element_size(),
        data_row_stride=data.stride(1) * data.element_size(),
        scale_head_stride=scale.stride(0) * scale.element_size(),
        zero_head_stride=zero.stride(0) * zero.element_size(),
        group=group,
        row0=row0,
        format=code,
    )


def native_attention(
    q: torch.Tensor,
    parts: list[tuple[int, FieldDesc, FieldDesc]],
    dim_v: int,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Packed queries q [Hkv, M, D] over the union of `parts`, in one native call.

    Args:
        q: packed queries (any device/dtype; computed in fp32 on the CPU).
        parts: (tokens, K descriptor, V descriptor) per part (`raw_field`,
            `encoded_field`); every query sees every key.
        dim_v: value head dim.
        scale, softcap: as `partial_attention`.

    Returns:
        (out [Hkv, M, Dv] in q's dtype and device, lse [Hkv, M] fp32), or None when
        the native library is unavailable or the shapes are beyond it.
    """
    if not parts:
        return None
    desc = (PartDesc * len(parts))(*parts)  # one contiguous kv_part array
    return native_attention_desc(q, ctypes.addressof(desc), len(parts), dim_v, scale, softcap)


def native_attention_desc(
    q: torch.Tensor, desc: int, num_parts: int, dim_v: int, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`native_attention` over a ready `PartDesc` array at address `desc`."""
    lib = load()
    hkv, m, d = q.shape
    if lib is None or not num_parts or m > NATIVE_MAX_ROWS or max(d, dim_v) > NATIVE_MAX_DIM:
        return None
    qf = _cpu_f32(q)
    out = torch.empty((hkv, m, dim_v), dtype=torch.float32)
    lse = torch.empty((hkv, m), dtype=torch.float32)
    rc = lib.kv_attn_decode(
        num_parts,
        desc,
        qf.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        hkv,
        m,
        d,
        dim_v,
        scale,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native decode attention failed with status {rc}")
    return _back(out, q), _back(lse, q, torch.float32)


def _cpu_f32(q: torch.Tensor) -> torch.Tensor:
    """q as a contiguous fp32 CPU tensor (itself when it is one: no dispatch per call)."""
    if q.dtype is torch.float32 and q.device.type == "cpu" and q.is_contiguous():
        return q.detach()
    return q.detach().to("cpu", torch.float32).contiguous()


def _back(x: torch.Tensor, q: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A native result x (fp32, CPU) on q's device, in `dtype` (q's by default)."""
    dtype = q.dtype if dtype is None else dtype
    if q.device.type == "cpu" and dtype is torch.float32:
        return x
    return x.to(q.device, dtype)


def native_attention_batch(
    q: torch.Tensor,
    descs: np.ndarray,
    nparts: np.ndarray,
    dim_v: int,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of S sequences in one native call: q [S, Hkv, M, D] (packed
    queries per sequence), sequence s over the `nparts[s]` parts of the `PartDesc`
    array at address `descs[s]`. Each sequence gets the bits `native_attention_desc`
    gives it alone.

    Returns (out [S, Hkv, M, Dv] in q's dtype, lse [S, Hkv, M] fp32). The caller checks
    the native library is available and M, D, Dv are within NATIVE_MAX_*."""
    lib = load()
    num, hkv, m, d = q.shape
    qf = q.detach().to("cpu", torch.float32).contiguous()
    out = torch.empty((num, hkv, m, dim_v), dtype=torch.float32)
    lse = torch.empty((num, hkv, m), dtype=torch.float32)
    descs = np.ascontiguousarray(descs, dtype=np.uint64)
    nparts = np.ascontiguousarray(nparts, dtype=np.intc)
    rc = lib.kv_attn_decode_batch(
        num,
        nparts.ctypes.data,
        descs.ctypes.data,
        qf.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        hkv,
        m,
        d,
        dim_v,
        scale,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native batched decode attention failed with status {rc}")
    return out.to(q.device, q.dtype), lse.to(q.device)


def native_select_attention(
    q: torch.Tensor,
    desc: int,
    num_parts: int,
    part_start: np.ndarray | ctypes.Array,
    summaries: torch.Tensor,
    page: int,
    pages: tuple[int, int, int],
    keys: tuple[int, int, int, int],
    dim_v: int,
    scale: float,
    softcap: float | None,
    chosen: np.ndarray | None = None,
    score: str = "max",
    coarse: tuple[torch.Tensor, int, int] | None = None,
    channels: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Query-aware decode attention of packed queries q [Hkv, M, D] in one native call
    (platform/csrc/select.cpp): each KV head scores pages c0 .. c1 - 1 of its
    channel-major `summaries` [Hkv, W, capacity] (fp32 or fp16, CPU, pages contiguous)
    — each query row over its `channels` largest-|q| channels (0: all) — chooses its
    `choose` best and attends them with keys [start, sink_end) and [recent_start,
    total), read from the `PartDesc` array at `desc` (parts back to back from key
    part_start[p]: an int64 array, numpy or ctypes). `pages` = (c0, c1, choose), `keys` =
    (start, sink_end, recent_start, total); `chosen` [Hkv, choose] int64 receives the pages chosen
    (relative to c0). A page's score is its best query row's (`score` "max") or their
    sum ("sum"). `coarse` = (summaries of groups of pages [Hkv, W, groups] as
    `summaries`, pages per group, groups refined): two-level scoring (select.cpp).

    Returns (out [Hkv, M, Dv] in q's dtype and device, lse [Hkv, M], keys attended over
    all heads, summary values read over all heads). The caller checks the library is
    loaded and M, D, Dv are within NATIVE_MAX_*."""
    lib = load()
    hkv, m, d = q.shape
    if isinstance(part_start, np.ndarray):
        assert part_start.dtype == np.int64 and part_start.flags.c_contiguous
        part_start = part_start.ctypes.data
    qf = _cpu_f32(q)
    out = torch.empty((hkv, m, dim_v), dtype=torch.float32)
    lse = torch.empty((hkv, m), dtype=torch.float32)
    attended, scored = (ctypes.c_int64 * hkv)(), (ctypes.c_int64 * hkv)()
    c0, c1, choose = pages
    if chosen is not None:
        assert chosen.dtype == np.int64 and chosen.shape == (hkv, choose)
        assert chosen.flags.c_contiguous
    if coarse is not None:
        groups, group, nref = coarse
        assert groups.dtype == summaries.dtype and groups.stride(-1) == 1
        two = (groups.data_ptr(), groups.stride(0), groups.stride(1), group, nref)
    else:
        two = (None, 0, 0, 0, 0)
    assert summaries.stride(-1) == 1
    rc = lib.kv_attn_select_decode(
        num_parts,
        desc,
        part_start,
        qf.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        hkv,
        m,
        d,
        dim_v,
        scale,
        softcap or 0.0,
        summaries.data_ptr(),
        summaries.dtype == torch.float16,
        score == "max",
        summaries.stride(0),
        summaries.stride(1),
        summaries.shape[1],
        page,
        c0,
        c1,
        choose,
        *keys,
        attended,
        None if chosen is None else chosen.ctypes.data,
        *two,
        channels,
        scored,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native query-aware decode attention failed with status {rc}")
    return _back(out, q), _back(lse, q, torch.float32), sum(attended), sum(scored)


class HeadParts:
    """`PartDesc` arrays of one layer, one per KV head (rows of uint64 words, grouped
    by head): `addresses` and `counts` for `native_attention_batch` with one head per
    "sequence"."""

    def __init__(self, rows: np.ndarray, counts: np.ndarray) -> None:
        self._rows = np.ascontiguousarray(rows)
        self.counts = counts.astype(np.intc)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
        size = np.uint64(ctypes.sizeof(PartDesc))
        self.addresses = np.uint64(self._rows.ctypes.data) + first * size


class LayerDescs:
    """The `PartDesc` arrays of every layer of a group, built once per step: the
    arenas are [layers, ...] tensors, so one layer's descriptors differ from the
    previous layer's by a fixed distance per pointer (the layer strides).

    Built from the descriptors of local layers 0 and 1 (`second` None for a one-layer
    group) with one vectorised op; `at(layer)` is then the address of that layer's
    array, no per-layer work."""

    # uint64 words of K's and V's row0, and of each pointer's head stride (in _WORDS' order)
    _ROW0 = [(kind.offset + FieldDesc.row0.offset) // 8 for kind in (PartDesc.k, PartDesc.v)]
    _PTR_STRIDES = [
        (kind.offset + stride.offset) // 8
        for kind in (PartDesc.k, PartDesc.v)
        for stride in (
            FieldDesc.data_head_stride,
            FieldDesc.scale_head_stride,
            FieldDesc.zero_head_stride,
        )
    ]
    # uint64 word of each pointer (K and V: data, scale, zero) within one PartDesc
    _WORDS = [
        (part.offset + ptr.offset) // 8
        for part in (PartDesc.k, PartDesc.v)
        for ptr in (FieldDesc.data, FieldDesc.scale, FieldDesc.zero)
    ]

    def __init__(self, first: list[tuple], second: list[tuple] | None, num_layers: int) -> None:
        self.num_parts = n = len(first)
        per_part = ctypes.sizeof(PartDesc) // 8
        idx = np.array([p * per_part + w for p in range(n) for w in self._WORDS])
        base = np.frombuffer(bytes((PartDesc * n)(*first)), dtype=np.uint64)
        p0 = base[idx].astype(np.int64)
        delta = np.zeros_like(p0)
        if second is not None:
            p1 = np.frombuffer(bytes((PartDesc * n)(*second)), dtype=np.uint64)[idx]
            delta = np.where(p0 != 0, p1.astype(np.int64) - p0, 0)
        self._bufs = np.tile(base, (num_layers, 1))
        layers = np.arange(num_layers, dtype=np.int64)[:, None]
        self._bufs[:, idx] = (p0 + layers * delta).astype(np.uint64)
        self._addr, self._stride = self._bufs.ctypes.data, self._bufs.strides[0]
        self._heads: np.ndarray | None = None  # per_head's table, built on first use

    def at(self, layer: int) -> int:
        """Address of the `PartDesc` array of local layer `layer`."""
        return self._addr + layer * self._stride

    def per_head(
        self,
        layer: int,
        heads: np.ndarray,
        parts: np.ndarray,
        offsets: np.ndarray,
        tokens: np.ndarray,
        num_heads: int,
    ) -> HeadParts:
        """Local layer `layer`'s descriptors for attending each KV head alone (query-aware
        selection): entry i is `tokens[i]` keys of part `parts[i]` from its key
        `offsets[i]` on, in head `heads[i]` only (entries sorted by head). A part's rows
        are arena rows row0 + t in every format, so a sub-part is the part with row0
        moved on; one head's is the part with its pointers moved to that head."""
        if self._heads is None or self._heads.shape[1] != self.num_parts * num_heads:
            # every (layer, part, head)'s descriptor, once per plan: [layers, P * H, words]
            per_part = ctypes.sizeof(PartDesc) // 8
            rows = self._bufs.reshape(-1, self.num_parts, 1, per_part).repeat(num_heads, 2)
            ptrs = rows[..., self._WORDS]
            h = np.arange(num_heads, dtype=np.uint64)[:, None]
            moved = rows[..., self._PTR_STRIDES] * h
            rows[..., self._WORDS] = np.where(ptrs != 0, ptrs + moved, 0)  # 0: a field it lacks
            self._heads = rows.reshape(rows.shape[0], -1, per_part)
        rows = self._heads[layer][np.asarray(parts) * num_heads + heads]
        rows[:, self._ROW0] += np.asarray(offsets, dtype=np.uint64)[:, None]
        rows[:, PartDesc.tokens.offset // 8] = tokens
        return HeadParts(rows, np.bincount(heads, minlength=num_heads))

    def set_tokens(self, part: int, tokens: int) -> None:
        """Set part `part`'s token count in every layer's array (a run that grew).
        per_head's table (`_heads`) needs no update: it sets each entry's count itself."""
        per_part = ctypes.sizeof(PartDesc) // 8
        self._bufs[:, part * per_part + PartDesc.tokens.offset // 8] = tokens
