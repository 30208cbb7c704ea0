"""Errors a user can cause, and every exit code llm_train's processes end with (here and nowhere else).

Every mistake a user can make (a bad recipe key, a missing file, batch arithmetic that
does not divide) raises `UserError` with one line that names the key/file/flag and the
fix. The entry points print that line and exit with `EXIT_USER_ERROR`, never a traceback.
"""

EXIT_OK = 0
EXIT_USER_ERROR = 2  # a bad input: one line that names the key, file or flag and the fix
EXIT_NONFINITE = 3  # the loss became NaN/inf (the step is named); resume with a lower optim.lr
EXIT_CHECKPOINT_IO = 4  # a save failed (disk full, I/O error); the previous checkpoint is intact
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request (SIGTERM/SIGUSR1); resume with --resume auto


class UserError(Exception):
    """A problem the user can fix; its message is printed as one line, without traceback."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class ExportError(UserError):
    """An exported model directory failed its check (missing, empty or mis-shaped tensors)."""


def first_line(exc: BaseException) -> str:
    """`exc` as a short clause for a one-line message: the first line of its text (or of its cause's).

    Library errors often carry a multi-line text (pydantic, datasets, torch); the first line says what
    went wrong, and 300 characters keep the message one line. An empty text falls back to the
    exception that caused it, then to the exception's type name.
    """
    for candidate in (exc, exc.__cause__, exc.__context__):
        if candidate is not None and str(candidate).strip():
            return str(candidate).strip().splitlines()[0][:300]
    return type(exc).__name__
