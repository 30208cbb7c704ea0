"""What counts as a credential: key names that must never reach a saved config, log or tracker."""

from __future__ import annotations

import re

# Words that make a key name a credential wherever they appear in it...
_SECRET_WORDS = {"secret", "secrets", "password", "passwd", "apikey", "credential", "credentials"}
# ...and words that do so only as the last word (`hub_token` is a secret, `pad_token_id` is not).
_SECRET_LAST = {"token", "key", "auth"}
_KEY_QUALIFIERS = {"api", "access", "private", "secret", "auth", "signing", "encryption"}


def is_secret_key(key: str) -> bool:
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", str(key)).lower()) if w]
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    last = words[-1]
    if last == "key":  # "api_key", "access_key" are credentials; "sort_key", "key" alone are not
        return len(words) > 1 and words[-2] in _KEY_QUALIFIERS
    return last in _SECRET_LAST
