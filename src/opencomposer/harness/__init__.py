"""The agent harness (layer 2): tools, the loop, context management, policies, trajectories.
Never imports torch: users run agents and benchmarks without it."""
