"""The native kernel library: plain C++ in `kvstrata/platform/csrc/`, called through ctypes.

One shared library holds the codec kernels (`codecs.cpp`), the disk tier's vectored
I/O with XXH3-64 checksums (`pio.cpp`), the decode attention over tiered runs
(`attention.cpp`, `select.cpp`), the decode projections (`linear.cpp`) and the lean
forward's RoPE and RMSNorm (`elementwise.cpp`). No torch headers, so g++ builds it in a
few seconds. The XXH3 functions are not compiled in: `load()` hands `pio.cpp` the ones
the `xxhash` package's extension module exports (checked there against the package's
values); if that fails, the codec and attention kernels still load but `load_pio()` is None and
the disk tier takes its staged path, which hashes through the package. The library is
built once per machine and source version into torch's extensions directory
(`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions/<py>_cpu/`) and loaded
once per process. ctypes releases the GIL for the duration of every call.

Without a compiler, or with `KVSTRATA_NATIVE=0`, `load()` returns None and every
caller takes its pure torch/numpy path (same results, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["available", "load", "load_pio"]

_DIR = Path(__file__).with_name("csrc")
_COMMON = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-pthread", "-fno-math-errno"]
# Per-source flags. The codecs need -ffinite-math-only (vectorised min/max) and
# -ffp-contract=off (a*b+c rounds twice, bit-identical to torch eager); the attention
# kernel handles -inf (empty rows), so it must not assume finite math; it lets the
# compiler reorder its float sums (dot products, softmax sums) to vectorise them.
_SOURCES = {
    "codecs.cpp": [
        "-fno-trapping-math",
        "-ffinite-math-only",
        "-fno-signed-zeros",
        "-ffp-contract=off",
    ],
    "pio.cpp": [],
    "attention.cpp": ["-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"],
    "select.cpp": ["-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"],
    "linear.cpp": ["-fno-trapping-math", "-ffp-contract=off"],
    "elementwise.cpp": ["-fno-trapping-math", "-ffp-contract=off"],  # bit-identical to torch
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pio = False  # the XXH3 functions are installed in pio.cpp: kv_pio may run
_xxh3_lib: ctypes.CDLL | None = None  # kept open while its functions are in use

# The xxhash package's exports pio.cpp calls, in kv_pio_set_xxh3's argument order.
_XXH3_FUNCTIONS = (
    "XXH3_createState",
    "XXH3_freeState",
    "XXH3_64bits_reset",
    "XXH3_64bits_update",
    "XXH3_64bits_digest",
    "XXH3_64bits",
)
# Checked by kv_pio_set_xxh3 (one-shot and streamed) against the package's value:
# 5,000 bytes cross XXH3's size classes, its stripes and its 1 KiB blocks.
_XXH3_SAMPLE = bytes((i * 131 + (i >> 8) * 7) & 0xFF for i in range(5000))

_i64, _vp, _ci, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# name -> (argtypes, restype)
_SIGNATURES: dict[str, tuple[list, object]] = {}
for _name in ("int8", "int4v", "int4k", "fp8"):
    _enc = [_ci, _vp, _i64, _i64, _vp, _i64, _vp, _i64, _vp, _i64, _i64, _i64, _i64, _i64, _ci]
    _SIGNATURES[f"kv_{_name}_enc"] = (_enc, _ci)
    _dec = [_ci, _vp, _i64, _vp, _i64, _vp, _i64, _vp, _i64, _i64, _i64, _i64, _i64, _i64, _ci]
    _SIGNATURES[f"kv_{_name}_dec"] = (_dec, _ci)
# nparts, parts (kv_part array), q, out, lse, H, M, D, Dv, scale, softcap, threads
# (parts as an address: callers hold PartDesc arrays by address, and an int passes as a
# void pointer with no cast per call)
_SIGNATURES["kv_attn_decode"] = ([_ci, _vp, _vp, _vp, _vp] + [_i64] * 4 + [_f32, _f32, _ci], _ci)
# S, nparts (int per sequence), parts (kv_part array address per sequence), q, out, lse,
# H, M, D, Dv, scale, softcap, threads
_SIGNATURES["kv_attn_decode_batch"] = (
    [_ci, _vp, _vp, _vp, _vp, _vp] + [_i64] * 4 + [_f32, _f32, _ci],
    _ci,
)
# nparts, parts, part_start, q, out, lse, H, M, D, Dv, scale, softcap, summ, summ_fp16,
# row_max, summ_head_stride, summ_row_stride, W, page, c0, c1, choose, start, sink_end,
# recent_start, total, attended, chosen (or None), coarse (or None), coarse_head_stride,
# coarse_row_stride, group, nref, channels, scored (or None), threads
_SIGNATURES["kv_attn_select_decode"] = (
    [_ci, _vp]
    + [_vp] * 4
    + [_i64] * 4
    + [_f32, _f32, _vp, _ci, _ci]
    + [_i64] * 11
    + [_vp] * 3
    + [_i64] * 5
    + [_vp, _ci],
    _ci,
)
# x, w, bias (or None), y, M, K, N, threads
_SIGNATURES["kv_linear_small"] = ([_vp] * 4 + [_i64] * 3 + [_ci], _ci)
# q, q out, Hq, strides (4 int64: q's head and token strides, then its output's), k, k out,
# Hk, k's strides, T, D, cos, sin, cos/sin token stride
_SIGNATURES["kv_rope"] = (
    [_vp, _vp, _i64, _vp, _vp, _vp, _i64, _vp, _i64, _i64, _vp, _vp, _i64],
    _ci,
)
# x, var, weight, eps, y, rows, D
_SIGNATURES["kv_rms_scale"] = ([_vp, _vp, _vp, _f32, _vp, _i64, _i64], _ci)
_SIGNATURES["kv_abi_layout"] = ([ctypes.POINTER(_i64), _ci], _ci)
_SIGNATURES["kv_use_openmp"] = ([ctypes.c_char_p], _ci)
_SIGNATURES["kv_pio_limit_call_bytes"] = ([_i64], None)
# create, free, reset, update, digest, oneshot, sample, n, expect, expect_empty
_SIGNATURES["kv_pio_set_xxh3"] = ([_vp] * 7 + [_i64, ctypes.c_uint64, ctypes.c_uint64], _ci)
# fd, write, n, addr, len, foff, out_idx, sums, status, batch_bytes, threads
_SIGNATURES["kv_pio"] = ([_ci, _ci, _i64] + [_vp] * 6 + [_i64, _ci], _i64)


def _cpu_tag() -> str:
    # -march=native binaries must not be shared between different CPUs.
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return platform.machine() + flags


def _build_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("kvstrata_native", verbose=False))


def _library_path() -> Path:
    h = hashlib.sha256(" ".join(_COMMON).encode() + _cpu_tag().encode())
    for name, flags in _SOURCES.items():
        h.update(name.encode() + (_DIR / name).read_bytes() + " ".join(flags).encode())
    for header in sorted(_DIR.glob("*.h")):
        h.update(header.name.encode() + header.read_bytes())
    return _build_dir() / f"kvstrata_native_{h.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    cxx = os.environ.get("CXX", "g++")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Objects and the library are built under temporary names and renamed:
    # concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for name, flags in _SOURCES.items():
            obj = os.path.join(tmp, name + ".o")
            cmd = [cxx, *_COMMON, *flags, "-c", str(_DIR / name), "-o", obj]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            objects.append(obj)
        out = os.path.join(tmp, "lib.so")
        subprocess.run(
            [cxx, "-shared", "-pthread", *objects, "-o", out],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(out, target)


def _loaded_openmp() -> str | None:
    """Path of the OpenMP runtime torch loaded (libgomp, possibly renamed by the
    wheel), so the kernels run on torch's own thread team; None if there is none."""
    import torch  # noqa: F401 - loads the runtime

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().rsplit(" ", 1)[-1]
                if "/libgomp" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def _xxh3_library() -> str:
    """Path of the xxhash package's extension module (it exports the XXH3 API)."""
    import xxhash._xxhash

    return xxhash._xxhash.__file__


