"""What a run shows: metrics, trackers (JSONL, W&B, TensorBoard), console lines, profiler, reports."""
