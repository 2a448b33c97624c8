"""Measurements on the compiled program: bytes moved by collectives, per-device memory, the bytes per mesh-axis
group (`jaxring.analysis.axis_traffic`), GPU-target compiles (`jaxring.analysis.gpu`, needs the gpu-compile
extra) and roofline estimates (`jaxring.analysis.roofline`); benchmark result files (`jaxring.analysis.records`)."""

from jaxring.analysis.compiled import CompiledStats, collective_traffic, compile_stats

__all__ = ["CompiledStats", "collective_traffic", "compile_stats"]