def _bind_xxh3(lib: ctypes.CDLL, path: str) -> str | None:
    """Hand `lib` (pio.cpp) the XXH3 functions the shared object at `path` exports.

    Returns:
        None when they are installed (and checked against the xxhash package), else
        why not; kv_pio then stays disabled.
    """
    import xxhash

    try:
        xxh = ctypes.CDLL(path)
        addrs = [ctypes.cast(getattr(xxh, name), ctypes.c_void_p).value for name in _XXH3_FUNCTIONS]
    except (OSError, AttributeError) as exc:
        return f"cannot take the XXH3 functions from {path}: {exc}"
    sample = ctypes.create_string_buffer(_XXH3_SAMPLE, len(_XXH3_SAMPLE))
    rc = lib.kv_pio_set_xxh3(
        *addrs,
        sample,
        len(_XXH3_SAMPLE),
        xxhash.xxh3_64_intdigest(_XXH3_SAMPLE),
        xxhash.xxh3_64_intdigest(b""),
    )
    if rc != 0:
        return f"the XXH3 functions of {path} do not match the xxhash package"
    global _xxh3_lib
    _xxh3_lib = xxh
    return None


def load() -> ctypes.CDLL | None:
    """The native library, building it on first use; None when unavailable.

    Returns:
        The loaded library, or None (no compiler, build failure, or disabled with
        KVSTRATA_NATIVE=0). A failure is warned about once per process. Its disk I/O
        (kv_pio) may still be disabled: see `load_pio`.
    """
    global _lib, _tried, _pio
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("KVSTRATA_NATIVE", "1") == "0":
            _tried = True
            return None
        try:
            path = _library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            gomp = _loaded_openmp()
            if gomp:
                lib.kv_use_openmp(gomp.encode())
            try:
                why = _bind_xxh3(lib, _xxh3_library())
            except ImportError as exc:
                why = f"the xxhash extension module cannot be imported: {exc}"
            _pio = why is None
            if why is not None:
                warnings.warn(
                    f"kvstrata native disk I/O unavailable, using the staged path: {why}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            _lib = lib
        except (OSError, subprocess.CalledProcessError, ImportError, AttributeError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            warnings.warn(
                f"kvstrata native kernels unavailable, using the slower torch/numpy paths: "
                f"{detail.strip()[:300]}",
                RuntimeWarning,
                stacklevel=2,
            )
        _tried = True
        return _lib


def load_pio() -> ctypes.CDLL | None:
    """The native library when its disk I/O (`kv_pio`, with XXH3-64 from the xxhash
    package) can run; None otherwise (then the disk tier stages its I/O in Python)."""
    lib = load()
    return lib if _pio else None


def available() -> bool:
    """True when the native kernels are loaded (or can be built now)."""
    return load() is not None
