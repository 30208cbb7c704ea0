"""The effective DeepSpeed JSON, checked by DeepSpeed's own config classes before any worker starts.

DeepSpeed validates its config in `deepspeed.initialize`: in every worker, after the model is
loaded, and a refusal there is a pydantic traceback on every rank, which `accelerate launch` then
wraps in its own. The same classes (`deepspeed.runtime.config.DeepSpeedConfig` and the pydantic
models it builds per section: zero_optimization with its offloads, bf16, fp16, compile,
tensor_parallel, the monitors, ...) run here, in the process that resolves the run, so that a key
DeepSpeed no longer reads or reads under another name (configs written for older DeepSpeed
versions or for other tools) is one line that names the key, the file and what DeepSpeed accepts
there. DeepSpeed also refuses here, with its own message, the top-level blocks of features it has
removed (elasticity, sparse_attention, curriculum_learning, ...). An old key name DeepSpeed still
maps onto a new one (it only warns) is refused too, naming the new one: llm_train reads the JSON
under the current names, and the two readings must not differ.

Two sections DeepSpeed reads key by key from a plain dict, silently ignoring any other key: `aio`
and `activation_checkpointing`. Their keys are checked against DeepSpeed's own defaults dicts,
which list exactly the keys it reads. The rest of the JSON's semantics (batch arithmetic,
precision, offload devices) is llm_train's own, checked earlier by the layout.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import re
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from llm_train.errors import UserError, first_line

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic_core import ErrorDetails

# Keys DeepSpeed once read in a dict-read section and now reads under another name (a did-you-mean
# that difflib cannot find). aio.thread_count: DeepSpeed 0.19.8's aio_config.py reads
# `intra_op_parallelism` and ignores `thread_count`, which older examples (and DeepSpeed's own old
# docs) still carry.
RENAMED = {("aio", "thread_count"): "intra_op_parallelism"}


def check_with_deepspeed(config: dict[str, Any], source: str) -> None:
    """Refuse (UserError, one line) what DeepSpeed's own config parsing would refuse or ignore in `config`."""
    with _deepspeed_warnings() as warned:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from pydantic import ValidationError

        version = deepspeed.__version__
        _check_dict_sections(config, source, version)
        # No process group exists here, so DeepSpeedConfig takes a world of one and would assert
        # train_batch_size = micro x accum x 1. The batch arithmetic against the real world is the
        # layout's (already checked); without train_batch_size DeepSpeed derives it from the other two.
        probe = {key: value for key, value in copy.deepcopy(config).items() if key != "train_batch_size"}
        warned.clear()  # the import's own warnings ("Setting accelerator to CPU") are no concern here
        refusal: str | None
        try:
            DeepSpeedConfig(probe)
        except ValidationError as exc:
            refusal = _pydantic_message(exc, config, source, version)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed parsing a user's dict: its refusal, any type
            refusal = f"DeepSpeed config {source}: DeepSpeed {version} refuses it: {first_line(exc)}"
        else:
            refusal = None
    # A deprecated name first: it also explains a refusal it causes (an old name next to the new one).
    renamed = next((m for m in map(_DEPRECATED.match, warned) if m), None)
    if renamed is not None:
        raise UserError(_deprecated_message(config, source, version, renamed.group(1), renamed.group(2)))
    if refusal is not None:
        raise UserError(refusal)


# DeepSpeedConfigModel._process_deprecated_field's warning, the one place DeepSpeed says that a key
# it still maps is an old name (deepspeed/runtime/config_utils.py).
_DEPRECATED = re.compile(r"Config parameter (\S+) is deprecated(?: use (.+?) instead)?(?:\.|$)")


def _deprecated_message(config: dict[str, Any], source: str, version: str, old: str, new: str | None) -> str:
    """An old key name DeepSpeed still maps: refused, because llm_train reads the current names only.

    The layout reads the ZeRO stage, the offloads and the export switch from the JSON under their
    current names: `zero_optimization.cpu_offload: true` would offload the optimizer behind its
    back (no host-RAM check, no CPU Adam), and an old name next to the switch llm_train writes
    (stage3_gather_16bit_weights_on_model_save) is refused by DeepSpeed itself.
    """
    path = _find_key(config, old) or (old,)
    instead = (
        f"; DeepSpeed {version} reads {_json_name(old, new)} instead: rename it" if new else "; remove it"
    )
    return f"DeepSpeed config {source}: {_dotted(path)} is an old name{instead}"


def _json_name(old: str, new: str) -> str:
    """The JSON name of the field that replaces deprecated field `old` (its alias, if it has one)."""
    for model in _deepspeed_models():
        field = model.model_fields.get(old)
        replacement = model.model_fields.get(new)
        if field is not None and replacement is not None:
            return replacement.alias or new
    return new


def _find_key(config: dict[str, Any], key: str) -> tuple[Any, ...] | None:
    """The shortest path to `key` in `config`'s nested dicts, or None."""
    return next(((*prefix, key) for prefix, node in _dicts(config) if key in node), None)


