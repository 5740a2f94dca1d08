"""Layer 0: configuration, run folders, metrics and logging. Standard library only."""
