"""Long single-rank work never sits inside a collective: a slow rank 0 under a short process-group timeout.

At 70B a checkpoint holds ~790 GiB; hashing it on one rank takes minutes, and a DeepSpeed
universal conversion far longer, while NCCL gives up on a collective after its timeout. Here a
real 2-process gloo world runs with a process-group timeout of TIMEOUT_S and rank 0 is slowed
(the test hook: each file it hashes, and the conversion, costs SLOW_S more), so that its work
alone outlasts the timeout several times over. A save, the choice of the checkpoint to resume,
and its conversion for a new layout must all complete, and the world must still work after each
(a collective right after every phase): the other rank waited by polling files, not inside a
collective. With rank 0 doing the work while rank 1 waits in a broadcast, rank 1 fails with
gloo's "Timed out waiting ... for recv operation".
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import REPO, free_port

TIMEOUT_S = 3.0
SLOW_S = 2.0  # per file hashed on rank 0; a save here hashes 5 files, so ~10 s of rank-0 work

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    sys.path.insert(0, {repo!r})
    import llm_train.runtime.checkpointing.commit as checkpoint
    from llm_train.runtime.checkpointing import resume, run_state
    from llm_train.runtime.base.collectives import WORLD

    rank, timeout_s, slow_s = int(os.environ["RANK"]), float(sys.argv[2]), float(sys.argv[3])
    root = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))

    if rank == 0:  # the test hook: rank 0 is slow at everything it does alone
        real_sha256 = checkpoint._sha256

        def slow_sha256(path):
            time.sleep(slow_s)
            return real_sha256(path)

        checkpoint._sha256 = slow_sha256

    MINE = {{0: ["state/ds/model_states.pt", "state/ds/optim_rank0.pt"], 1: ["state/ds/optim_rank1.pt"]}}

    def write(tmp):  # as DeepSpeed does: each rank its own shards, plus its trainer state
        for name in MINE[rank]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(os.urandom(1 << 16))
        trainer = run_state.trainer_state_path(tmp, rank)
        trainer.parent.mkdir(parents=True, exist_ok=True)
        trainer.write_text(json.dumps({{"step": 2}}))

    def healthy(phase):
        total = WORLD.sum(__import__("torch").ones(1))  # a collective right after the phase
        assert float(total[0]) == 2.0
        print(f"rank {{rank}}: {{phase}} ok", flush=True)

    ckpt = checkpoint.Checkpointer(root, rank, 2, WORLD)
    meta = checkpoint.SaveMeta(2, 2, "abc", 2, {{"world_size": 2, "zero_stage": 2}})
    started = time.monotonic()
    path = ckpt.save(meta, write, estimate_bytes=1 << 20)
    print(f"rank {{rank}}: save took {{time.monotonic() - started:.1f}}s", flush=True)
    healthy("save")
    if rank == 1:  # the committed checkpoint is whole (checked where hashing is not slowed)
        assert checkpoint.verify(path) is None

    started = time.monotonic()
    chosen = resume.choose_checkpoint("auto", root, rank, WORLD, print)
    print(f"rank {{rank}}: choice took {{time.monotonic() - started:.1f}}s", flush=True)
    assert chosen == path, chosen
    healthy("choice")

    convert = getattr(resume, "convert_for_resume", None)
    if convert is not None:  # the conversion handshake (rank 0 converts; the others wait)
        def slow_conversion(ckpt_dir, say):
            time.sleep(3 * timeout_s)
            return ckpt_dir / "universal"

        resume.ensure_universal = slow_conversion
        convert(chosen, root, rank, WORLD, timeout_s, print)
        healthy("conversion")
    dist.destroy_process_group()
    """
)


def test_a_slow_rank_0_does_not_time_the_others_out(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO)))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "checkpoints"), str(TIMEOUT_S), str(SLOW_S)],
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode})\n{out[-3000:]}"
        for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
    )
    print(report)
    assert [p.returncode for p in procs] == [0, 0], report
    for out in outputs:
        assert "save ok" in out and "choice ok" in out and "conversion ok" in out, report
    # Rank 0's work really outlasted the timeout: the save alone took longer than it.
    save_s = float(outputs[1].split("save took ")[1].split("s")[0])
    assert save_s > TIMEOUT_S, report
