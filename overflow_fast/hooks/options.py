"""Every option of the detector, declared once: its name, its default and its check, in one frozen
``Options``.

``Options.of(**options)`` checks each value and raises a TypeError or ValueError that names the
option and what it takes. The detector, ``watch()`` and the trainer callbacks build it when they
are constructed, so a bad option fails there, never at the first hook; nothing checks it again.
The detector's and ``watch()``'s signatures list every option for help() and IDEs, with the
defaults declared here (``WATCH_DEFAULTS``: ``watch()``'s own): tests/test_options.py holds them
equal. ``docs/options.md`` says what each option does and costs.
"""

import dataclasses
import datetime
import difflib
import operator
import os
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, Union

from ..stats import BACKEND_NAMES

CHECK_MODES = ("module", "batch", "step")
ON_DETECT = ("raise", "warn", "record", "skip")

# The options' types, as the signatures of the detector, watch() and the integrations declare them
Check = Literal["module", "batch", "step"]
OnDetect = Union[Literal["raise", "warn", "record", "skip"], Callable[[Exception], Any]]
Backend = Optional[Literal["torch", "cpu", "triton"]]
Patterns = Union[str, Sequence[str]]
Seconds = Union[None, float, datetime.timedelta]
# a path (a JSONL file), a TensorBoard SummaryWriter or a W&B run, or a list of them
LogTargets = Union[None, str, os.PathLike, Any, Sequence[Any]]
Folder = Union[None, str, os.PathLike]
BatchNumbers = Optional[Iterable[int]]


def integer(value, name, what):
    """``value`` as an int (numpy integers and 0-dim integer tensors too), else a TypeError saying
    that ``name`` takes ``what``; a bool is not an integer here."""
    if isinstance(value, bool):
        raise TypeError(f"{name} takes {what}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} takes {what}, got {type(value).__name__} {value!r}") from None


