"""kvstrata as vLLM's KV offloading backend (`pip install 'kvstrata[vllm]'`).

vLLM's OffloadingConnector loads `KvstrataOffloadingSpec` by name; kvstrata then
keeps vLLM's offloaded KV blocks on its tiers — a host arena (any codec: lossless,
int8, fp8, int4) and a durable, checksummed disk tier that a restarted server reuses:

    from vllm import LLM
    from kvstrata.integrations.vllm import kv_transfer_config

    llm = LLM(model=..., kv_transfer_config=kv_transfer_config(
        host_budget="4GiB", host_codec="int8", disk_dir="/var/cache/kvstrata",
        disk_budget="100GiB", disk_codec="int4-g32", disk_compress=True))

or on the command line (`vllm serve`): --kv-transfer-config '{"kv_connector":
"OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
{"spec_name": "KvstrataOffloadingSpec", "spec_module_path":
"kvstrata.integrations.vllm", "host_budget": "4GiB", ...}}'.

The settings are CacheConfig's field names (see options.py). How the pieces fit:
spec.py (what vLLM loads) -> manager.py (scheduler process) over store.py (index.py,
the host tier of region.py, the disk tier) and worker.py (worker process, pages.py);
plan.py is what both processes derive from vLLM's config.
"""

from __future__ import annotations

from typing import Any

from kvstrata.core.errors import MissingExtraError

try:
    import vllm  # noqa: F401 - the extra's presence is the point
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without vllm
    if exc.name is None or exc.name.split(".")[0] != "vllm":
        raise
    raise MissingExtraError(
        "kvstrata.integrations.vllm needs vLLM, which is not installed: "
        "pip install 'kvstrata[vllm]'"
    ) from exc

from kvstrata.integrations.vllm.options import VllmOptions  # noqa: E402
from kvstrata.integrations.vllm.spec import KvstrataOffloadingSpec  # noqa: E402

SPEC_NAME = "KvstrataOffloadingSpec"
SPEC_MODULE = "kvstrata.integrations.vllm"


def kv_transfer_config(**fields: Any) -> dict[str, Any]:
    """The `kv_transfer_config` that selects kvstrata in vLLM (`LLM(kv_transfer_config=
    ...)`, or `json.dumps` of it for `vllm serve --kv-transfer-config`).

    Args:
        **fields: the backend's settings: CacheConfig fields (host_budget, host_codec,
            disk_dir, disk_budget, disk_codec, disk_compress, disk_delta, policy,
            block_size) and model_key, stats_file; checked here (ConfigError) as vLLM
            will check them.

    Returns:
        A dict for vLLM's KVTransferConfig.
    """
    VllmOptions.from_extra_config(fields)
    extra = {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE, **fields}
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


__all__ = ["KvstrataOffloadingSpec", "SPEC_MODULE", "SPEC_NAME", "kv_transfer_config"]
