"""Asynchronous RL (report §3-4). Built so far: RL sequences from recorded tokens
(`sequences`), the trainer's logprobs of them (`forward`), the Dr. GRPO objective (`objective`)
and rollout rewards (`rewards`). The training loop, reconciler, weight sync and services that use
them are not built yet."""
