"""Low-precision formats and grouped GEMMs for the MoE layers (layer 1)."""
