"""Kernels that layers above share (a leaf package: it imports nothing of minisgl's).

`kernels.triton`: the fused decode-layer ops of the models' CUDA path (RMSNorm with the
residual add, RoPE in place, SiLU-and-mul). Triton is imported only when that subpackage is.
"""