def _dicts(config: dict[str, Any], depth: int = 3) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every dict in `config` down to `depth` levels, with its path: breadth first, so shortest first."""
    level: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), config)]
    for _ in range(depth + 1):
        yield from level
        level = [((*path, k), v) for path, node in level for k, v in node.items() if isinstance(v, dict)]


class _Warnings(logging.Filter):
    """Keeps DeepSpeed's messages below ERROR off the console, and their texts in `self.texts`."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        self.texts.append(record.getMessage())
        return False


@contextmanager
def _deepspeed_warnings() -> Iterator[list[str]]:
    """DeepSpeed's warnings while it parses here, collected instead of printed (the list yielded).

    They would go to stdout, inside `llm-train show`'s output: its import warns "Setting accelerator
    to CPU" on a machine without a GPU, and its config models warn about a deprecated key. A filter on
    the "DeepSpeed" logger object survives the logger's set-up at import.
    """
    logger = logging.getLogger("DeepSpeed")
    collected = _Warnings()
    # First among the logger's filters: one that drops records ahead of it (library_logs.quiet's, which a
    # command such as `llm-train eval` installs in this process) would hide the deprecation warnings read
    # here. And a logger drops records below its level before any filter sees them.
    logger.filters.insert(0, collected)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield collected.texts
    finally:
        logger.setLevel(level)
        logger.removeFilter(collected)


def _check_dict_sections(config: dict[str, Any], source: str, version: str) -> None:
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT

    for section, read in (("aio", AIO_DEFAULT_DICT), ("activation_checkpointing", ACT_CHKPT_DEFAULT)):
        given = config.get(section)
        if not isinstance(given, dict):
            continue
        for key in given:
            if key not in read:
                read_keys = sorted(read)
                raise UserError(
                    _unknown_key(
                        source, version, (section, key), read_keys, read_keys, "would silently ignore"
                    )
                )


def _unknown_key(
    source: str, version: str, path: tuple[Any, ...], accepted: list[str], every: list[str], fate: str
) -> str:
    key = str(path[-1])
    close = RENAMED.get((str(path[0]), key)) if len(path) == 2 else None
    close = close or next(iter(difflib.get_close_matches(key, every, n=1)), None)
    hint = f"did you mean '{close}'? " if close else ""
    return (
        f"DeepSpeed config {source}: {_dotted(path)} is not a key DeepSpeed {version} reads (it {fate} it); "
        f"{hint}it reads there: {', '.join(accepted)}"
    )


def _pydantic_message(exc: ValidationError, config: dict[str, Any], source: str, version: str) -> str:
    errors = exc.errors()
    error = errors[0]
    loc = tuple(error["loc"])
    path = _locate(config, loc, error) or loc
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if error["type"] == "extra_forbidden":
        accepted, every = _accepted_keys(exc.title, loc[:-1])
        return _unknown_key(source, version, path, accepted, every, "would refuse") + more
    if error["type"] == "missing":
        return f"DeepSpeed config {source}: {_dotted(path)} is required by DeepSpeed {version}{more}"
    value = json.dumps(error.get("input"), default=str)
    return f"DeepSpeed config {source}: {_dotted(path)}={value}: DeepSpeed {version} refuses it ({error['msg']}){more}"


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[")


_ABSENT = object()


def _walk(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        if not isinstance(node, dict | list):
            return _ABSENT
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    return node


def _locate(config: dict[str, Any], loc: tuple[Any, ...], error: ErrorDetails) -> tuple[Any, ...] | None:
    """The path in `config` of the value a section model refused (its `loc` is relative to the section).

    DeepSpeed hands each model its section (`zero_optimization`, `bf16`, `timers.throughput`, ...),
    or the top level (the monitors); the shortest prefix at which `loc` leads to the refused value
    is where it stands. For a missing key, where its parent stands.
    """
    missing = error["type"] == "missing"
    tail = loc[:-1] if missing else loc
    for prefix, _ in _dicts(config):
        node = _walk(config, prefix + tail)
        if node is not _ABSENT and (missing or "input" not in error or node == error["input"]):
            return prefix + loc
    return None


def _accepted_keys(model_name: str, loc: tuple[Any, ...]) -> tuple[list[str], list[str]]:
    """The keys DeepSpeed's model reads at `loc` inside model `model_name`: (current ones, every name).

    The first list is what to tell a user (each field under its JSON name); the second adds the
    field names behind aliases and the deprecated names it still maps, for the did-you-mean.
    """
    model = _model_named(model_name)
    for part in loc:
        if model is None:
            break
        if isinstance(part, int):
            continue
        field = next(
            (f for name, f in model.model_fields.items() if part in (name, f.alias)),
            None,
        )
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return [], []
    accepted: list[str] = []
    every: list[str] = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        every.extend({name, field.alias or name})
        if not extra.get("deprecated"):
            accepted.append(field.alias or name)
    return sorted(accepted), sorted(every)


def _model_named(name: str) -> Any:
    return next((model for model in _deepspeed_models() if model.__name__ == name), None)


def _deepspeed_models() -> Iterator[Any]:
    """Every pydantic model DeepSpeed has defined so far (its config sections, once imported)."""
    from pydantic import BaseModel

    stack = list(BaseModel.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls.__module__.startswith("deepspeed."):
            yield cls
        stack.extend(cls.__subclasses__())


def _model_in(annotation: Any) -> Any:
    """The pydantic model inside a field's type (`Optional[Model]`, `list[Model]`, ...), or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
