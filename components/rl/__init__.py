"""The agent and its training: policy format, batched multi-turn rollouts, the iteration loop, curriculum, GRPO, PPO."""
