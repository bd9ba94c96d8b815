"""A fast stand-in for `compare()` when sweeping many codecs: one forward per window.

`evaluate.compare` runs every configuration token by token through a real TieredCache
(minutes per configuration at 2k context on a CPU). Sweeping a dozen codec settings that
way does not fit a work session, so :func:`simulated_compare` computes what that cache
computes, in one causal forward per window: every layer's K and V go through the codec
(encode, decode) block by block, and query i attends to the *decoded* K/V of the blocks
the cache would hold in a lower tier at step i — every block but the first (the sinks)
and the newest ones the device keeps for the residual window (`lossy_mask`) — and to
exact K/V elsewhere.
Encoding is per block and deterministic, so when a block is decoded does not matter.

The exact reference is the same forward with no codec (sdpa-equivalent math), so ΔPPL
and top-1 agreement isolate the codec. tests/codecs/test_lowrank_heads.py checks the simulation
against `compare()` on a short window.

The hook (`hooked`) also serves the calibration pass: a callback sees every layer's
query, post-RoPE key, value, pre-RoPE key and rotary embedding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.codecs.base import Codec
from kvstrata.core.layout import BlockLayout

ATTENTION_NAME = "kvstrata_sim"
Hook = Callable[..., torch.Tensor]
"""hook(module, query [1,Hq,T,D], key, value, scaling) -> attention output [1,T,Hq,Dv]."""

_ACTIVE: list[Hook] = []
_PRE: dict[int, torch.Tensor] = {}  # layer -> pre-RoPE keys [1, Hkv, T, D] of this forward
_ROPE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (cos, sin)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    return _ACTIVE[-1](module, query, key, value, scaling), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def pre_rope_keys(layer: int) -> torch.Tensor:
    """Pre-RoPE keys [1, Hkv, T, D] of `layer` in the current hooked forward."""
    return _PRE[layer]


def rotary(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) the current hooked forward rotates `layer`'s keys with."""
    return _ROPE[layer]


@contextlib.contextmanager
def hooked(model: Any, hook: Hook) -> Iterator[None]:
    """Run `model`'s attention through `hook` (and record pre-RoPE keys) inside."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    handles = []
    for layer in model.model.layers:
        attn = layer.self_attn
        idx = attn.layer_idx

        def keep(_m, _inp, out, idx=idx, attn=attn):
            _PRE[idx] = out.view(*out.shape[:-1], -1, attn.head_dim).transpose(1, 2)

        def rope(_m, args, kwargs, idx=idx):
            _ROPE[idx] = kwargs["position_embeddings"]

        handles.append(attn.k_proj.register_forward_hook(keep))
        handles.append(attn.register_forward_pre_hook(rope, with_kwargs=True))
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    _ACTIVE.append(hook)
    try:
        yield
    finally:
        _ACTIVE.pop()
        for h in handles:
            h.remove()
        _PRE.clear()
        _ROPE.clear()
        model.set_attn_implementation(before)


def lossy_mask(tokens: int, block_size: int, residual: int, device: Any = None) -> torch.Tensor:
    """[T, T] bool: query i reads key j decoded from a lower tier: j's block is not the
    sink block (the first) and lies before the open block and the ceil(residual /
    block_size) full blocks the device keeps (what the "window" policy keeps with a lossy
    lower tier: checked against the TieredCache in tests/codecs/test_lowrank_heads.py)."""
    q_block = torch.arange(tokens, device=device)[:, None] // block_size
    k_block = torch.arange(tokens, device=device)[None, :] // block_size
    return (k_block >= 1) & (k_block < q_block - -(-residual // block_size))


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lossy: torch.Tensor | None = None,
    key_lossy: torch.Tensor | None = None,
    value_lossy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention [1,T,Hq,Dv] where `lossy` [T,T] picks decoded K/V, one KV head's
    query group at a time (bounds the [Hq, T, T] temporaries)."""
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril_()
    out = query.new_empty(1, t, hq, value.shape[-1])
    for h in range(hkv):
        q = query[0, h * g : (h + 1) * g].float()
        s = q @ key[0, h].float().T * scale
        if lossy is not None:
            s = torch.where(lossy, q @ key_lossy[0, h].float().T * scale, s)
        p = s.masked_fill_(~causal, float("-inf")).softmax(-1)
        if lossy is None:
            o = p @ value[0, h].float()
        else:
            o = p.masked_fill(lossy, 0) @ value[0, h].float()
            o += p.masked_fill_(~lossy, 0) @ value_lossy[0, h].float()
        out[0, :, h * g : (h + 1) * g] = o.transpose(0, 1).to(out.dtype)
    return out


