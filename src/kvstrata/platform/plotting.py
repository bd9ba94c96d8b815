"""matplotlib for the PNG figures of the report and the benches (the `report` extra)."""

from __future__ import annotations

from typing import Any

from kvstrata.core.errors import ConfigError


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display).

    Raises:
        ConfigError: matplotlib is not installed (names the extra).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(
            "the figures need matplotlib (not installed): pip install 'kvstrata[report]'"
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.grid": True, "grid.alpha": 0.3})
    return plt
