"""Training: data mixes, continued pretraining, SFT, base-model evals (layer 3)."""
