"""The gpu resource plugin: whole cards counted per product (eru resource-gpu)."""

from services.allocation.plugins.gpu.plugin import GpuPlugin

__all__ = ["GpuPlugin"]
