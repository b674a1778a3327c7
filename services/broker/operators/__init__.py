"""Operators: where a broker resource's instances run (see base.py)."""
