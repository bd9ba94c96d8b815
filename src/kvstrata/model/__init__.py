"""The model side of planning: KV geometry (from a transformers config, a config.json, a
GGUF file or a preset), layer groups, per-tier budgets, the planner, and loading real
models (the embedded zoo, GGUF conversion, prompts)."""
