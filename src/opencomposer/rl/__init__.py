"""Asynchronous RL (report §3-4): sequences from recorded tokens first; the objective, rewards,
reconciler, weight sync and services build on them."""
