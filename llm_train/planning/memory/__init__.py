"""How much memory: per GPU, host RAM and NVMe, from one configuration's inputs (estimate.py adds the terms up)."""
