"""The engines that train the model (runtime/__init__.py says where each room sits).

engine.py             the interface the session and the loop are written against
zero_engine.py        DeepSpeed ZeRO-0..3 (with AutoTP, offload, LoRA, Ulysses) through Accelerate
pipeline_engine.py    DeepSpeed's pipeline engine, which Accelerate does not drive
pipeline_model.py     the pipeline's model side: a causal LM as PipelineModule stages
sequence_parallel.py  Ulysses: each sequence split over sp ranks (its loss: loss/language_modeling.py)
reference.py          DPO's reference model without a second copy of the policy in memory
"""
