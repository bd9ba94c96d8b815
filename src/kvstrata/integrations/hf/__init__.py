"""transformers integration: `TieredCache` (a transformers `Cache` over a KVStore) and the
registered attention (`enable(model)`)."""

from kvstrata.integrations.hf.cache import ATTENTION_NAME, TieredCache, enable

__all__ = ["ATTENTION_NAME", "TieredCache", "enable"]
