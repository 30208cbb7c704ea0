"""How fast: FLOPs per token, the step-time model that ranks configurations, what a checkpoint costs to save."""
