"""One launch server per pytest process: each `launch` forked from one interpreter that imported once.

tests/workers.py forks a launch's workers from a parent that imported torch, transformers, DeepSpeed
and llm_train; that parent is still a fresh interpreter per launch (~4.5 CPU-s of imports, half of a
tiny 2-process run's CPU, and the suite runs ~100 such launches on 2 cores). This server is that
parent's import done once per pytest process: it then forks, per launch, a process that starts the
workers as tests/workers.py does (`run_launch`), in a session of its own, with the launch's
environment, directory and output pipes.

The test sees a Popen-like `ServedLaunch`: the pid of that process (its process group, the workers
inside it: os.killpg and psutil's children() behave as with a Popen), poll/wait/communicate, and the
exit code as Popen gives it (negative: the signal that ended it), which the server reports once it
has reaped the process. A launch whose environment differs from the server's in a key a library may
read at import, or that asks for --verbose (library logs are quieted at import), runs in a fresh
tests/workers.py instead (`servable`).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, NoReturn

from tests.session_env import OFFLINE_ENV

REPO = Path(__file__).resolve().parent.parent

# Keys that differ from launch to launch and that nothing reads at import time (pytest names the
# running test in PYTEST_CURRENT_TEST; W&B reads its mode when a run starts).
RUN_TIME_KEYS = ("PYTEST_CURRENT_TEST", "WANDB_")
MAX_FDS = 3  # the reply socket, the launch's stdout and stderr


def servable(argv: list[str], env: dict[str, str]) -> bool:
    """Whether a forked launch of `argv` under `env` starts as a fresh tests/workers.py would."""
    if "--verbose" in argv:
        return False
    base = LaunchServer.base_env()
    keys = {key for key in set(env) | set(base) if not key.startswith(RUN_TIME_KEYS)}
    return all(env.get(key) == base.get(key) for key in keys)


class LaunchServer:
    """The client side: the server process of this pytest process, started at its first launch."""

    _instance: LaunchServer | None = None
    _lock = threading.Lock()

    @staticmethod
    def base_env() -> dict[str, str]:
        """The environment the server imports under (what a fresh tests/workers.py would run in)."""
        return {**os.environ, **OFFLINE_ENV}  # os.environ holds the session's THREADS_PER_WORKER (conftest)

    @classmethod
    def get(cls) -> LaunchServer:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log, self.log = tempfile.mkstemp(prefix="launch-server-", suffix=".log")
        atexit.register(os.unlink, self.log)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.launch_server", str(theirs.fileno())],
            cwd=REPO,
            env=self.base_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        os.close(log)
        self.control = ours
        self.send_lock = threading.Lock()

    def start(self, argv: list[str], env: dict[str, str], merge_stderr: bool) -> ServedLaunch:
        return ServedLaunch(self, argv, env, merge_stderr)

    def failure(self) -> str:
        return Path(self.log).read_text(errors="replace")[-4000:]


class ServedLaunch:
    """A launch forked by the server, seen through the part of subprocess.Popen the tests use."""

    def __init__(self, server: LaunchServer, argv: list[str], env: dict[str, str], merge_stderr: bool):
        self.args = argv
        self.returncode: int | None = None
        self._server = server
        reply, reply_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if merge_stderr else os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": str(REPO)}).encode()
        with server.send_lock:
            socket.send_fds(server.control, [request], [reply_theirs.fileno(), out_w, err_w])
        for fd in {reply_theirs.fileno(), out_w, err_w}:
            os.close(fd)
        reply_theirs.detach()
        self._reply = reply
        # Popen's text-mode pipes, closed by communicate (or when the object goes).
        self.stdout: IO[str] = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stderr: IO[str] | None = None
        if err_r is not None:
            self.stderr = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.pid = int(self._message(timeout=60).removeprefix("pid "))

    def _message(self, timeout: float | None) -> str:
        ready, _, _ = select.select([self._reply], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        message = self._reply.recv(256).decode()
        if not message:
            raise RuntimeError(f"the launch server ended; its log:\n{self._server.failure()}")
        return message

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(timeout).removeprefix("exit "))
            except subprocess.TimeoutExpired:
                return None
            self._reply.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Both outputs read to their end, then the exit code: as Popen.communicate (no input)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = [p for p in (self.stdout, self.stderr) if p is not None]
        text: dict[int, list[str]] = {p.fileno(): [] for p in pipes}
        while pipes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(pipes, [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for pipe in ready:
                chunk = os.read(pipe.fileno(), 1 << 16)
                if chunk:
                    text[pipe.fileno()].append(chunk.decode("utf-8", errors="replace"))
                else:
                    pipes.remove(pipe)
        out = "".join(text[self.stdout.fileno()])
        err = None if self.stderr is None else "".join(text[self.stderr.fileno()])
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def serve(control: socket.socket) -> None:
    """Import once, then fork one launch per request until the pytest process hangs up."""
    from tests.workers import import_what_workers_import

    before = dict(os.environ)
    import_what_workers_import([])
    # What the preparation set (quieted libraries' settings, the ninja on PATH), as a fresh worker has it.
    prepared = {key: value for key, value in os.environ.items() if before.get(key) != value}
    replies: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([control], [], [], 0.1)
        if ready:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, MAX_FDS)
            if not message:
                return  # the pytest process is gone; launches still running end on their own
            reply = socket.socket(fileno=fds[0])
            pid = os.fork()
            if pid == 0:
                request = json.loads(message)
                request["env"].update(prepared)
                _launch(request, reply, fds[1], fds[2], [control, *replies.values()])
            for fd in set(fds[1:]):
                os.close(fd)
            replies[pid] = reply
        while replies:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            reply = replies.pop(pid)
            reply.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            reply.close()


def _launch(
    request: dict, reply: socket.socket, out_fd: int, err_fd: int, others: list[socket.socket]
) -> NoReturn:
    """The forked launch: its own session, directory, environment and output; never returns."""
    from tests.workers import exit_with, run_launch

    def body() -> int:
        os.setsid()  # as Popen(start_new_session=True): the test signals or kills the group
        reply.send(f"pid {os.getpid()}".encode())  # only now: a killpg at once finds the group
        for sock in [reply, *others]:
            sock.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in {null, out_fd, err_fd}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        return run_launch(int(request["argv"][0]), request["argv"][1:])

    exit_with(body)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
