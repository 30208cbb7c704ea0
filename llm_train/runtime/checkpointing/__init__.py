"""Checkpointing, one component: how a run is saved and how it resumes.

    commit.py         the commit protocol: atomic, verified, retained checkpoint directories
    run_state.py      what a checkpoint holds beside DeepSpeed's state, and the `Saver` the loops call
    resume.py         the `Resume`: planned before start, opened in the world, restored into the engine
    universal.py      DeepSpeed's universal copy, for a resume on another layout (and `llm-train convert`)
    file_sync.py      ranks waiting for each other through files, never inside a collective
    master_digest.py  the fp32 masters' digest a save records and an export checks

What DeepSpeed's own load leaves out or wrong is put right in runtime/compat.py; export
(runtime/export.py) reads checkpoints and stays beside this package.
"""
