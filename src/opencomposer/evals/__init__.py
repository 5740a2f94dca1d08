"""Evals (layer 4): the benchmark runner, its metrics and its report."""
