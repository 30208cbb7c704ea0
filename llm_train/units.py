"""Units: llm_train counts memory in bytes everywhere and shows it in GiB (2**30 bytes)."""

GiB = 1024**3
