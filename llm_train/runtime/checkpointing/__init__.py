"""Checkpointing, one component: how a run is saved and how it resumes.

    commit.py         the commit protocol: atomic, verified, retained checkpoint directories
    run_state.py      what a checkpoint holds beside DeepSpeed's state, and the `Saver` the loops call
    resume.py         the `Resume`: planned before start, opened in the world, restored into the engine
    universal.py      DeepSpeed's universal copy, for a resume on another layout (and `llm-train convert`)
    file_sync.py      ranks waiting for each other through files, never inside a collective
    master_digest.py  the fp32 masters' digest a save records and an export checks
    logit_reference.py  the live model's logits on a fixed batch, recorded with each checkpoint and final/
    control.py        when to checkpoint and when to stop: the schedule, stop signals, agreement across ranks

What DeepSpeed's own load leaves out or wrong is put right in runtime/base/compat.py; export
(runtime/export/, the room above) reads checkpoints.
"""
