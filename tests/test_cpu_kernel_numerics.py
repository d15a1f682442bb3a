"""The C kernels compute the same numbers on every x86 kind (issue 59).

The legacy reciprocal approximations (`rcpps`, `rcpss`, `rsqrtps`, `rsqrtss`) are specified
only to 1.5 * 2^-12: Intel and AMD return different bits for the same input. gcc's
-ffast-math turns `1.0f / sqrtf(x)` and divisions into them (plus a Newton step), so the
w8a8 quantization's RMSNorm and the decode steps' norms rounded differently on an AMX Xeon than
on an AMD EPYC, and a test written on one kind failed on the other. The kernels are built
without them: the inverse root is a square root and a division, each correctly rounded, as
torch's `rsqrt`. The AVX-512 forms (`vrcp14ps`, `vrsqrt14ps`) are defined bit for bit by the
ISA and stay where the code asks for them.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from minisgl.kernels import cpu as cpu_native

CARD = "P2-005"
ITEM = "every-isa-level-builds-the-c-kernels-and-gives-the-same-results"
VENDOR_DEFINED = re.compile(r"\s(v?(?:rcp|rsqrt)(?:ps|ss))\s")


@pytest.mark.isa_paths  # each MINISGL_CPU_ISA level's build (noxfile.py)
@pytest.mark.card(CARD, ITEM)
def test_the_c_kernels_use_no_vendor_defined_reciprocal_approximation() -> None:
    if shutil.which("objdump") is None or cpu_native._compiler() is None:
        pytest.fail("needs objdump and a C compiler to read the kernels' instructions")
    lib = cpu_native.build()
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    assert "vfmadd" in text or "mulss" in text  # the disassembly is of real code
    found = sorted({m.group(1) for m in VENDOR_DEFINED.finditer(text)})
    assert found == [], f"vendor-defined approximations in {lib.name}: {found}"
