"""Two builds from two clones of this repository, compared byte for byte: the workshop's check (tools/README.md)."""
