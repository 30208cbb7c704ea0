"""What the user asked for: the recipe schema, DeepSpeed JSON, hardware, the layout, and resolution of a run."""
