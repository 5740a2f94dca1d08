"""Isolated, forkable coding environments (layer 1). Never imports torch."""
