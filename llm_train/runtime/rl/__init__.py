"""Online RL (runtime/__init__.py says where each room sits).

grpo.py     GRPO's rollouts and its Objective: generate, score, advantages, loss (the arithmetic: loss/grpo.py)
rewards.py  the recipe's reward functions
continuous.py  the second generation engine: transformers' continuous batching (use_transformers_continuous_batching)
"""
