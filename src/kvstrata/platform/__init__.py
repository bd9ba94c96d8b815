"""What this machine offers: hardware facts (RAM, cores, CUDA), device streams and CUDA
host memory, and the native kernel library (C++ in csrc/, built on first use)."""
