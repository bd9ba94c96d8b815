"""The engine's part of `make demo`: several long-context requests answered at once
by one engine whose device budget holds a fraction of their KV.

Each request is a different real document (held-out sources shipped with the
project; Python's own stdlib sources) with a question after it (chat models; the
byte model continues the code); what the requests share (the chat template's
system prompt) is a prefix hit for all but the first.
Shown: the answers, a live one-line status while they run, the tier occupancy, the
prefix hits, the device memory saved against keeping every request's KV resident,
and the check that every answer equals the same request run alone through
transformers' `DynamicCache` (lossless codecs: exact).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kvstrata.core.units import format_bytes

INTRO = "Here is a source file:\n\n"
QUESTION = "\n\nIn one or two sentences, what is this file for?"


def documents(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """`count` real documents of about `tokens` tokens each."""
    import sysconfig

    from kvstrata.workload.zoo import heldout_files

    paths = list(heldout_files("default"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths += [stdlib / n for n in ("textwrap.py", "heapq.py", "bisect.py", "shlex.py")]
    docs = []
    for path in paths:
        if len(docs) == count:
            break
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:tokens]
        if len(ids) >= tokens // 2:
            docs.append(tokenizer.decode(ids))
    return docs


def request_ids(tokenizer: Any, doc: str) -> list[int]:
    """The prompt of one request: chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": INTRO + doc + QUESTION}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    return list(tokenizer("# " + INTRO.strip() + "\n" + doc)["input_ids"])


def run(
    model_name: str = "default",
    requests: int = 4,
    doc_tokens: int = 1024,
    max_tokens: int = 48,
    device_fraction: float = 0.25,
    console: Any = None,
) -> bool:
    """Run the demo; returns True when every answer equals its solo DynamicCache run."""
    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import DynamicCache

    from kvstrata.engine import Engine, EngineConfig, SamplingParams
    from kvstrata.workload.zoo import load_model

    console = console or Console()
    model, tok = load_model(model_name)
    ref_model, _ = load_model(model_name)
    prompts = [request_ids(tok, d) for d in documents(tok, requests, doc_tokens)]
    params = SamplingParams(max_tokens=max_tokens)
    bs = 32
    from kvstrata.codecs.registry import get_codec
    from kvstrata.model.budgets import blocks_for_context, group_layout, model_groups
    from kvstrata.model.geometry import KVGeometry

    layout = group_layout(KVGeometry.from_hf_config(model.config), bs, model.dtype)
    block_bytes = get_codec("none").block_nbytes(layout)  # one block of one layer group
    # every layer group's blocks (a sliding group holds its window only)
    groups = model_groups(model)
    total_blocks = sum(blocks_for_context(groups, len(p) + max_tokens, bs) for p in prompts)
    device_blocks = max(int(device_fraction * total_blocks), 2 * len(prompts))
    engine = Engine(
        model,
        tok,
        block_size=bs,
        device_budget=device_blocks * block_bytes,
        host_budget=2 * total_blocks * block_bytes,
        config=EngineConfig(max_num_seqs=len(prompts), preemption="off"),
    )
    console.print(
        f"[bold]{len(prompts)} requests at once[/bold] ({', '.join(str(len(p)) for p in prompts)} "
        f"prompt tokens), device budget {format_bytes(device_blocks * block_bytes)} = "
        f"{device_blocks / total_blocks:.0%} of their KV, the rest in host RAM"
    )
    done = threading.Event()
    outputs: dict[int, Any] = {}
    finished: list[int] = []
    t0 = time.perf_counter()

    def watcher(i: int):
        def on_output(out: Any) -> None:  # outputs are deltas: add them up
            whole = outputs.setdefault(i, out)
            if whole is not out:
                whole.token_ids += out.token_ids
                whole.text += out.text
                whole.finish_reason, whole.cached_tokens = out.finish_reason, out.cached_tokens
            if out.finished:
                finished.append(i)
                if len(finished) == len(prompts):
                    done.set()

        return on_output

    try:
        for i, p in enumerate(prompts):
            engine.submit(p, params, on_output=watcher(i))
        with console.status("") as status:
            while not done.wait(0.25):
                s = engine.stats()
                tiers = s.get("store", {}).get("tiers", {})
                occ = ", ".join(
                    f"{t} {o['used_blocks']}/{o['budget_blocks']}" for t, o in tiers.items()
                )
                status.update(
                    f"running {s['running']}, waiting {s['waiting']}, finished {len(finished)}"
                    f"/{len(prompts)}, blocks {occ}, {time.perf_counter() - t0:.1f} s"
                )
        seconds = time.perf_counter() - t0
        stats = engine.stats()["store"]
    finally:
        engine.shutdown()
    exact = []
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = ref_model.generate(
                torch.tensor([p]),
                max_new_tokens=max_tokens,
                do_sample=False,
                cache=DynamicCache(config=ref_model.config),
            )[0, len(p) :].tolist()
        exact.append(outputs[i].token_ids == ref[: len(outputs[i].token_ids)])
    table = Table(title=f"answers ({seconds:.1f} s for all)")
    for col in ("request", "prompt tokens", "cached", "answer", "= DynamicCache"):
        table.add_column(col)
    for i, p in enumerate(prompts):
        out = outputs[i]
        answer = " ".join(out.text.split())[:90]
        table.add_row(str(i), str(len(p)), str(out.cached_tokens), answer, str(exact[i]))
    console.print(table)
    peak_dev = stats["tiers"][next(iter(stats["tiers"]))]["peak_used_blocks"] * block_bytes
    resident = total_blocks * block_bytes
    hits = stats["prefix"]["hit_tokens_by_tier"]
    moved = format_bytes(sum(stats["bytes_moved"].values()))
    console.print(
        f"device KV peak {format_bytes(peak_dev)} vs {format_bytes(resident)} all-resident "
        f"({1 - peak_dev / resident:.0%} saved); moved {moved} between tiers; prefix hits: "
        + (", ".join(f"{n} tokens from {tier}" for tier, n in hits.items()) or "none")
    )
    return all(exact)
