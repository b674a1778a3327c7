"""The cpumem resource plugin: CPU binding with NUMA, and memory (eru's built-in plugin)."""

from .plugin import CpuMemPlugin

__all__ = ["CpuMemPlugin"]
