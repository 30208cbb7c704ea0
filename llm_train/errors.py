"""Errors a user can cause, and the exit codes the entry points use.

Every mistake a user can make (a bad recipe key, a missing file, batch arithmetic that
does not divide) raises `UserError` with one line that names the key/file/flag and the
fix. The entry points print that line and exit with `EXIT_USER_ERROR`, never a traceback.
"""

EXIT_OK = 0
EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user can fix; its message is printed as one line, without traceback."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
