"""The storage resource plugin: volumes, disks with IO quotas and a storage budget (eru resource-storage)."""

from services.allocation.plugins.storage.plugin import StoragePlugin

__all__ = ["StoragePlugin"]
