"""Measurements on the compiled program: bytes moved by collectives, per-device memory, GPU-target compiles
(`jaxring.analysis.gpu`, needs the gpu-compile extra) and roofline estimates (`jaxring.analysis.roofline`)."""

from jaxring.analysis.compiled import CompiledStats, collective_traffic, compile_stats

__all__ = ["CompiledStats", "collective_traffic", "compile_stats"]
