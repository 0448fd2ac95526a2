"""The OpenAI-compatible endpoint with RL sessions (``treetrain proxy``; docs/agents.md)."""
