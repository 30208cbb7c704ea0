"""One training run inside one worker process, in rooms: each imports only from itself and the rooms above it here.

    base/           what every room stands on: collectives (every collective llm_train issues), the
                    launcher's environment, compat (every library workaround, with its version)
    loss/           every loss, behind one interface: open it first for "where is the loss"
    model/          the model a recipe names: build, LoRA, QLoRA's 4-bit base, attention, ALST switches,
                    speed switches, optimizer and schedule, the pipeline's weight names
    checkpointing/  saving and resuming (commit, run state, resume, universal), when to save or stop
                    (control.py), and the live model's reference logits a checkpoint and final/ record
    export/         final/ as a plain Hugging Face directory: written whole or layer by layer
                    (write.py, sharded.py), verified (verify.py), and exported from a checkpoint
                    (from_checkpoint.py)
    rl/             GRPO's rollouts, reward functions and run wiring (wiring.py; its loss: loss/grpo.py)
    engines/        the Engine interface and its two engines (ZeRO through Accelerate; DeepSpeed's
                    pipeline, with its model), Ulysses sequence sharding, DPO's reference model

and, above every room, the run itself:

    session.py      the run from start to export, the same for every engine
    loop.py         the step loop: step, log, evaluate, checkpoint, stop
    benchmark.py    lm-eval tasks: `llm-train eval` and periodic evaluation
    rundir.py       the run directory contract

The rule: a room is placed above everything it needs, so a change to a model, an engine or an export
is made in one room and read from the rooms above it (tests/unit/test_layers.py RUNTIME_ROOMS holds the
order and fails an arrow from a lower room to a higher one). Checkpointing sits below the engines: a save
asks an engine only for its DeepSpeed engine and its reference logits (run_state.py `Saved`).
"""
