"""The model a recipe names, before any engine wraps it (runtime/__init__.py says where each room sits).

model.py               the tokenizer and the Hugging Face model (with the switches below applied)
lora.py                LoRA through PEFT
quantized_base.py      QLoRA's 4-bit / 8-bit base, and the two workarounds of its load and evaluation
document_attention.py  memory.attention: sdpa_flex, per-document attention in packed rows
tiling.py              the ALST memory switches (tiled MLP, offloaded checkpoints)
fast.py                speed switches: allocator, Liger, torch.compile
optim.py               optimizer and learning-rate schedule
pipeline_names.py      a pipeline run's weight names, HF <-> pipeline layers
"""
