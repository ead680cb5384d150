"""Conda packages built without conda channels: the stand-in machinery of `make channel` (tools/README.md)."""
