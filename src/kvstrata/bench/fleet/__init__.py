"""`kvstrata bench fleet`: N `kvstrata serve` replicas behind a real router
(vllm-router, the `fleet` extra), a multi-tenant workload replayed under each routing
policy, the same requests at the same times.

Policies (each on a fresh fleet: the replicas' caches and Redis start empty):
  round_robin          the router's round robin: every replica sees every tenant
  cache_aware          the router's own approximate text tree
  kv_aware             the router scores replicas by the KV events kvstrata publishes
                       (vLLM's wire format: device, host, disk and remote blocks)
  round_robin+remote   round robin, the replicas sharing a Redis remote tier
  kv_aware+remote      kv_aware, the replicas sharing a Redis remote tier

Workload: T tenants, each a long system prompt of real text (the embedded model's
held-out stdlib files), a short question and a short greedy answer. A warm-up asks each
tenant once (N at a time: a router that weighs load spreads them), then the measured
phase sends R requests of random tenants at Poisson arrival times (open loop), through
the router, streamed with the official openai client. Each replica's device and host
budgets hold about T / N tenants' prompts (`--hold`), so where a request lands decides
whether its prefix is found.

Reported per policy: TTFT p50 / p90 / p99, requests/s and output tokens/s of the measured
phase, where its prompt tokens were found (device, host, disk, remote tier, recomputed:
the replicas' `kvstrata_prefix_hit_tokens` and `kvstrata_prompt_tokens` counters), and
how many greedy answers equal the first policy's (lossless tiers: all of them); the
ratios of round_robin's TTFT p90 over each other policy's. Progress on stderr, a table,
`--json`, `--plot` (matplotlib, the `report` extra).

The package: command (flags and the run), processes (replicas, router, Redis and their
counters), workload (what is asked, and the summaries), report (the table, the ratios,
the figure).
"""

from kvstrata.bench.fleet.command import HELP, IN_ALL, NAME, add_arguments, measure, run

__all__ = ["HELP", "IN_ALL", "NAME", "add_arguments", "measure", "run"]
