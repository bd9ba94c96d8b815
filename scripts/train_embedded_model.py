"""Train kvstrata's embedded default model: a tiny byte-level Llama on Python source.

The model is trained on CPU on the ``.py`` files of the running interpreter's standard
library (test directories and site-packages excluded), so anyone with the same Python can
rebuild it. A deterministic ~4 % of the files is held out for evaluation and listed in
``heldout_files.txt`` next to the weights so ``kvstrata eval`` can find held-out text.

Usage (the real run; it writes into the package dir only at the very end)::

    nohup .venv/bin/python scripts/train_embedded_model.py --threads 1 --minutes 65 \
        --steps 1500 --out src/kvstrata/checkpoints/kvstrata-code-tiny > runs/train.log 2>&1 &

A smoke run: ``--minutes 1 --steps 20 --seq-len 256 --out /tmp/kvs-smoke``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from kvstrata.workload.zoo import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    PAD_ID,
    build_byte_tokenizer,
    tiny_code_config,
)

# Directory names whose files are not training or held-out text: tests are noisy and huge,
# pydoc_data is one 750 kB generated string of prose, not code.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data"}
)
# A file is held out when the first byte of sha256(relative path) is below this (~3.7 % of bytes).
HELDOUT_THRESHOLD = 12
LN2 = math.log(2.0)


def list_files(root: Path) -> tuple[list[str], list[str]]:
    """Split the stdlib's .py files (sorted relative paths) into train and held-out.

    Args:
        root: The stdlib directory.

    Returns:
        (train, heldout) lists of POSIX relative paths, both sorted.
    """
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                rels.append(Path(dirpath, name).relative_to(root).as_posix())
    rels.sort()
    heldout = [r for r in rels if hashlib.sha256(r.encode()).digest()[0] < HELDOUT_THRESHOLD]
    held = set(heldout)
    return [r for r in rels if r not in held], heldout


def load_stream(root: Path, rels: list[str]) -> torch.Tensor:
    """Concatenate files as byte ids, each file followed by <eos>.

    Args:
        root: The stdlib directory.
        rels: Relative paths, in order.

    Returns:
        A 1-D int64 tensor of token ids.
    """
    chunks: list[bytes] = []
    for rel in rels:
        chunks.append((root / rel).read_bytes())
    parts = []
    eos = torch.tensor([EOS_ID], dtype=torch.int64)
    for data in chunks:
        if data:  # empty __init__.py files still get their <eos>
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64))
        parts.append(eos)
    return torch.cat(parts)


def lr_at(step: int, total: int, peak: float, warmup: int, time_frac: float = 0.0) -> float:
    """Linear warmup then cosine decay to 10 % of peak.

    Progress is the larger of the step fraction and the wall-time fraction, so a run slowed
    by a busy machine still anneals fully before --minutes runs out.

    Args:
        step: The current step (0-based).
        total: The planned (maximum) number of steps.
        peak: The peak learning rate.
        warmup: Warmup steps.
        time_frac: Fraction of the training wall budget used so far (0 = ignore time).

    Returns:
        The learning rate for this step.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, max((step - warmup) / max(1, total - warmup), time_frac))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


