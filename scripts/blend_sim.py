"""An exact simulation of blending (`kvstrata bench blend`'s workload) for comparing
which tokens to recompute, oracles included: one masked forward per choice, in which a
document token that is not recomputed sees only the head and its own document (so its
K/V at every layer are the ones the document gets alone, at its place in the prompt),
and every other token sees the whole prompt. The answer's perplexity against the full
prefill's, per choice and share:

  deviation   the tokens whose K/V moved most, summed over every layer (an oracle of
              CacheBlend's rule: it needs the full prefill)
  attention   the tokens the question reads most in the full prefill, over every layer
              (an oracle)
  probe       the same read from the question over the documents' own K/V (what
              `Blender._select` computes; no oracle)
  layer1      the earlier rule: value deviation + the question's attention, layer 1

Documents are not moved (each is where it sits), so this isolates the missing
cross-document context from the rotation. Each forward attends the whole prompt with a
mask (about 30 s per 4k-token request on two cores): minutes per request.

usage: PYTHONPATH=src python scripts/blend_sim.py [REQUESTS] [RATIOS] [RULES]
       e.g. scripts/blend_sim.py 4 0.15,0.3 probe,attention
"""

import argparse
import math
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvstrata.bench._models import bench_model
from kvstrata.bench.blend import workload
from kvstrata.workload.chunks import Chunks
from kvstrata.workload.zoo import quiet_transformers

SINKS = 4
RULES = ("deviation", "attention", "probe", "layer1")


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    ratios = [float(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "0.15,0.3").split(",")]
    rules = sys.argv[3].split(",") if len(sys.argv) > 3 else list(RULES)
    unknown = set(rules) - set(RULES)
    if unknown:
        raise SystemExit(
            f"rules={','.join(sorted(unknown))} is invalid: use some of {','.join(RULES)}"
        )
    quiet_transformers()
    torch.set_num_threads(2)
    _, path = bench_model(None, print)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    spec = argparse.Namespace(docs=4, pool=8, requests=8, seed=0, quick=False)
    reqs = workload(tok, spec)[spec.requests :]  # the bench's timed requests
    sim = Sim(model, rules)
    totals: dict[str, list[float]] = {}
    for n, req in enumerate(reqs[:count]):
        ids, spans = Chunks.of(req["text"], req["docs"]).encode(tok)
        answer = tok(" " + req["code"], add_special_tokens=False)["input_ids"]
        for name, nll in sim.request(ids, spans, answer, ratios).items():
            totals.setdefault(name, [0.0, 0])
            totals[name][0] += nll
            totals[name][1] += len(answer)
        base = math.exp(totals["full"][0] / totals["full"][1])
        print(f"after {n + 1} requests:")
        for name, (nll, tokens) in totals.items():
            ppl = math.exp(nll / tokens)
            print(f"  {name:16s} answer PPL {ppl:.3f} ({100 * (ppl / base - 1):+.1f} %)")


class Sim:
    def __init__(self, model, rules: list[str]) -> None:
        self.model = model
        self.rules = rules
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.queries: dict[int, torch.Tensor] = {}
        self.rows = (0, 0)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.register_forward_hook(self._keep_queries(i))

    def _keep_queries(self, i: int):
        def hook(_mod, _args, out):
            lo, hi = self.rows
            self.queries[i] = out[0, lo:hi].detach().clone()

        return hook

    @torch.inference_mode()
    def forward(self, x, doc_of, head, recomputed):
        """One masked forward: (logits, the cache)."""
        n = x.shape[1]
        i = torch.arange(n)
        causal = i[None, :] <= i[:, None]
        same = (doc_of[:, None] == doc_of[None, :]) & (doc_of[:, None] >= 0)
        alone = causal & (same | (i[None, :] < head))
        rows_alone = (doc_of >= 0) & ~recomputed
        seen = torch.where(rows_alone[:, None], alone, causal)
        mask = torch.zeros(seen.shape)
        mask[~seen] = torch.finfo(torch.float32).min
        out = self.model(x, attention_mask=mask[None, None], use_cache=True)
        return out.logits, out.past_key_values

    def reads(self, cache, lo: int, hi: int) -> torch.Tensor:
        """[layers, N]: the attention rows lo..hi give each token, per layer (scaled)."""
        n = cache.layers[0].keys.shape[2]
        cos, sin = self.model.model.rotary_emb(
            torch.zeros(1, hi - lo, self.dim), torch.arange(lo, hi)[None]
        )
        out = []
        for i, lay in enumerate(cache.layers):
            q = self.queries[i].view(1, hi - lo, self.heads, self.dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            k = lay.keys[0].repeat_interleave(self.heads // self.kv_heads, 0)[:, :hi]
            s = q[0] @ k.transpose(1, 2) / math.sqrt(self.dim)
            late = torch.arange(hi)[None, :] > torch.arange(lo, hi)[:, None]
            a = torch.softmax(s.masked_fill(late, float("-inf")), -1).sum(dim=(0, 1))
            a = torch.nn.functional.pad(a, (0, n - hi))
            out.append(a / a.max())
        return torch.stack(out)

    def request(self, ids, spans, answer, ratios) -> dict[str, float]:
        x = torch.tensor([ids + answer])
        n = x.shape[1]
        doc_of = torch.full((n,), -1)
        sinks = torch.zeros(n, dtype=torch.bool)
        for d, (s, e) in enumerate(spans):
            doc_of[s:e] = d
            sinks[s : s + SINKS] = True
        head, lo, hi = spans[0][0], spans[-1][1], len(ids)
        self.rows = (lo, hi)

        def nll(logits) -> float:
            lg = logits[0, hi - 1 : hi - 1 + len(answer)].float()
            return -float(torch.log_softmax(lg, -1)[torch.arange(len(answer)), answer].sum())

        everyone = torch.ones(n, dtype=torch.bool)
        logits, full = self.forward(x, doc_of, head, everyone)
        result = {"full": nll(logits)}
        attention = self.reads(full, lo, hi)
        full_kv = [(lay.keys[0].clone(), lay.values[0].clone()) for lay in full.layers]
        logits, alone = self.forward(x, doc_of, head, sinks)
        result["none"] = nll(logits)
        probe = self.reads(alone, lo, hi)
        moved = []
        for (kf, vf), lay in zip(full_kv, alone.layers, strict=True):
            d = (kf - lay.keys[0]).pow(2).sum(dim=(0, 2)) + (vf - lay.values[0]).pow(2).sum(
                dim=(0, 2)
            )
            moved.append(d / d.max())
        v1 = (full_kv[1][1] - alone.layers[1].values[0]).pow(2).sum(dim=(0, 2))
        scores = {
            "deviation": torch.stack(moved).sum(0),
            "attention": attention[1:].sum(0),
            "probe": probe[1:].sum(0),
            "layer1": v1 / v1.max() + probe[1],
        }
        candidates = (doc_of >= 0) & ~sinks
        for r in ratios:
            top = math.ceil(r * int(candidates.sum()))
            for name in self.rules:
                score = scores[name]
                score = score.masked_fill(~candidates, -1.0)
                chosen = ~candidates
                chosen[torch.topk(score, top).indices] = True
                logits, _ = self.forward(x, doc_of, head, chosen)
                result[f"{name}@{r:g}"] = nll(logits)
        return result


if __name__ == "__main__":
    main()
