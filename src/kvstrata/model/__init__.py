"""What the tiers need to know of a model: KV geometry (from a transformers config, a
config.json or a preset), dtypes, layer groups, per-tier budgets and the support check.
Loading real models and the memory planner live above the integrations, in
`kvstrata.workload`."""
