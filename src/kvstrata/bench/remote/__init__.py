"""`kvstrata bench remote`: two `kvstrata serve` processes sharing one real Redis.

One `redis-server` on a free loopback port (no persistence), server A and server B
(`kvstrata serve --remote-url` at it; B also has a disk tier), both driven over HTTP by
the official `openai` client (streamed greedy completions, end-of-sequence ignored).
Each repeat takes a fresh document (real text, --doc-tokens tokens + a short question):

  A          A answers it first (a cold prefill; its blocks go to Redis, write-behind)
  B cold     B answers it under a fresh cache_salt: another namespace, nothing local
             or remote to reuse (the remote lookup misses) — a cold B
  B remote   B answers it as A did: its blocks come from Redis (one batched read)
  B disk     B restarted (its disk tier persists its prefix cache at shutdown) answers
             it again: a hit on its own disk tier
  slow       B_slow (no disk, default settings) reaches Redis through a proxy that holds
             every answer chunk back --delay-ms and passes --link-mb-s MB/s: after one
             prefill teaches it this machine's prefill speed, the link model (its PINGs
             and a one-block probe read through the proxy) predicts loading slower than
             recomputing, so it recomputes (slow remote: A's document; slow cold: a
             fresh salt, B_slow's own cold run, which the verdict compares with). A
             link it refuses is re-measured in the background (tiers/remote_link.py),
             never with a request's own read

B cold and B remote alternate their order across repeats; every request waits until
the servers' write-behind queues are empty (kvstrata_remote_pending_bytes), so no
measurement shares the cores with another's writes. Reported: TTFT medians (with
the 1-minute load average at each request), speed-ups against B cold, greedy text
identical to B cold's, prompt tokens served from a cache (usage), the remote round
trip per block (kvstrata_remote_read_seconds over kvstrata_remote_hits from B's
/metrics), and for the slow link the cost rule's decisions and the figures it
compared (kvstrata_remote_link_*, kvstrata_remote_compute_tokens_per_second).

Time (smollm2, 4096-token documents, 2 cores): minutes per repeat; --quick (the tiny
embedded model, 512 tokens, 1 repeat) much less (docs/MEASUREMENTS.md).

The package: command (the options, the servers and the run), report (the summary and
the printed table).
"""

from kvstrata.bench.remote.command import HELP, IN_ALL, NAME, add_arguments, measure, run

__all__ = ["HELP", "IN_ALL", "NAME", "add_arguments", "measure", "run"]
