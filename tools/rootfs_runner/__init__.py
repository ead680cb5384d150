"""The image run from its exported filesystem on a host without Docker: the workshop's runner (tools/README.md)."""
