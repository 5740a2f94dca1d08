"""Asynchronous RL (report §3-4): RL sequences from recorded tokens (`sequences`), the trainer's
logprobs of them (`forward`), the Dr. GRPO objective (`objective`), rollout rewards (`rewards`), one
rollout through the harness (`rollout`), the trainer step and its checkpoints (`trainer`), the event
log (`events`) and the reconciler with its services (`loop`)."""
