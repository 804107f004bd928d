"""Offload compiler passes: canonicalize -> fuse -> layout -> precision -> cleanup -> partition."""
