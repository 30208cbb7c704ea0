"""final/ as a plain Hugging Face directory (runtime/__init__.py says where each room sits).

write.py            write it from a gathered state dict (save_hf_model) and the dtypes an export is written in
sharded.py          a LoRA run's final/ written layer by layer, the host holding one shard at a time
verify.py           verify it as a user loads it: keys against config.json's architecture, then logits
load.py             load it as a user does (the Auto class its config names), a greedy sample of its text
from_checkpoint.py  export a checkpoint (`llm-train export`): consolidate, write, verify
names.py            the tensor names every writer and the key check use: the family's hub layout
"""
