"""`kvstrata bench gpu`: the CUDA path measured on one GPU, one JSON report.

Run by scripts/gpu_check.sh (which first runs the gpu-marked tests and passes their
JUnit XML in with --tests-junit). Sections, each isolated (an error is reported in
its section and fails the run, the others still run):

1. links: host<->device copy GB/s, pinned and pageable, both directions (medians of
   CUDA-synchronised copies of --copy-mib), next to the `--link` preset of
   kvstrata.platform.hardware the planner and the LinkModel assume.
2. memory: peak `torch.cuda.max_memory_allocated` during decode above what was
   allocated before the cache existed — the KV working set: device tier + staging +
   transients — at each --memory-contexts with a fixed device budget and staging
   size; it must be flat (and close to budget + staging), where DynamicCache grows
   with the context.
3. decode: tok/s at each --contexts with --fractions of the context resident on the
   device and the rest on the (pinned) host, raw and through each --codecs over the
   link, next to DynamicCache at the same context; per variant the bytes that
   crossed PCIe per step, the step time against its PCIe bound (those bytes /
   the measured pinned H2D GB/s), the stall / hidden fractions of the staging loads,
   the attention kernel and how many times the fused Triton dequant ran
   (`fused_dequant`: kernel launches, counted). Greedy tokens are
   compared with DynamicCache's: the share that agree and the length of the equal
   prefix (once they diverge the rest differs; bf16 and int4 need not be identical —
   exactness in fp32 is what the gpu-marked tests check).

On CUDA the run is not ok unless the fused dequant was usable throughout: Triton
installed, the kernel never disabled, its gpu-marked tests not skipped, and every
variant with an int8 / int4 / fp8 host codec decoded by it at least once.

Model: a Llama slice (8 layers, hidden 2048, 16 query / 8 KV heads of 128, vocab 259:
32 KiB of bf16 KV per token, 2 GiB at 64k), random init. --budget-s bounds the run:
measurements not started by then are listed as skipped. With --out the report is
rewritten (temporary file, then rename) after every section and every measured row,
so a run killed by a timeout keeps what it measured (scripts/gpu_check.sh then marks
it with `mark_timed_out`). `--quick --device cpu` runs the whole harness at toy sizes
on the CPU (the tests do, to keep it working).

The package: command (the options, the run, the report file), setup (the harness),
sections (what each section measures), report (the report's GPU-free parts).
"""

from kvstrata.bench.gpu.command import (
    HELP,
    IN_ALL,
    NAME,
    add_arguments,
    mark_timed_out,
    measure,
    run,
    write_report,
)

__all__ = [
    "HELP",
    "IN_ALL",
    "NAME",
    "add_arguments",
    "mark_timed_out",
    "measure",
    "run",
    "write_report",
]
