"""Code shared byte-for-byte by families, and the layer declarations they bind (design rule 4)."""
