"""The test session's own process runs under tests/session_env.py's settings (tests/conftest.py applies them).

Both libraries read them once, at import: torch its thread count, huggingface_hub its offline switch. Set
after either import, they would hold only for the launches, and an in-process test would spin a thread per
core beside the other pytest worker, or sit in the hub's retries (46 s for one dry run).
"""

from __future__ import annotations

import os

from tests.session_env import OFFLINE_ENV, THREADS_PER_WORKER


def test_torch_and_the_hub_took_the_sessions_settings() -> None:
    import torch
    from huggingface_hub import constants

    # A caller's own value wins over the session's (setdefault), so compare with what the environment holds.
    assert set(OFFLINE_ENV) | set(THREADS_PER_WORKER) <= set(os.environ)
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
    hub_offline = constants.HF_HUB_OFFLINE
    assert hub_offline == (os.environ["HF_HUB_OFFLINE"].upper() in ("1", "ON", "YES", "TRUE"))
