"""Backends: each renders a Program into a kernel (or, for the reference, evaluates it)."""
