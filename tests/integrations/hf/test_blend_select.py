"""Which tokens a blend recomputes (issue #52): the reused tokens the question reads
most, over every layer, read in a probe of the always-recomputed rows over the reused
K/V. Checked against the attention weights transformers' own eager forward reports,
and the rows pass against a full prefill when every token is chosen."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from hf_models import tiny_model
from kvstrata.integrations.hf.blend import SELECT_LAYER, SINK_TOKENS, Blender, Reuse

LAYERS = 4
# the prompt: a head, two documents back to back, text the documents do not cover
HEAD, DOCS, GAP, QUESTION = 6, [(6, 40), (40, 80)], 2, 12


def setup(family: str, attn: str = "sdpa"):
    model = tiny_model(family, attn=attn, num_hidden_layers=LAYERS, initializer_range=0.3)
    n = DOCS[-1][1] + GAP + QUESTION
    ids = torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    return model, ids


def full_prefill(model, ids: list[int], attentions: bool = False):
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(torch.tensor([ids]), cache=cache, output_attentions=attentions)
    k = torch.stack([lay.keys[0] for lay in cache.layers])  # [L, Hkv, T, D]
    v = torch.stack([lay.values[0] for lay in cache.layers])
    return k, v, out.attentions


def reuse_of(k: torch.Tensor, v: torch.Tensor, total: int) -> Reuse:
    """K/V of the tokens HEAD .. end, with the documents' marked as reused."""
    have = torch.zeros(total - HEAD, dtype=torch.bool)
    sink = torch.zeros_like(have)
    for s, e in DOCS:
        have[s - HEAD : e - HEAD] = True
        sink[s - HEAD : s - HEAD + SINK_TOKENS] = True
    return Reuse(k[:, :, HEAD:].clone(), v[:, :, HEAD:].clone(), have, sink)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_choosing_every_reused_token_is_a_full_prefill(family, one_thread):
    model, ids = setup(family)
    k, v, _ = full_prefill(model, ids)
    noise = torch.Generator().manual_seed(1)
    reuse = reuse_of(k, v, len(ids))  # reused K/V far off: every chosen token recomputed
    reuse.k += torch.randn(reuse.k.shape, generator=noise)
    reuse.v += torch.randn(reuse.v.shape, generator=noise)
    pk, pv = k[:, :, :HEAD], v[:, :, :HEAD]
    out = Blender(model).blend(ids[HEAD:], HEAD, pk, pv, reuse, recompute=0.9999)
    assert bool(out.recomputed.all())
    torch.testing.assert_close(out.k, k[:, :, HEAD:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.v, v[:, :, HEAD:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", [0.1, 0.3])
def test_the_tokens_chosen_are_the_ones_the_question_reads_most(recompute, one_thread):
    """With the reused K/V exact, the probe's reads are the full prefill's: the
    question's attention to each token summed over the layers from SELECT_LAYER on
    (each scaled to its largest), as transformers' eager attention reports it."""
    model, ids = setup("llama", attn="eager")
    k, v, attn = full_prefill(model, ids, attentions=True)
    reuse = reuse_of(k, v, len(ids))
    question = slice(DOCS[-1][1], len(ids))
    score = torch.zeros(len(ids))
    for layer in attn[SELECT_LAYER:]:
        read = layer[0, :, question].sum(dim=(0, 1))
        score += read / read.max()
    score = score[HEAD:]
    forced = ~reuse.have | reuse.sink
    score[forced] = -1
    top = math.ceil(recompute * int((~forced).sum()))
    want = forced.clone()
    want[torch.topk(score, top).indices] = True
    same, _ = setup("llama")  # the same weights (seeded), the attention blending runs
    out = Blender(same).blend(ids[HEAD:], HEAD, k[:, :, :HEAD], v[:, :, :HEAD], reuse, recompute)
    assert out.recomputed.tolist() == want.tolist()
    assert int(out.recomputed.sum()) == int(forced.sum()) + top
    # the reused tokens keep their K/V; with them exact, the blend is the prefill's
    keep = ~out.recomputed
    assert torch.equal(out.k[SELECT_LAYER + 1 :, :, keep], reuse.k[SELECT_LAYER + 1 :, :, keep])
    torch.testing.assert_close(out.k, k[:, :, HEAD:], rtol=1e-5, atol=1e-5)


def test_without_a_question_the_value_deviation_chooses(one_thread):
    """Documents at the prompt's end leave no question to read them: the tokens whose
    values at the selection layer moved most are recomputed (CacheBlend's rule)."""
    model, ids = setup("llama")
    ids = ids[: DOCS[-1][1]]
    k, v, _ = full_prefill(model, ids)
    reuse = reuse_of(k, v, len(ids))
    moved = torch.tensor([10, 25, 50]) - HEAD  # three tokens' values far off at the layer
    reuse.v[SELECT_LAYER, :, moved] += 5.0
    forced = ~reuse.have | reuse.sink
    r = len(moved) / int((~forced).sum())  # room for three
    out = Blender(model).blend(ids[HEAD:], HEAD, k[:, :, :HEAD], v[:, :, :HEAD], reuse, r)
    chosen = out.recomputed & ~forced
    assert sorted(chosen.nonzero().flatten().tolist()) == sorted(moved.tolist())


def test_a_one_layer_model_computes_every_token(one_thread):
    model = tiny_model("llama", num_hidden_layers=1, initializer_range=0.3)
    n = DOCS[-1][1] + GAP + QUESTION
    ids = torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    k, v, _ = full_prefill(model, ids)
    reuse = reuse_of(k + 1.0, v + 1.0, len(ids))  # wrong on purpose: it must not be used
    out = Blender(model).blend(ids[HEAD:], HEAD, k[:, :, :HEAD], v[:, :, :HEAD], reuse, 0.2)
    assert bool(out.recomputed.all())
    torch.testing.assert_close(out.k, k[:, :, HEAD:], rtol=1e-5, atol=1e-5)
