"""host_pressure="auto" under `TieredCache`: each forward lets the store adapt its host
budget first (store/pressure.py), and greedy decoding keeps its tokens while the host
tier goes down to disk and comes back."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_models import tiny_model
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.platform.memory_pressure import MemoryReading
from kvstrata.store.pressure import INTERVAL_S, HostPressure

KIB = 1024


class Reader:
    source = "test"
    available = 1 << 40

    def read(self) -> MemoryReading:
        return MemoryReading("test", 1 << 41, 0, self.available)


def _greedy(model, ids, cache, n, on_step=None):
    tokens = ids
    with torch.no_grad():
        logits = model(tokens, cache=cache).logits[:, -1]
        for step in range(n):
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            if on_step is not None:
                on_step(step)
            logits = model(nxt, cache=cache).logits[:, -1]
    return tokens


def test_decoding_keeps_its_tokens_while_the_host_tier_yields(tmp_path):
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(3, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    ref = _greedy(model, ids, DynamicCache(config=model.config), 60)
    enable(model)
    cache = TieredCache(
        model.config, block_size=16, max_tokens=512, resident_fraction=0.25,
        host_budget="4MiB", disk_dir=str(tmp_path), disk_budget="8MiB",
        host_pressure="auto", host_headroom="64KiB",
    )  # fmt: skip
    reader, clock = Reader(), iter(range(10**6))
    budgets = []

    def squeeze(step):
        store = cache.store
        if step == 0:
            store.pressure = HostPressure(
                store.manager, 64 * KIB, reader, lambda: next(clock) * INTERVAL_S
            )
            reader.available = 0  # the next forward's adapt moves the host tier down
        if step == 30:
            reader.available = 1 << 40  # memory freed: it grows back
        budgets.append(store.usage().occupancy["host"]["budget_blocks"])

    tokens = _greedy(model, ids, cache, 60, on_step=squeeze)
    assert torch.equal(tokens, ref)
    configured = budgets[0]
    assert min(budgets) == 0 and budgets[-1] == configured > 0
    p = cache.store.stats()["host_pressure"]
    assert p["decisions"]["shrink"] >= 1 and p["decisions"]["grow"] >= 1
    assert cache.store.usage().occupancy["disk"]["used_blocks"] > 0
