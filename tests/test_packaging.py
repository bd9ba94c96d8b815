"""kvstrata as a user installs it: `python -m build` makes an sdist and a wheel (the wheel
built from the sdist, so the sdist is complete), and the wheel, installed into a fresh
virtualenv outside the checkout, imports, reports its version, plans and generates with
the shipped tiny model and the native sources it carries.

The wheel is installed with pip (no index, no dependencies); the fresh virtualenv sees
this environment's site-packages through a .pth line (torch and transformers are not
installed twice). A path listed in a .pth is not itself a site directory, so the
checkout's editable install of kvstrata stays invisible there."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvstrata.core.version import __version__

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="the dev extra's `build` makes the wheel")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=out)
    return out


def test_build_gives_an_sdist_and_a_wheel_that_carry_the_model_and_native_sources(dist):
    sdists = list(dist.glob(f"kvstrata-{__version__}.tar.gz"))
    wheels = list(dist.glob(f"kvstrata-{__version__}-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    tiny = "kvstrata/checkpoints/kvstrata-code-tiny/"
    for need in ("model.safetensors", "config.json", "tokenizer.json"):
        assert tiny + need in names
    csrc = {Path(n).name for n in names if n.startswith("kvstrata/platform/csrc/")}
    shipped = {p.name for p in (ROOT / "src/kvstrata/platform/csrc").iterdir()}
    assert {n for n in shipped if n.endswith((".cpp", ".h"))} <= csrc
    assert not any(n.startswith(("tests/", "scripts/")) for n in names)


def test_the_wheel_works_in_a_fresh_virtualenv_outside_the_checkout(dist, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    py, kvstrata = venv / "bin" / "python", str(venv / "bin" / "kvstrata")
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(py), "-c", purelib], tmp_path).strip())
    wheel = next(dist.glob("kvstrata-*.whl"))
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path)
    # after the install: pip must not see (nor touch) this environment's kvstrata
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(py), "-c", "import kvstrata; print(kvstrata.__file__)"], work)
    assert Path(where.strip()).is_relative_to(site), where
    assert _run([kvstrata, "--version"], work).strip() == f"kvstrata {__version__}"
    plan = _run([kvstrata, "plan", "--model", "llama-3-8b", "--json"], work)
    assert '"verdict"' in plan
    prompt = ["--prompt", "def add(a, b):", "--max-new-tokens", "8"]
    text = _run([kvstrata, "generate", "--model", "tiny", *prompt], work)
    assert text.strip()
