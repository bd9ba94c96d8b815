"""No measured figure is typed into the docs: a speed, a time, a ratio or a quality change
that a bench measured comes from a result file (`docs/results/*.json`, the evidence
report), rendered into a `<!-- results: NAME -->` region by scripts/docs_generate.py. A
typed one goes stale without failing anything.

What counts as a typed figure (outside fenced code blocks, inline code spans and
generated regions; generated pages are not checked): a ratio (`1.21×`, `1.2x`), a time
below a second or with decimals (`3 ms`, `40 µs`, `1.8 s`, `25–60 s`), a rate (`8 GB/s`,
`650 tok/s`), a signed or fractional percentage (`+0.51 %`, `0.19 %`). Limits, defaults
and targets are not figures: integer seconds (`timeout 10 s`), integer shares (`10 %` of
the KV on the device), a product (`4 × that`), and anything after `≥`, `≤`, `<`, `>`,
"at least", "at most" or "target". What is left and is not a measurement is listed in
ALLOWED with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?×(?!\s*\d)"  # a ratio: 1.21×, 3× faster
    r"|(?<![\w.])\d+\.\d+x\b"  # 1.2x
    r"|(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)\b"  # 3.5 ms, 40 µs
    r"|(?<![\w.])\d+\.\d+\s?(?:s|min)\b"  # 1.8 s
    r"|(?<![\w.])\d+(?:\.\d+)?\s?[–-]\s?\d+(?:\.\d+)?\s?(?:s|min|minutes|×)(?!\w)"  # 25–60 s
    r"|(?<![\w.])\d[\d,.]*\s?(?:tok(?:ens)?/s|[KMG]i?B/s)"  # 8 GB/s, 650 tok/s
    r"|(?<![\w.])[+−]\d+(?:\.\d+)?\s?%"  # +0.51 %
    r"|(?<![\w.])\d+\.\d+\s?%"  # 0.19 %
)
BOUND = re.compile(r"(?:[≥≤<>]|at least|at most|targets?:?|default)\s*$")
REGION = re.compile(r"<!-- results: [\w-]+ -->\n.*?<!-- /results -->", re.S)

# Pages made by a program, not typed: checked by tests/docs/test_site.py instead.
GENERATED = ("reference/", "report/")

# page -> {the figure as matched: why it is not a typed measurement}; "*" is the page.
ALLOWED: dict[str, dict[str, str]] = {
    "MEASUREMENTS.md": {
        "*": "a dated log of past measurements, each with the commit that made it, "
        "kept as history (the code's comments used to quote them); not current figures",
    },
    "models.md": {
        "+0.2 %": "a published figure of another project (KVQuant on LLaMA-7B), cited",
        "+0.9 %": "a published figure of another project (FlexGen on LLaMA-7B), cited",
    },
    "numa.md": {
        "112 GB/s": "a published figure (local read bandwidth of a Xeon Platinum 8160), cited",
        "34 GB/s": "a published figure (its read bandwidth across sockets), cited",
        "3.3×": "the ratio of those two cited figures, an estimate",
        "1.5×": "the planner's pcie5 link over the cited cross-socket figure, an estimate",
        "35 GB/s": "a vendor's figure (Samsung's CXL 2.0 expander), cited",
        "90 ns": "a published figure (Pond's CXL latency adder, 70-90 ns), cited",
        "2–5×": "a published figure (three CXL expanders' latency over DRAM), cited",
        "5×": "the cited expander figure over the planner's nvme-gen4 link, an estimate",
    },
    "remote-tier.md": {
        "8×": "a rule: a read's deadline is 8 times the link model's prediction",
        "4×": "the same rule's consequence (a load that slow still wins 4 times over)",
        "0.2 s": "a constant: the reconnect back-off starts at 0.2 s and doubles",
    },
}


def figures(text: str) -> list[tuple[int, str]]:
    """(line number, figure) of every typed measured figure in a Markdown page."""
    text = REGION.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        line = re.sub(r"`[^`]*`", "``", line)
        for match in FIGURE.finditer(line):
            if not BOUND.search(line[: match.start()]):
                found.append((number, match.group(0)))
    return found


def test_no_measured_figure_is_typed_into_the_docs() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    typed = []
    for page in pages:
        rel = page.relative_to(ROOT / "docs").as_posix() if page.name != "README.md" else ""
        if rel.startswith(GENERATED):
            continue
        allowed = ALLOWED.get(rel or "README.md", {})
        if "*" in allowed:
            continue
        for number, figure in figures(page.read_text()):
            if figure not in allowed:
                typed.append(f"{page.relative_to(ROOT)}:{number}: {figure}")
    assert not typed, (
        "measured figures typed into the docs (render them from docs/results/ with "
        "scripts/docs_generate.py, or say it in words): " + "; ".join(typed)
    )


def test_the_check_tells_figures_from_limits() -> None:
    measured = [
        "decode 1.21× faster than `DynamicCache`",
        "a step took 3.5 ms",
        "the attention took 40 µs a layer",
        "it loaded in 6.1 s",
        "vLLM-CPU starts in 25–60 s",
        "the kernel reads 8 GB/s",
        "the engine ran 650.3 tok/s",
        "ΔPPL +0.51 % at 1/8",
        "ΔPPL −0.16 %",
        "a worst-layer error of 0.19 %",
        "| int8 | 1.02x |",
    ]
    for text in measured:
        assert figures(text), text
    limits = [
        "≤ 150 lines",
        "10 % of the KV on the device",
        "`remote_timeout` (default 0.5 s)",
        "a timeout of 10 s",
        "at most 4 × that",
        "target ≥ 0.95×",
        "at least 3× faster",
        "256×256 weights",
        "`GOMP_SPINCOUNT=200000` spins",
        "<!-- results: x -->\n1.5×\n<!-- /results -->",
        "```text\nloaded in 6.1 s\n```",
        "2 × 2,048 tokens",
        "version 0.1.2",
    ]
    for text in limits:
        assert not figures(text), text
