"""Tokenizers (layer 1): BPE train/load (incl. from GGUF), and the one chat renderer."""
