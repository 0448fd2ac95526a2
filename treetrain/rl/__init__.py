"""RL pieces: losses (GRPO advantages, PPO-clip, value), rollout sources, tasks."""
