"""final/ as a plain Hugging Face directory (runtime/__init__.py says where each room sits).

model_dir.py  write it (save_hf_model), verify it as a user loads it (keys, logits), export a checkpoint
sharded.py    a LoRA run's final/ written layer by layer, the host holding one shard at a time
names.py      the tensor names every writer and the key check use: the family's hub layout
"""
