"""Capabilities a test needs from the machine, and why a test that lacks one skips.

A skip here is missing evidence (cardgate holds the cards it binds), never a pass: the root
conftest skips a test marked `int8_matrix_unit` with `int8_matrix_unit_missing()`'s reason.
"""

from __future__ import annotations


def int8_matrix_unit_missing() -> str | None:
    """Why W8A8's int8 GEMM cannot run in this process (None where it can): the CPU, under the
    `MINISGL_CPU_ISA` level in force, has neither AMX-INT8 nor AVX512-VNNI (`w8a8_supported`),
    so W8A8 models refuse to load (the refusal tests cover that path)."""
    from minisgl.quantization import w8a8
    from minisgl.utils.cpu import isa_summary

    if w8a8.w8a8_supported():
        return None
    isa = isa_summary()
    features = ", ".join(isa["features"]) or "none of note"  # type: ignore[arg-type]
    return (
        f"int8_matrix_unit (missing evidence): no AMX-INT8 or AVX512-VNNI under "
        f"MINISGL_CPU_ISA={isa['isa_level']} (the CPU's features: {features}); W8A8 "
        f"{w8a8.UNSUPPORTED}"
    )
