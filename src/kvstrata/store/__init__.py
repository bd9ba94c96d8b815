"""The transformers-free store: `KVStore` (tiers, block manager, prefix reuse) that many
sequences share under one set of budgets, and the contract its adapters use."""

from kvstrata.store.kvstore import KVStore

__all__ = ["KVStore"]
