"""Allocation's resource plugins, as eru has them: the interface every plugin implements
(`interface.py`), the kit they share (`kit.py`), the set that fans a request out to them and merges
the answers (`plugin_set.py`), and the plugins themselves: `cpumem/` (CPU binding with NUMA, and
memory), `storage/` (volumes and disks) and `gpu/` (cards by product). Pure and synchronous: no
module here does I/O (tests/test_layering.py)."""
