"""tests/launch_server.py: a served launch behaves as the fresh tests/workers.py launch it replaces."""

from __future__ import annotations

import os
import signal

from tests.helpers import launch, launch_cmd, launch_popen, run_cmd
from tests.launch_server import LaunchServer, ServedLaunch, servable


def test_served_launch_exits_and_prints_as_a_fresh_one():
    args = ["--recipe", "no-such-recipe"]
    fresh = run_cmd(launch_cmd(args, 2))
    served = launch(args)
    assert fresh.returncode == served.returncode == 2
    assert "no-such-recipe" in served.stderr
    assert sorted(served.stderr.splitlines()) == sorted(fresh.stderr.splitlines())
    assert served.stdout == fresh.stdout


def test_served_launch_is_a_session_of_its_own_and_reports_the_signal_that_ended_it(tmp_path):
    args = ["--recipe", "tiny-cpu", f"output.dir={tmp_path}", "optim.max_steps=100000"]
    proc = launch_popen(args)
    assert isinstance(proc, ServedLaunch)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # as Popen(start_new_session=True)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.communicate(timeout=30)[1] is None  # stderr went into stdout, as launch_popen asks


def test_a_launch_that_libraries_may_see_differently_at_import_runs_fresh():
    env = LaunchServer.base_env()
    assert servable(["--recipe", "tiny-cpu"], {**env, "PYTEST_CURRENT_TEST": "x", "WANDB_MODE": "disabled"})
    assert not servable(["--recipe", "tiny-cpu", "--verbose"], env)
    assert not servable(["--recipe", "tiny-cpu"], {**env, "HF_HOME": "/elsewhere"})
    assert not servable(["--recipe", "tiny-cpu"], {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"})
