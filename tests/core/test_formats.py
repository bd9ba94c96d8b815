"""kvstrata.core.formats mirrors kvstrata/platform/csrc/common.h: enum values against the header
text (no compiler needed), struct layouts against the compiled library."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

import kvstrata
from kvstrata.core.formats import DType, FieldDesc, FieldFormat, PartDesc
from kvstrata.platform import native as _native

HEADER = Path(kvstrata.__file__).parent / "platform" / "csrc" / "common.h"


def _enum(name: str) -> dict[str, int]:
    body = re.search(rf"enum {name}\s*{{(.*?)}};", HEADER.read_text(), re.S)
    assert body, f"enum {name} not found in {HEADER}"
    return {m[1]: int(m[2]) for m in re.finditer(r"(\w+)\s*=\s*(\d+)", body[1])}


def test_enums_match_the_header() -> None:
    assert _enum("kv_dtype") == {f"KV_DTYPE_{m.name}": m.value for m in DType}
    assert _enum("kv_format") == {f"KV_FMT_{m.name}": m.value for m in FieldFormat}


def test_torch_dtype_codes() -> None:
    assert DType.of(torch.float32) is DType.F32
    assert DType.of(torch.float16) is DType.F16
    assert DType.of(torch.bfloat16) is DType.BF16
    assert DType.of(torch.float64) is None and FieldFormat.raw(torch.int8) is None
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # raw formats = dtypes
        assert FieldFormat.raw(dtype) == DType.of(dtype)


def _struct_members(struct: str) -> list[str]:
    body = re.search(rf"struct {struct}\s*{{(.*?)}};", HEADER.read_text(), re.S)
    assert body, f"struct {struct} not found in {HEADER}"
    names = []
    for decl in re.sub(r"//[^\n]*", "", body[1]).split(";"):  # "i64 a, b", "const void *p"
        names += re.findall(r"(\w+)\s*(?=,|$)", decl.strip())
    return names


def test_struct_members_match_the_header() -> None:
    assert _struct_members("kv_field") == [f[0] for f in FieldDesc._fields_]
    assert _struct_members("kv_part") == [f[0] for f in PartDesc._fields_]


@pytest.mark.skipif(not _native.available(), reason="no C++ compiler")
def test_struct_layout_matches_the_library() -> None:
    buf = (ctypes.c_int64 * 32)()
    n = _native.load().kv_abi_layout(buf, len(buf))
    want = [
        ctypes.sizeof(FieldDesc),
        *(getattr(FieldDesc, name).offset for name, _ in FieldDesc._fields_),
        ctypes.sizeof(PartDesc),
        *(getattr(PartDesc, name).offset for name, _ in PartDesc._fields_),
    ]
    assert list(buf[:n]) == want
