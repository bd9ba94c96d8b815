"""The import contract of src/kvstrata, read from the code's own imports (ast, no import
of the package): the layers bottom-up, and the checks test_architecture.py runs (with
the size of a room, its few long modules, and the formatter's few escapes).

Every import of a kvstrata module counts: at module level, inside functions, under
`if TYPE_CHECKING:`. A module may import its own layer's modules (without a cycle) and
the layers below it, never one above or beside it. The package root (`kvstrata/__init__`)
is the public facade over all layers and is not a layer.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Bottom-up. A tuple is one level of siblings that must not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("platform",),
    ("codecs",),
    ("config",),
    ("model",),
    ("tiers",),
    ("blocks",),
    ("attention",),
    ("store",),
    ("integrations",),
    ("workload",),
    ("engine", "quality"),
    ("server",),
    ("bench",),
    ("report",),
    ("cli",),
]
# Layers where a function may import a kvstrata module (lazy loading for CLI start-up).
LAZY_OK = {"cli", "bench", "report"}
# Function-level imports elsewhere, each for an optional extra: (importer, imported) -> why.
LAZY_EXTRAS = {
    ("server", "server.app"): "FastAPI and uvicorn (the serve extra)",
    ("server.kv_events.publisher", "server.kv_events.wire"): "msgspec (the fleet extra)",
}

# A module is a room of at most MAX_LINES lines. One that grows past it is split by noun
# (what its parts are), never by line count; the few that are long for a reason are
# listed here, path under src/kvstrata -> why. An entry goes when its module shrinks.
MAX_LINES = 500
LONG_MODULES = {
    "config.py": "CacheConfig and its field checks: every field checked at construction",
}
# `# fmt: skip` / `# fmt: off` lines in src/kvstrata: the formatter formats the code; a
# marker is kept only for a table (an aligned literal of rows) clearer by hand.
MAX_FORMAT_MARKERS = 20


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted under kvstrata ("store.kvstore")
    dst: str  # imported module
    line: int
    kind: str  # "top", "function" or "type-checking"

    def __str__(self) -> str:
        return f"kvstrata.{self.src}:{self.line} imports kvstrata.{self.dst} ({self.kind})"


def modules(root: Path) -> dict[str, Path]:
    """Dotted name (under the package) -> file, for every module below `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(cur: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = cur.split(".") if cur else []
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        stem = ".".join(["kvstrata", *base, *([node.module] if node.module else [])])
    else:
        stem = node.module or ""
    return [stem] + [f"{stem}.{a.name}" for a in node.names]


def edges(root: Path) -> list[Edge]:
    """Every import of one kvstrata module by another (the root facade excluded)."""
    mods = modules(root)
    found = []
    for name, path in mods.items():
        if not name:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        kinds: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for sub in node.body:
                    kinds.update({id(x): "type-checking" for x in ast.walk(sub)})
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for x in ast.walk(node):
                    kinds.setdefault(id(x), "function")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            seen = set()
            for target in _targets(name, path.name == "__init__.py", node):
                if not target.startswith("kvstrata"):
                    continue
                dotted = target.removeprefix("kvstrata").lstrip(".")
                while dotted and dotted not in mods:
                    dotted = dotted.rpartition(".")[0]
                if dotted == name or dotted in seen:
                    continue
                seen.add(dotted)
                found.append(Edge(name, dotted, node.lineno, kinds.get(id(node), "top")))
    return found


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module's layer (None: the facade or an unknown room)."""
    top = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return None


def violations(root: Path) -> list[str]:
    """What breaks the contract: unknown rooms, imports upward or sideways, function-level
    imports of kvstrata below the CLI layers, and import cycles (any kind of import)."""
    mods = modules(root)
    bad = [f"kvstrata.{m} is in no layer" for m in mods if m and layer_of(m) is None]
    graph: dict[str, set[str]] = {m: set() for m in mods if m}
    for e in edges(root):
        if e.dst == "":
            bad.append(f"{e}: imports the package facade; import the module that owns it")
            continue
        src_pkg, dst_pkg = e.src.split(".")[0], e.dst.split(".")[0]
        ls, ld = layer_of(e.src), layer_of(e.dst)
        if src_pkg != dst_pkg and ls is not None and ld is not None and ld >= ls:
            where = "upward" if ld > ls else "sideways"
            bad.append(f"{e}: {where} ({dst_pkg} is not below {src_pkg})")
        if e.kind == "function" and src_pkg not in LAZY_OK and (e.src, e.dst) not in LAZY_EXTRAS:
            bad.append(f"{e}: a function-level import below the CLI layers")
        if mods[e.dst].name != "__init__.py":
            graph[e.src].add(e.dst)
    bad += [f"import cycle: {' <-> '.join(sorted(c))}" for c in cycles(graph)]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out