def validated_flag(name, value):
    """A flag's value: True or False, nothing else (the string "no" is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} takes True or False, got {value!r}")
    return value


def _at_least(least):
    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, int):  # a ValueError, like a number below the least
            raise ValueError(f"{name} takes an int >= {least}, got {type(value).__name__} {value!r}")
        if value < least:
            raise ValueError(f"{name} takes an int >= {least}, got {value}")
        return value
    return check


def _max_frames(name, value):
    # the reference takes whatever its deque takes: None (an unbounded ring), numpy integers,
    # 0-dim integer tensors
    if value is None:
        return None
    value = integer(value, name, "an int >= 0 or None")
    if value < 0:
        raise ValueError(f"{name} takes an int >= 0 or None, got {value}")
    return value


def _batch_numbers(name, value):
    # the reference takes any container of batch numbers (`in` is all it asks of it)
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not (hasattr(value, "__contains__") or hasattr(value, "__iter__")):
        raise TypeError(f"{name} takes a container of batch numbers, got {type(value).__name__}")
    return value


def _optional_integer(name, value):
    # kept as given: the reference's message prints it as it was passed
    if value is not None:
        integer(value, name, "an int or None")
    return value


def _choice(choices, or_else=""):
    what = f"one of {', '.join(map(repr, choices))}{or_else}"

    def check(name, value):
        if not isinstance(value, str):
            raise TypeError(f"{name} takes {what}, got {type(value).__name__} {value!r}")
        if value not in choices:
            raise ValueError(f"{name} takes {what}, got {value!r}")
        return value
    return check


def _every(name, value):
    if value is None:
        return None
    return _at_least(1)(name, value)


def _backend(name, value):
    if value is None:
        return None
    return _choice(BACKEND_NAMES)(name, value)


def _on_detect(name, value):
    return value if callable(value) else _choice(ON_DETECT, " or a callable")(name, value)


def _patterns(name, value):
    what = "a pattern ('MODULE' or 'MODULE:ENTRY', * and ? as wildcards) or a list of patterns"
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} takes {what}, got {type(value).__name__} {value!r}")
    patterns = tuple(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{name} takes {what}, got {type(pattern).__name__} {pattern!r} in the list")
    return patterns


def _fraction(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} takes a fraction in (0, 1] or None, got {type(value).__name__} {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"{name} takes a fraction in (0, 1] or None, got {value!r}")
    return float(value)


def _scale_floor(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} takes a number >= 0, got {type(value).__name__} {value!r}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} takes a finite number >= 0, got {value!r}")
    return float(value)


def _timeout(name, value):
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} takes seconds (a number), a datetime.timedelta or None, got {type(value).__name__}")
    if not seconds > 0:
        raise ValueError(f"{name} takes a positive time, got {value!r}")
    return datetime.timedelta(seconds=seconds)


def _directory(name, value):
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} takes a folder (a non-empty path) or None, got {type(value).__name__}")
    if os.fspath(value) in ("", b""):
        raise ValueError(f"{name} takes a folder (a non-empty path) or None, got {value!r}")
    return value


def _log(name, value):
    """A non-empty path, a TensorBoard SummaryWriter, a W&B run, or a non-empty list of them."""
    from ..recording.dashboards import is_dashboard  # imports no dashboard package

    if value is None:
        return None
    targets = list(value) if isinstance(value, (list, tuple)) else [value]
    if not targets:
        raise ValueError(f"{name} takes a path, a SummaryWriter, a wandb run or a list of them, got an empty list")
    for target in targets:
        if isinstance(target, (str, os.PathLike)):
            if os.fspath(target) in ("", b""):
                raise ValueError(f"{name} takes a non-empty path, got {target!r}")
            folder = os.path.dirname(os.path.abspath(os.fsdecode(target)))
            if not os.path.isdir(folder):  # a typo in a path makes no folders
                raise ValueError(f"{name}={os.fsdecode(target)!r}: its folder {folder} does not exist (create it "
                                 "first)")
        elif not is_dashboard(target):
            raise TypeError(f"{name} takes a path, a SummaryWriter, a wandb run or a list of them, got "
                            f"{type(target).__name__}")
    return tuple(targets) if isinstance(value, (list, tuple)) else value


def option(default, check):
    """A field of ``Options``: its default, and the check that validates a value given for it
    (``check(name, value)`` returns the value to keep, or raises naming the option)."""
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class Options:
    # the reference's
    max_frames_to_save: Optional[int] = option(21, _max_frames)
    trace_batch_nums: Any = option(None, _batch_numbers)
    abort_after_batch_num: Optional[int] = option(None, _optional_integer)
    # when tensors are read and decided
    check: str = option("module", _choice(CHECK_MODES))
    backend: Optional[str] = option(None, _backend)
    frames_every: Optional[int] = option(None, _every)
    buffer_rows: int = option(1 << 16, _at_least(1))
    reuse_stats: bool = option(True, validated_flag)
    defer: bool = option(False, validated_flag)
    stage_bytes: int = option(256 << 20, _at_least(0))
    # what a frame holds
    kwargs: bool = option(False, validated_flag)
    containers: bool = option(False, validated_flag)
    backward: bool = option(False, validated_flag)
    # what a detection does
    on_detect: Union[str, Callable] = option("raise", _on_detect)
    ignore: tuple = option((), _patterns)
    warn_above: Optional[float] = option(None, _fraction)
    warn_gradients: bool = option(False, validated_flag)
    max_skips: int = option(10, _at_least(0))
    # under a GradScaler: where its backoff is a detection (``scaling``); a GradScaler halves its
    # scale at each backoff: from init_scale=1e12 it reaches 1.0 in 40 backoffs
    min_loss_scale: float = option(1.0, _scale_floor)
    max_backoffs: int = option(64, _at_least(0))
    # beyond the module: the op and the line that made the first nan/inf
    find_op: bool = option(False, validated_flag)
    repro: Any = option(None, _directory)
    # torch.distributed
    sync: bool = option(True, validated_flag)
    sync_timeout: Optional[datetime.timedelta] = option(None, _timeout)
    # the flight recorder
    log: Any = option(None, _log)
    log_every: int = option(1, _at_least(1))

    def __post_init__(self):
        if self.frames_every is not None and self.check != "step":
            raise ValueError(f"frames_every takes effect with check='step' only (the other modes read every "
                             f"module at every step), got check={self.check!r}")

    @classmethod
    def of(cls, **options):
        """The options, validated (an unknown name is a TypeError naming the nearest option)."""
        check_names(options)
        return cls(**{field.name: field.metadata["check"](field.name, options.get(field.name, field.default))
                      for field in dataclasses.fields(cls)})

    def changed(self, **options):
        """These options with some replaced, the new values validated."""
        check_names(options)
        checks = {field.name: field.metadata["check"] for field in dataclasses.fields(self)}
        return dataclasses.replace(self, **{name: checks[name](name, value) for name, value in options.items()})

    @property
    def keeps_calls(self):
        """Whether each call's inputs are kept for a detection's replay (``find_op``, ``repro``)."""
        return self.find_op or self.repro is not None


NAMES = tuple(field.name for field in dataclasses.fields(Options))

# watch()'s defaults where they are not the drop-in's: the recommended modern ones
WATCH_DEFAULTS = dict(check="batch", kwargs=True, containers=True, backward=True, find_op=True)


def of_arguments(arguments, unknown):
    """The options a signature that lists every option received: ``arguments`` its parameters by
    name (``locals()``), ``unknown`` what its ``**unknown`` caught (each misspelled name is named
    with the nearest option)."""
    return Options.of(**unknown, **{name: arguments[name] for name in NAMES})


def check_names(options, also=()):
    """Raise a TypeError for any name in ``options`` that is neither an option nor in ``also``
    (a caller's own arguments), suggesting the nearest known name of each."""
    known = list(NAMES) + list(also)
    unknown = [name for name in options if name not in known]
    if not unknown:
        return
    described = []
    for name in unknown:
        near = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        described.append(f"{name!r} (did you mean {near[0]!r}?)" if near else repr(name))
    raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(described)}; every option is "
                    "listed in docs/options.md")
