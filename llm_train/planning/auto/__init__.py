"""Which recipe `--recipe auto` writes: the request, the search over the knobs, the why lines, the written recipe."""
