"""transformers integration: `TieredCache` (a transformers `Cache` over a KVStore) and the
registered attention (`enable(model)`)."""

from kvstrata.integrations.hf.attention import ATTENTION_NAME, enable
from kvstrata.integrations.hf.cache import TieredCache

__all__ = ["ATTENTION_NAME", "TieredCache", "enable"]
