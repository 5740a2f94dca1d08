"""Inference: the batched sampling engine and the OpenAI-compatible server (layer 3)."""
