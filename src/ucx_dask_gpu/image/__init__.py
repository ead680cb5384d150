"""The one image, through Docker: its verified inputs (wheelhouse, Debian bases), the build, the normalisation that
makes it reproducible, the 3-role cluster of containers, and the entrypoint inside it."""
