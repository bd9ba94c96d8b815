"""The house in layers (DESIGN decision 9): imports only downward, no cycles, no
function-level imports of kvstrata below the CLI layers, rooms of a readable size (split
by noun; the few long ones listed in layering.LONG_MODULES), code the formatter formats."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvstrata.store.contract import EngineStore
from layering import (
    LAYERS,
    LONG_MODULES,
    MAX_FORMAT_MARKERS,
    MAX_LINES,
    edges,
    layer_of,
    violations,
)

ROOT = Path(__file__).resolve().parents[1] / "src" / "kvstrata"


def test_the_package_keeps_its_import_contract():
    assert violations(ROOT) == []


def test_every_room_is_a_layer_and_every_layer_is_used():
    rooms = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    named = {name for level in LAYERS for name in level}
    assert rooms == named


def test_no_module_is_longer_than_a_room_should_be():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert {m: n for m, n in long.items() if m not in LONG_MODULES} == {}
    assert sorted(set(LONG_MODULES) - set(long)) == []  # back under the cap: drop the entry


def test_the_formatter_formats_the_code():
    markers = [
        f"{p.relative_to(ROOT).as_posix()}:{i}"
        for p in sorted(ROOT.rglob("*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "# fmt: skip" in line or "# fmt: off" in line
    ]
    assert len(markers) <= MAX_FORMAT_MARKERS, markers


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kvstrata"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # the core importing the store: upward
            {
                "core/__init__.py": "",
                "core/units.py": "from kvstrata.store.kvstore import X\n",
                "store/__init__.py": "",
                "store/kvstore.py": "X = 1\n",
            },
            "kvstrata.core.units:1 imports kvstrata.store.kvstore (top): upward",
        ),
        (  # engine and quality are siblings
            {
                "engine/__init__.py": "",
                "engine/run.py": "import kvstrata.quality.evaluate\n",
                "quality/__init__.py": "",
                "quality/evaluate.py": "",
            },
            "kvstrata.engine.run:1 imports kvstrata.quality.evaluate (top): sideways",
        ),
        (  # a TYPE_CHECKING back-edge is still an upward import
            {
                "blocks/__init__.py": "",
                "store/__init__.py": "",
                "store/kvstore.py": "",
                "blocks/pool.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from kvstrata.store.kvstore import KVStore\n",
            },
            "kvstrata.blocks.pool:3 imports kvstrata.store.kvstore (type-checking): upward",
        ),
        (  # dodging a cycle with an import inside a function
            {
                "tiers/__init__.py": "",
                "tiers/disk.py": "def f():\n    from kvstrata.tiers import base\n",
                "tiers/base.py": "",
            },
            "kvstrata.tiers.disk:2 imports kvstrata.tiers.base (function): a function-level",
        ),
        (  # a cycle inside one layer
            {
                "tiers/__init__.py": "",
                "tiers/a.py": "from kvstrata.tiers import b\n",
                "tiers/b.py": "from kvstrata.tiers.a import x\n",
            },
            "import cycle: tiers.a <-> tiers.b",
        ),
        (  # a room outside the layer list
            {"misc/__init__.py": "", "misc/tool.py": ""},
            "kvstrata.misc is in no layer",
        ),
        (  # a relative import resolves like an absolute one
            {
                "codecs/__init__.py": "",
                "codecs/int8.py": "from ..engine import run\n",
                "engine/__init__.py": "",
                "engine/run.py": "",
            },
            "kvstrata.codecs.int8:1 imports kvstrata.engine.run (top): upward",
        ),
    ],
)
def test_a_planted_violation_is_reported(tmp_path, files, expected):
    found = violations(_plant(tmp_path, files))
    assert any(v.startswith(expected) for v in found), found


def test_the_checker_sees_the_real_edges():
    # a check that sees no imports could not fail: the store's own imports must be there
    found = {(e.src, e.dst) for e in edges(ROOT)}
    assert ("store.kvstore", "blocks.manager") in found
    assert layer_of("store.kvstore") > layer_of("blocks.manager")


def _store_attributes(path: Path) -> set[str]:
    """Attributes read on `store` / `self.store` in one module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "store") or (
            isinstance(base, ast.Attribute)
            and base.attr == "store"
            and isinstance(base.value, ast.Name)
            and base.value.id == "self"
        ):
            names.add(node.attr)
    return names


def test_the_engine_sees_the_store_only_through_its_contract():
    allowed = {n for n in dir(EngineStore) if not n.startswith("_")}
    used = {
        (path.name, name)
        for path in (ROOT / "engine").glob("*.py")
        for name in _store_attributes(path)
    }
    assert {name for _, name in used} >= {"capacity", "add_sequence", "demote"}  # it looks
    assert sorted((f, n) for f, n in used if n not in allowed) == []


def test_the_public_import_paths_keep_working():
    import kvstrata
    import kvstrata.engine
    import kvstrata.server
    import kvstrata.store

    assert kvstrata.TieredCache.__name__ == "TieredCache"
    assert kvstrata.KVStore is kvstrata.store.KVStore
    assert callable(kvstrata.enable) and callable(kvstrata.plan)
    assert kvstrata.Engine is kvstrata.engine.Engine
    assert callable(kvstrata.server.build_app)
    for name in ("CacheConfig", "SamplingParams", "EngineConfig", "get_codec", "load_geometry"):
        assert getattr(kvstrata, name) is not None, name
