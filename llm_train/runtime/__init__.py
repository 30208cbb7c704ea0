"""One training run inside one worker process.

session.py          the run from start to export, the same for every engine
loop.py             the step loop: step, log, evaluate, checkpoint, stop
engine.py           what the session and the loop need from an engine (the interface)
zero_engine.py      DeepSpeed ZeRO-0..3 (with AutoTP, offload, LoRA) through Accelerate
pipeline_engine.py  DeepSpeed's pipeline engine, which Accelerate does not drive
"""
