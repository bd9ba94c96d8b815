"""The "kvstrata" attention registered with transformers, and `enable(model)`.

The attention function (AttentionInterface) receives what `TieredCache.update()`
returned — a `TieredKV` handle, or the engine's packed-step handle — and attends each
batch row's queries over that sequence's blocks, tier by tier (kvstrata.attention
.runtime: on the CPU a decode step attends every run that can be read in place — raw
arenas and int8/fp8/int4 host blocks — in one native call; only disk blocks and lossy
blocks of codecs the kernel cannot read go through the staging buffers). The mask
function registered under the same name hands over the 2-D padding mask instead of
building a dense 4-D mask. `enable` switches a model to both and installs the forward
hooks that hand each forward's input ids to a TieredCache and undo a failed step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from kvstrata.core.errors import UnsupportedModelError
from kvstrata.core.fingerprint import remember_weights
from kvstrata.integrations.hf.cache import TieredCache
from kvstrata.integrations.hf.layers import TieredKV
from kvstrata.model.support import check_cacheable

ATTENTION_NAME = "kvstrata"  # no "flash" and no "/" in it (transformers treats those apart)


def kvstrata_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as "kvstrata" (transformers AttentionInterface).
    Also serves the engine's packed steps (a handle with `kvstrata_attend`)."""
    # the calling layer; a layer that shares another's K/V (Gemma-3n) passes its handle
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        layer_idx = getattr(key, "layer_idx", -1)
    packed = getattr(key, "kvstrata_attend", None)
    if packed is not None:
        return packed(layer_idx, query, scaling, sliding_window, softcap, s_aux)
    if not isinstance(key, TieredKV):
        raise UnsupportedModelError(
            "attn_implementation='kvstrata' needs a kvstrata.TieredCache: pass "
            "cache=TieredCache(model.config, ...) to generate()/forward()"
        )
    cache = key.cache
    try:
        return _attention(
            cache, key, layer_idx, query, attention_mask, scaling, sliding_window, softcap, s_aux
        )
    except BaseException:  # e.g. a corrupt block: the step is undone, nothing half-applied
        cache.abort_step()
        raise


def _attention(
    cache: TieredCache,
    key: TieredKV,
    layer_idx: int,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> tuple[torch.Tensor, None]:
    runtime = cache.store.runtime
    batch, hq, num_q, dim = query.shape
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    rows = cache._row_mask(attention_mask, batch)
    out = query.new_empty((batch, num_q, hq, key.new_v.shape[-1]))
    for b in range(batch):
        o = runtime.attend(
            key.layer_idx,
            cache.seq_ids[b],
            query[b],
            key.new_k[b],
            key.new_v[b],
            scale,
            rows[b] if rows else None,
            sliding_window,
            softcap,
            s_aux,
        )
        out[b].copy_(o.transpose(0, 1))
    runtime.prefetch_next_layer(key.layer_idx, cache.seq_ids)
    if layer_idx == cache.last_attention_layer:
        cache.step_done()
    return out, None


def kvstrata_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered as "kvstrata": pass the 2-D padding mask through
    (None when nothing is padded); causality and windows are applied by the attention."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    if bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def register() -> None:
    """Register the "kvstrata" attention and mask functions with transformers."""
    AttentionInterface.register(ATTENTION_NAME, kvstrata_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvstrata_mask)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Register the attention and switch `model` to it. Returns the model.

    Raises:
        UnsupportedModelError: the model's attention does not go through
            transformers' AttentionInterface, or it has non-attention layers.
    """
    check_cacheable(model.config)
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"model_type={model.config.model_type!r}: its attention does not go through "
            "transformers' AttentionInterface (_supports_attention_backend is False)"
        )
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    remember_weights(model)  # names these weights in the block hashes of its stores
    if not getattr(model, "_kvstrata_hook", None):
        model._kvstrata_hook = (
            model.register_forward_pre_hook(_observe_ids, with_kwargs=True),
            # runs even when the forward raises: a step that did not finish is undone
            # at once, wherever the error came from (kvstrata or the model's own code)
            model.register_forward_hook(_forward_over, with_kwargs=True, always_call=True),
        )
    return model


def _forward_over(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Forward hook, also called when the forward raised an Exception (then `output`
    is None): the step of a failed forward is undone, wherever the error came from."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, TieredCache):
        cache.forward_ends(failed=output is None)


def _observe_ids(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: hand the forward's input ids to a TieredCache, which hashes
    its full blocks with them (prefix reuse); without ids it stops hashing."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, TieredCache):
        cache.forward_begins()
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache.observe_input_ids(ids if isinstance(ids, torch.Tensor) else None)
