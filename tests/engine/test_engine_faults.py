"""Faults on the engine's real read path: bytes flipped in the disk tier's file while
requests are decoding. The bad block is detected by its checksum, never served; only
the request that owned it computes its KV again, and every request still gives the
tokens of an undisturbed run."""

from __future__ import annotations

import torch

from hf_models import tiny_model
from kvstrata.attention.runtime import AttentionRuntime
from kvstrata.engine import Engine, EngineConfig, SamplingParams

BS = 16


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 97, (90 + 7 * i,), generator=g).tolist() for i in range(n)]


def _flip_disk_block(runtime: AttentionRuntime, seq_id: int) -> bool:
    """Flip one byte inside the first disk block of `seq_id`; False if it has none."""
    disk = runtime.tiers["disk"]
    for group in range(len(runtime.groups)):
        for run in runtime.manager.runs((seq_id, group)):
            if run.tier == "disk":  # a byte in each layer's part of the block
                start = run.first_slot * disk.slot_bytes
                ends = [int(n) for n in disk._lens[run.first_slot].cumsum(0)]
                with open(disk.path, "r+b") as f:
                    for layer_start in [0, *ends[:-1]]:
                        f.seek(start + layer_start + 40)
                        byte = f.read(1)[0]
                        f.seek(start + layer_start + 40)
                        f.write(bytes([byte ^ 0x10]))
                return True
    return False


def _run_with_a_flip(tmp_path, monkeypatch, ps, **over) -> tuple[list, list, dict, float]:
    """Generate `ps` twice on one engine with a disk tier: undisturbed, then with one
    byte flipped, mid-generation, in a disk block of the sequence attention is about
    to read. Returns (undisturbed outputs, disturbed outputs, what happened, recomputes)."""
    sp = SamplingParams(max_tokens=24)
    kwargs = {
        "block_size": BS,
        "device_budget": "96KiB",
        "host_budget": "64KiB",
        "disk_budget": "4MiB",
        "disk_dir": str(tmp_path),
        "config": EngineConfig(preemption="off"),
        **over,
    }
    with Engine(tiny_model("llama"), **kwargs) as engine:
        want = engine.generate(ps, sp)
        assert engine.stats()["store"]["tiers"]["disk"]["peak_used_blocks"] > 0
        real = AttentionRuntime.attend
        state = {"calls": 0, "victims": [], "failed": set()}

        def attend(self, layer, seq_id, *args):
            state["calls"] += 1
            if state["calls"] > 10 and not state["victims"] and _flip_disk_block(self, seq_id):
                state["victims"].append(seq_id)
            try:
                return real(self, layer, seq_id, *args)
            except Exception:
                state["failed"].add(seq_id)
                raise

        monkeypatch.setattr(AttentionRuntime, "attend", attend)
        got = engine.generate(ps, sp)
        monkeypatch.undo()
        assert state["victims"], "no disk block was read mid-generation"
        assert engine.stats()["live_blocks"] == 0  # nothing leaked by the undone steps
        recomputes = engine.metrics.value("kvstrata_recomputes_total")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    return want, got, state, recomputes


def test_a_flipped_disk_byte_recomputes_only_the_request_that_owned_it(tmp_path, monkeypatch):
    # prefix caching off: every round computes and stores its blocks afresh
    _, _, _, recomputes = _run_with_a_flip(tmp_path, monkeypatch, _prompts(3), prefix_caching=False)
    # the owner alone computed its KV again; the others only redid the undone step
    assert recomputes == 1, recomputes


def test_a_flipped_byte_in_a_block_shared_through_the_prefix_cache(tmp_path, monkeypatch):
    """Three requests share a prompt prefix whose blocks the prefix cache holds once; a
    byte flipped in one of them on disk: each reader recomputes when it meets it, none
    is served the bad block, and the tokens are an undisturbed run's."""
    g = torch.Generator().manual_seed(11)
    common = torch.randint(3, 97, (80,), generator=g).tolist()
    ps = [common + torch.randint(3, 97, (10 + 7 * i,), generator=g).tolist() for i in range(3)]
    # a host tier small enough that blocks reach the disk although the prefix is held once
    # (the later requests wait for the first to compute it, then share it)
    over = {"device_budget": "64KiB", "host_budget": "8KiB"}
    _, _, state, recomputes = _run_with_a_flip(tmp_path, monkeypatch, ps, **over)
    assert state["failed"], state
    assert recomputes == len(state["failed"])  # each reader of the bad block, once
