"""The broker service: resources launched on an operator, and warm pools of them (DESIGN.md §4)."""
