"""Attention over tiered KV: math (pack-GQA partials, LSE merge), the native decode
kernel's descriptors, GPU kernels, staging and transfers, and the per-store runtime that
plans once per step and runs per layer."""
