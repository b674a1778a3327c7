"""The agent: one process per host (`berth agent`) that registers its node with the allocation
service, holds the node's lease, runs the instances the broker places there, and is its node's
metrics agent (DESIGN: issue 18)."""
