"""Will it fit, how fast: model shapes, memory and speed models, the search, auto recipes, the plan report."""
