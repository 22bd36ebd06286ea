"""The structs that cross the kernels' ABI by address: each ``ctypes.Structure`` mirror in
``pagekv/kernels/abi.py`` equals its one declaration in ``csrc/kernels.h``, field by field, and
the compiler lays each out where ctypes does. The checks are also run on planted drifts, so a
broken check fails."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from pagekv.kernels import abi, build

needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")


def drift(mirror: type[ctypes.Structure], declared: list[tuple[str, type | str]]) -> list[str]:
    """How ``mirror``'s fields differ from a declaration of kernels.h (empty: none)."""
    fields = [(name, kind) for name, kind, *_ in mirror._fields_]
    if [name for name, _ in fields] != [name for name, _ in declared]:
        return [f"fields {[n for n, _ in fields]} != declared {[n for n, _ in declared]}"]
    found = []
    for (name, kind), (_, want) in zip(fields, declared, strict=True):
        same = kind.__name__ == want if isinstance(want, str) else kind is want
        if not same:
            found.append(f"{name}: {getattr(kind, '__name__', kind)} != declared {want}")
    return found


def layout(mirror: type[ctypes.Structure]) -> list[int]:
    """[sizeof, then each field's offset], as ctypes has it."""
    return [ctypes.sizeof(mirror), *(getattr(mirror, name).offset for name, *_ in mirror._fields_)]


def compiled_layout(mirrors: tuple[type[ctypes.Structure], ...], tmp: Path) -> list[list[int]]:
    """``layout`` of each mirror's namesake in kernels.h, as the compiler lays it out."""
    lines = []
    for mirror in mirrors:
        name = mirror.__name__
        lines.append(f'    std::printf("%zu\\n", sizeof({name}));')
        lines += [f'    std::printf("%zu\\n", offsetof({name}, {f}));' for f, *_ in mirror._fields_]
    source = tmp / "layout.cpp"
    source.write_text(
        '#include <cstddef>\n#include <cstdio>\n#include "kernels.h"\n'
        "int main() {\n" + "\n".join(lines) + "\n}\n"
    )
    program = tmp / "layout"
    compiler = build.find_compiler()
    assert compiler is not None
    subprocess.run(
        [compiler, "-std=c++17", f"-I{build.CSRC}", str(source), "-o", str(program)],
        check=True,
        capture_output=True,
    )
    numbers = [
        int(v)
        for v in subprocess.run(
            [str(program)], capture_output=True, text=True, check=True
        ).stdout.split()
    ]
    out = []
    for mirror in mirrors:
        count = 1 + len(mirror._fields_)
        out.append(numbers[:count])
        numbers = numbers[count:]
    return out


def test_every_struct_of_the_header_has_its_mirror_field_by_field() -> None:
    declared = build.structs()
    assert {m.__name__ for m in abi.MIRRORS} == set(declared)
    assert {"QuantRun", "QuantWeight", "StackLayer", "StepAttention"} <= set(declared)
    for mirror in abi.MIRRORS:
        assert drift(mirror, declared[mirror.__name__]) == [], mirror.__name__


@needs_compiler
def test_the_compiler_lays_each_struct_out_as_ctypes_does(tmp_path: Path) -> None:
    assert compiled_layout(abi.MIRRORS, tmp_path) == [layout(m) for m in abi.MIRRORS]


def test_a_drifted_mirror_is_caught() -> None:
    declared = build.structs()["QuantRun"]

    class Swapped(ctypes.Structure):
        _fields_ = [(name, ctypes.c_long) for name, _ in declared]
        _fields_[0], _fields_[1] = _fields_[1], _fields_[0]

    class Narrow(ctypes.Structure):
        _fields_ = [(name, ctypes.c_int) for name, _ in declared]

    assert drift(Swapped, declared) and drift(Narrow, declared)
    assert drift(abi.StackMatmul, build.structs()["StackLayer"])


@needs_compiler
def test_a_mirror_laid_out_otherwise_is_caught(tmp_path: Path) -> None:
    class StackMatmul(ctypes.Structure):  # the header's name, one field short
        _fields_ = [("quant", ctypes.c_void_p), ("unit", ctypes.c_long)]

    assert compiled_layout((StackMatmul,), tmp_path) != [layout(StackMatmul)]


def test_the_header_reading_takes_fields_and_refuses_what_it_cannot_mirror(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    header = tmp_path / "kernels.h"
    monkeypatch.setattr(build, "HEADER", header)
    header.write_text(
        "struct A {\n  const int64_t* p;  // a comment\n  int32_t n, m;\n  float x;\n};\n"
        "struct B { A a; long k; };\n"
    )
    build.structs.cache_clear()
    try:
        assert build.structs() == {
            "A": [
                ("p", ctypes.c_void_p),
                ("n", ctypes.c_int32),
                ("m", ctypes.c_int32),
                ("x", ctypes.c_float),
            ],
            "B": [("a", "A"), ("k", ctypes.c_long)],
        }
        for body in ("long k[4];", "C c;", "unsigned char u;"):
            header.write_text(f"struct A {{ {body} }};\n")
            build.structs.cache_clear()
            with pytest.raises(ValueError):
                build.structs()
    finally:
        build.structs.cache_clear()
