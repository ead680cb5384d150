"""The normal form of an image, without Docker: deterministic layer tars and their fixes, the OCI config and archive,
the SBOM, and the comparison of two normalised builds. Files in, files out."""
