"""The base of every recipe section: strict (an unknown key is an error), and one-line errors for tagged entries.

Every part of the recipe schema (recipe_sections.py, source_schema.py, objective_sections.py, recipe.py) is
a `Section`. Lists of tagged mappings (a data source by its `format`, a GRPO reward by its `kind`) are
parsed entry by entry with `validate_entry`, so that a mistake names `data.train[1].key` and the keys
valid for that entry's kind in one line.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    # extra="forbid": a misspelled key is an error, not a silently ignored default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def validate_entry(cls: type[Section], item: dict[str, Any], where: str, what: str) -> Section:
    """`item` as `cls` (one entry of a list of tagged mappings: a data source, a reward), or one line naming
    `where`'s key: an unknown key with the valid ones ("did you mean"), or the first invalid value."""
    valid = sorted(cls.model_fields)
    for key in item:
        if key not in cls.model_fields:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"{where}: unknown key '{key}' for {what}; {hint}valid keys: {', '.join(valid)}")
    try:
        return cls.model_validate(item)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if loc and not isinstance(err.get("input"), dict) else ""
        raise ValueError(f"{where}{'.' + loc if loc else ''}: {message}{got}") from None
