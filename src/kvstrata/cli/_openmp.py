"""How `kvstrata serve`'s OpenMP workers wait: set before torch loads (no torch here).

`import kvstrata` makes idle OpenMP workers sleep at once (OMP_WAIT_POLICY=PASSIVE),
right for a library that shares the machine. A server owns its cores, and a step is
hundreds of short parallel regions (the projections, the attention, torch's
elementwise ops): waking a sleeping worker for each costs more than the work. So the
CLI, before it builds its parser (which loads torch), lets a server's workers spin up
to SERVE_SPINCOUNT (libgomp's GOMP_SPINCOUNT, a few milliseconds) before they sleep,
which shortens both the decode step and the prefill on idle cores (the figures:
docs/MEASUREMENTS.md). Only when the environment named no policy itself (the marker
`import kvstrata` leaves) and no spin count.
"""

from __future__ import annotations

import os
import sys

SERVE_SPINCOUNT = "200000"


def spin_briefly() -> bool:
    """Set GOMP_SPINCOUNT for a server; whether it was set."""
    env = os.environ
    ours = env.get("KVSTRATA_OMP_DEFAULTED") == "1" and env.get("OMP_WAIT_POLICY") == "PASSIVE"
    if "torch" in sys.modules or not ours or "GOMP_SPINCOUNT" in env:
        return False
    env["GOMP_SPINCOUNT"] = SERVE_SPINCOUNT
    return True