def attend_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    block_size: int,
    keep: int,
    key_lossy: torch.Tensor | None = None,
    value_lossy: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `attend(..., lossy_mask(...))` computes, a query block at a time with
    `scaled_dot_product_attention` over only the keys that block sees (the causal half):
    for query block m, decoded K/V of blocks 1 .. m-keep-1, exact ones elsewhere."""
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    q = query[0].float().reshape(hkv, g, t, d)
    k, v = key[0].float(), value[0].float()
    out = query.new_empty(1, t, hq, value.shape[-1])
    for m in range(-(-t // block_size)):
        q0, q1 = m * block_size, min(t, (m + 1) * block_size)
        cut = (m - keep) * block_size  # keys [block_size, cut) come decoded
        if key_lossy is None or cut <= block_size:
            kk, vv = k[:, :q1], v[:, :q1]
        else:
            kl, vl = key_lossy[0, :, block_size:cut].float(), value_lossy[0, :, block_size:cut]
            kk = torch.cat([k[:, :block_size], kl, k[:, cut:q1]], dim=1)
            vv = torch.cat([v[:, :block_size], vl.float(), v[:, cut:q1]], dim=1)
        rows = torch.arange(q0, q1)[:, None]
        mask = torch.arange(q1)[None, :] <= rows
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, q0:q1],
            kk[:, None].expand(hkv, g, q1, d),
            vv[:, None].expand(hkv, g, q1, vv.shape[-1]),
            attn_mask=mask,
            scale=scale,
        )
        out[0, q0:q1] = o.permute(2, 0, 1, 3).reshape(q1 - q0, hq, -1).to(out.dtype)
    return out


def roundtrip(codec: Codec, kind: str, x: torch.Tensor, layer: int, block_size: int):
    """x [H, T, D] through `codec` (encode then decode) as model layer `layer`."""
    h, t, d = x.shape
    layout = BlockLayout(1, h, d, block_size, dtype=x.dtype, v_head_dim=d)
    n = t // block_size
    fields = {
        f: torch.empty(h, n * s.rows, s.cols, dtype=s.dtype, device=x.device)
        for f, s in codec.fields(kind, layout).items()
    }
    out = torch.empty_like(x)
    hint = getattr(codec, "at_layer", None)
    with hint(layer) if hint is not None else contextlib.nullcontext():
        codec.encode(kind, x.contiguous(), fields)
        codec.decode(kind, fields, out)
    return out


Lossy = Callable[[int, str, torch.Tensor], torch.Tensor]
"""lossy(layer, kind, x [H, T, D] post-RoPE) -> what the lower tier gives back."""


def codec_lossy(codec: Codec, block_size: int) -> Lossy:
    """The Lossy of storing K/V with `codec` (both kinds, as a tier does)."""
    return lambda layer, kind, x: roundtrip(codec, kind, x, layer, block_size)


@dataclass
class SimResult:
    nll: float
    num_tokens: int
    argmax_ids: list[int]
    logprobs: torch.Tensor | None = None  # [T-1, V] (kept for the exact run only)

    def kl_from(self, exact: SimResult) -> float:
        """Summed KL(exact || this) of the next-token distributions, in nats."""
        assert exact.logprobs is not None and self.logprobs is not None
        p = exact.logprobs.exp()
        return float((p * (exact.logprobs - self.logprobs)).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.num_tokens)


def simulated_ppl(
    model: Any,
    window: Sequence[int],
    lossy: Lossy | None,
    *,
    block_size: int = 64,
    residual: int = 128,
    keep_logprobs: bool = False,
) -> SimResult:
    """Teacher-forced NLL of one window with history K/V as `lossy` gives them back."""
    ids = torch.as_tensor(list(window), dtype=torch.long)
    t = ids.numel() - ids.numel() % block_size
    ids = ids[:t]
    keep = -(-residual // block_size)

    def hook(module, query, key, value, scaling):
        if lossy is None:
            return attend_blocks(query, key, value, scaling, block_size, keep)
        layer = module.layer_idx
        kl = lossy(layer, "k", key[0])[None]
        vl = lossy(layer, "v", value[0])[None]
        return attend_blocks(query, key, value, scaling, block_size, keep, kl, vl)

    with torch.inference_mode(), hooked(model, hook):
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
    nll = float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
    logprobs = logits.log_softmax(-1) if keep_logprobs else None
    return SimResult(nll, t - 1, logits.argmax(-1).tolist(), logprobs)


def simulated_compare(
    model: Any,
    windows: Sequence[Sequence[int]],
    configs: dict[str, Lossy],
    *,
    block_size: int = 64,
    residual: int = 128,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, float]]:
    """name -> {"delta_ppl_pct", "top1_agreement", "ppl"} against the exact forward
    (plus "exact" -> {"ppl"})."""
    exact = [simulated_ppl(model, w, None, block_size=block_size) for w in windows]
    ex_nll = sum(r.nll for r in exact)
    ex_tok = sum(r.num_tokens for r in exact)
    ex_ids = [i for r in exact for i in r.argmax_ids]
    out: dict[str, dict[str, float]] = {"exact": {"ppl": math.exp(ex_nll / ex_tok)}}
    for name, fn in configs.items():
        runs = [
            simulated_ppl(model, w, fn, block_size=block_size, residual=residual) for w in windows
        ]
        nll = sum(r.nll for r in runs)
        ids = [i for r in runs for i in r.argmax_ids]
        ppl = math.exp(nll / ex_tok)
        out[name] = {
            "ppl": ppl,
            "delta_ppl_pct": 100.0 * (ppl / out["exact"]["ppl"] - 1.0),
            "top1_agreement": sum(a == b for a, b in zip(ex_ids, ids, strict=True)) / len(ids),
        }
        if progress is not None:
            progress(name)
    return out