@torch.no_grad()
def heldout_bpb(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, windows: int) -> float:
    """Bits per byte on the first `windows` non-overlapping windows of the held-out stream.

    Targets that are <eos> separators are excluded so the figure is per source byte.

    Args:
        model: The model (put in eval mode here, back to train mode after).
        stream: Held-out token ids.
        seq_len: Window length.
        windows: Number of windows (fewer if the stream is short).

    Returns:
        Mean negative log2-likelihood per byte.
    """
    model.eval()
    total_nats, total_n = 0.0, 0
    n = min(windows, (stream.numel() - 1) // seq_len)
    for i in range(n):
        x = stream[i * seq_len : (i + 1) * seq_len].unsqueeze(0)
        y = stream[i * seq_len + 1 : (i + 1) * seq_len + 1]
        logits = model(input_ids=x).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        keep = y < 256
        total_nats += float(nll[keep].sum())
        total_n += int(keep.sum())
    model.train()
    return total_nats / max(1, total_n) / LN2


def save_model(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, heldout: list[str], out: Path
) -> None:
    """Write weights, config, generation config, tokenizer and held-out list into `out`.

    Args:
        model: The trained model.
        tok: The tokenizer.
        heldout: Held-out relative paths.
        out: Target directory (created).
    """
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(
        out
    )
    (out / "heldout_files.txt").write_text("".join(r + "\n" for r in heldout))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the CLI.

    Args:
        argv: Arguments (None = sys.argv).

    Returns:
        The parsed namespace.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="final model directory")
    p.add_argument("--minutes", type=float, default=65.0, help="wall budget; save when hit")
    p.add_argument("--steps", type=int, default=1500, help="planned steps (LR schedule)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows for bpb")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="periodic checkpoints")
    p.add_argument("--ckpt-minutes", type=float, default=10.0)
    p.add_argument("--resume", type=Path, default=None, help="checkpoint .pt to resume")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train and save the model; returns the process exit code."""
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = list_files(root)
    train = load_stream(root, train_files)
    held = load_stream(root, heldout_files)
    print(
        f"stdlib={root} train_files={len(train_files)} train_bytes={train.numel()} "
        f"heldout_files={len(heldout_files)} heldout_bytes={held.numel()} "
        f"heldout_frac={held.numel() / (held.numel() + train.numel()):.4f}",
        flush=True,
    )
    tok = build_byte_tokenizer()
    model = LlamaForCausalLM(tiny_code_config(dtype="float32"))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    # Window starts come from a private generator so data order depends only on the seed.
    gen = torch.Generator().manual_seed(args.seed)
    step = 0
    if args.resume is not None:
        state = torch.load(args.resume, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step = state["step"]
        print(f"resumed from {args.resume} at step {step}", flush=True)
    # Reserve time for the final held-out eval and the save inside the wall budget.
    budget_s = max(30.0, args.minutes * 60.0 - 90.0)
    last_ckpt = time.monotonic()
    max_start = train.numel() - args.seq_len - 1
    losses: list[float] = []
    lr = 0.0
    tokens_seen = step * args.batch * args.seq_len
    stopped_by = "steps"
    bar = tqdm(total=args.steps, initial=step, mininterval=5.0, file=sys.stderr)
    while step < args.steps:
        time_frac = (time.monotonic() - t0) / budget_s
        if time_frac >= 1.0:
            stopped_by = "minutes"
            break
        lr = lr_at(step, args.steps, args.lr, args.warmup, time_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, max_start, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq_len] for s in starts.tolist()])
        y = torch.stack([train[s + 1 : s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, BYTE_VOCAB_SIZE), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}")
        if step % args.log_every == 0:
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            print(
                f"step={step} loss={recent:.4f} bpb={recent / LN2:.4f} lr={lr:.3e} "
                f"elapsed_s={time.monotonic() - t0:.1f} "
                f"s_per_step={(time.monotonic() - t0) / max(1, len(losses)):.3f}",
                flush=True,
            )
        if args.ckpt_dir is not None and time.monotonic() - last_ckpt > args.ckpt_minutes * 60:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = args.ckpt_dir / "ckpt.pt.tmp"
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "gen": gen.get_state(),
                    "step": step,
                },
                tmp,
            )
            os.replace(tmp, args.ckpt_dir / "ckpt.pt")
            last_ckpt = time.monotonic()
            print(f"checkpoint step={step} -> {args.ckpt_dir / 'ckpt.pt'}", flush=True)
    bar.close()
    train_wall = time.monotonic() - t0
    eval_seq = min(2048, args.seq_len * 2) if args.seq_len < 2048 else args.seq_len
    bpb = heldout_bpb(model, held, eval_seq, args.eval_windows)
    tail = losses[-50:] if losses else [float("nan")]
    report = {
        "model": "kvstrata-code-tiny",
        "params": n_params,
        "steps": step,
        "planned_steps": args.steps,
        "stopped_by": stopped_by,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "tokens_seen": tokens_seen,
        "train_wall_s": round(train_wall, 1),
        "threads": torch.get_num_threads(),
        "final_train_loss_nats": round(sum(tail) / len(tail), 4),
        "heldout_bits_per_byte": round(bpb, 4),
        "heldout_eval_seq_len": eval_seq,
        "heldout_eval_windows": min(args.eval_windows, (held.numel() - 1) // eval_seq),
        "heldout_files": len(heldout_files),
        "train_files": len(train_files),
        "train_bytes": int(train.numel()),
        "data": "python stdlib .py files, test dirs and site-packages excluded",
        "python": sys.version.split()[0],
        "seed": args.seed,
        "lr": args.lr,
        "lr_schedule": "warmup + cosine to 10 % over max(step, wall-time) fraction",
        "final_lr": lr if losses else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps(report), flush=True)
    # Save to a temp dir beside the target and swap in, so a half-written model never sits
    # at the final path.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".tmp-", dir=args.out.parent))
    save_model(model, tok, heldout_files, tmp_dir)
    (tmp_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    # mkdtemp makes 0700; the package dir must be readable like any other installed file.
    tmp_dir.chmod(0o755)
    for f in tmp_dir.iterdir():
        f.chmod(0o644)
    if args.out.exists():
        shutil.rmtree(args.out)
    os.replace(tmp_dir, args.out)
    print(f"saved to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
