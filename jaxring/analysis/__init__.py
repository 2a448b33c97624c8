"""Measurements on the compiled program: bytes moved by collectives and per-device memory."""
from jaxring.analysis.compiled import CompiledStats, collective_traffic, compile_stats
