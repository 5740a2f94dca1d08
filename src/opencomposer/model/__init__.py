"""Model families, checkpoints and interop (layer 2)."""
