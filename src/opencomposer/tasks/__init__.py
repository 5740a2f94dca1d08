"""Tasks (layer 3): the task format, builders from real code, integrity gates and hardened grading."""
