"""The dynamic offload ratio's done-when (issue #53, item 2): a real `kvstrata serve`
(host_pressure="auto", a host and a disk tier) in a real memory cgroup whose limit a
second process squeezes mid-run (tests/memory_squeeze.py): nothing is OOM-killed, no
request fails, every output equals the unsqueezed run's, and /metrics shows the host
tier's budget going down to disk and coming back."""

from __future__ import annotations

import os

import pytest

from memory_squeeze import HOST_BUDGET, MIB, SQUEEZE, MemoryCgroup, run

pytestmark = pytest.mark.slow


@pytest.fixture
def cgroup():
    made = MemoryCgroup.create(f"kvstrata-test-{os.getpid()}")
    if isinstance(made, str):
        pytest.skip(f"no memory cgroup to squeeze: {made}")
    yield made
    made.remove()


def test_the_host_tier_yields_to_a_squeezed_cgroup_and_takes_memory_back(cgroup, tmp_path):
    free = run(tmp_path / "free")
    squeezed = run(tmp_path / "squeezed", cgroup)

    assert free.error is None and squeezed.error is None, squeezed.error
    assert squeezed.oom_kills == 0 and squeezed.server_alive
    assert squeezed.squeezer_rc == 0  # the second process got its memory and left
    assert max(held for _, held in squeezed.squeezer) >= SQUEEZE
    assert squeezed.limit - squeezed.peak < SQUEEZE  # without yielding, an OOM kill
    assert squeezed.outputs == free.outputs and len(free.outputs) == 24 + 24 + 12

    samples = [s for _, s in squeezed.samples if "host_budget" in s]
    budgets = [s["host_budget"] for s in samples]
    low = min(budgets)
    assert budgets[0] == HOST_BUDGET and low <= HOST_BUDGET - 128 * MIB  # went to disk...
    after_low = budgets[budgets.index(low) :]
    assert max(after_low) >= low + 128 * MIB  # ...and came back
    last = samples[-1]
    assert last["shrinks"] >= 1 and last["grows"] >= 1 and last["released"] > 0
    assert last["disk_used"] > 0
    # the unsqueezed run never moved its budget
    assert {s["host_budget"] for _, s in free.samples if "host_budget" in s} == {HOST_BUDGET}
