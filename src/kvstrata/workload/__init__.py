"""What to run and how big: the model zoo (the embedded model, GGUF conversion), prompt
corpora, and the memory planner (geometry + hardware + workload -> budgets and a
verdict). Application parts: bench, report, quality and the CLI use them; the tiers,
store and integrations do not."""
