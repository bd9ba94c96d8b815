"""Fast CPU kernels for the quantizing codecs, and when they are used.

The kernels are plain C++ (`_kernels.cpp`, no torch headers, so g++ builds them in
~2 s) called through ctypes. The shared library is built once per machine and
source version into torch's extensions directory (`$TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions/<py>_cpu/`) and loaded once per process. Without a
compiler, or with `KVSTRATA_CODEC_KERNELS=0`, `kernel_call` returns False and the
codecs fall back to the eager torch reference in `_reference.py` (same bits,
30-100x slower).

Every tensor is passed as [H, rows, cols] (leading dims collapsed, see `as_3d`),
so one call covers all layers and heads of a run of blocks.
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

import torch

from kvstrata.errors import CodecError

_SOURCE = Path(__file__).with_name("_kernels.cpp")
_FLAGS = [
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-ffp-contract=off",
]
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Kernel work buffers hold one row of channels on the stack.
_MAX_DIM = 4096

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


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

    return Path(_get_build_directory("kvstrata_codecs", verbose=False))


def _library_path() -> Path:
    key = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_tag().encode()
    ).hexdigest()[:16]
    return _build_dir() / f"kvstrata_codecs_{key}.so"


def _build(target: Path) -> None:
    cxx = os.environ.get("CXX", "g++")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: concurrent processes never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cxx, *_FLAGS, str(_SOURCE), "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernel library, building it on first use; None when unavailable.

    Returns:
        The loaded library, or None (no compiler, build failure, or disabled with
        KVSTRATA_CODEC_KERNELS=0). A failure is warned about once per process.
    """
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("KVSTRATA_CODEC_KERNELS", "1") == "0":
            _tried = True
            return None
        try:
            path = _library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
            for name in ("int8", "int4v", "int4k", "fp8"):
                enc = getattr(lib, f"kv_{name}_enc")
                enc.argtypes = [ci, vp, i64, i64, vp, i64, vp, i64, vp, i64, i64, i64, i64, i64, ci]
                enc.restype = ci
                dec = getattr(lib, f"kv_{name}_dec")
                dec.argtypes = [ci, vp, i64, vp, i64, vp, i64, vp, i64, i64, i64, i64, i64, i64, ci]
                dec.restype = ci
            _lib = lib
        except (OSError, subprocess.CalledProcessError, ImportError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            warnings.warn(
                f"kvstrata codec kernels unavailable, using the slow torch fallback: "
                f"{detail.strip()[:300]}",
                RuntimeWarning,
                stacklevel=2,
            )
        _tried = True
        return _lib


def available() -> bool:
    """True when the fast kernels are loaded (or can be built now)."""
    return load() is not None


def as_3d(t: torch.Tensor, *, row_contiguous: bool) -> tuple[int, int, int] | None:
    """Describe t [..., rows, cols] as (heads, head_stride, row_stride) in elements.

    Args:
        t: a tensor whose last dim is contiguous.
        row_contiguous: also require row stride == cols (codec fields).

    Returns:
        (H, head stride, row stride), or None when the leading dims cannot be
        collapsed into one strided dim (the caller then uses the eager path).
    """
    if t.dim() < 2 or t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride = t.stride(-2) if rows > 1 else cols
    if row_contiguous and row_stride != cols:
        return None
    lead = [(s, st) for s, st in zip(t.shape[:-2], t.stride()[:-2], strict=True) if s != 1]
    heads = 1
    for s, _ in lead:
        heads *= s
    if not lead:
        return 1, 0, row_stride
    for (_, outer), (size, inner) in zip(lead, lead[1:], strict=False):
        if outer != inner * size:
            return None
    return heads, lead[-1][1], row_stride


def kernel_call(
    op: str,
    direction: str,
    raw: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
) -> bool:
    """Run kernel `kv_<op>_<direction>` on a run of blocks, if it can take the tensors.

    Args:
        op: "int8", "int4v", "int4k" or "fp8".
        direction: "enc" (raw -> fields) or "dec" (fields -> raw).
        raw: x to encode or the decode output, [..., R, D] in fp32/fp16/bf16.
        data, scale, zero: the codec fields [..., rows, cols] (zero may be None).
        group: the group size (int4) or block size (fp8); ignored by int8.

    Returns:
        True when the kernel ran; False when the eager path must be used instead
        (kernels unavailable, unsupported dtype, or tensors not collapsible).

    Raises:
        CodecError: non-finite input, or a scale/zero point beyond the fp16 range.
    """
    lib = load()
    if lib is None or raw.dtype not in _DTYPE_CODE or raw.device.type != "cpu":
        return False
    if raw.shape[-1] > _MAX_DIM:
        return False
    zero_t = zero if zero is not None else scale
    geo_raw = as_3d(raw, row_contiguous=False)
    geos = [as_3d(t, row_contiguous=True) for t in (data, scale, zero_t)]
    if geo_raw is None or any(g is None for g in geos):
        return False
    heads = geo_raw[0]
    if any(g[0] != heads for g in geos):
        return False
    rows, dim = raw.shape[-2], raw.shape[-1]
    threads = torch.get_num_threads()
    code = _DTYPE_CODE[raw.dtype]
    (_, dsh, _), (_, ssh, _), (_, zsh, _) = geos
    fn = getattr(lib, f"kv_{op}_{direction}")
    if direction == "enc":
        flags = fn(
            code, raw.data_ptr(), geo_raw[1], geo_raw[2], data.data_ptr(), dsh,
            scale.data_ptr(), ssh, zero_t.data_ptr(), zsh, heads, rows, dim, group, threads,
        )  # fmt: skip
    else:
        flags = fn(
            code, data.data_ptr(), dsh, scale.data_ptr(), ssh, zero_t.data_ptr(), zsh,
            raw.data_ptr(), geo_raw[1], geo_raw[2], heads, rows, dim, group, threads,
        )  # fmt: skip
    raise_for_flags(flags)
    return True


def raise_for_flags(flags: int) -> None:
    """Turn a kernel's status bits into the CodecError the eager path would raise."""
    if flags & 1:
        raise CodecError("cannot encode non-finite K/V (inf or NaN in the input)")
    if flags & 2:
        raise CodecError(
            "K/V values exceed the fp16 range of the scale/zero point (|x| > 65504); "
            "use the 'none' or 'fp8' codec for this model"
        )
    if flags < 0:
        raise CodecError(f"codec kernel failed with status {flags}")
