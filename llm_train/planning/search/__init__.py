"""Will it fit: one candidate evaluated, the cheapest fixes, host settings, the longest context, checks before a run."""
