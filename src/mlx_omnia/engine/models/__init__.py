"""One self-contained package per architecture family, shaped like its checkpoints."""
