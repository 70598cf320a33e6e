"""Every option of the detector, validated once, in one frozen object.

``Options.of(**options)`` checks each value and raises a TypeError or ValueError that names the
option and what it takes. The detector, ``watch()`` and the trainer callbacks build it when they
are constructed, so a bad option fails there, never at the first hook. ``docs/options.md`` says
what each option does and costs.
"""

import dataclasses
import datetime
import difflib
import operator
import os
from typing import Any, Callable, Optional, Union

from ..stats import BACKEND_NAMES

CHECK_MODES = ("module", "batch")
ON_DETECT = ("raise", "warn", "record", "skip")
DEFAULT_BUFFER_ROWS = 1 << 16
DEFAULT_DEFER_BYTES = 256 << 20
DEFAULT_MAX_SKIPS = 10
# A GradScaler halves its scale at each backoff: from init_scale=1e12 it reaches 1.0 in 40 backoffs.
DEFAULT_MAX_BACKOFFS = 64
DEFAULT_MIN_LOSS_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class Options:
    # the reference's
    max_frames_to_save: Optional[int] = 21
    trace_batch_nums: Any = None
    abort_after_batch_num: Optional[int] = None
    # when tensors are read and decided
    check: str = "module"
    backend: Optional[str] = None
    buffer_rows: int = DEFAULT_BUFFER_ROWS
    reuse_stats: bool = True
    defer: bool = False
    stage_bytes: int = DEFAULT_DEFER_BYTES
    # what a frame holds
    kwargs: bool = False
    containers: bool = False
    backward: bool = False
    # what a detection does
    on_detect: Union[str, Callable] = "raise"
    ignore: tuple = ()
    warn_above: Optional[float] = None
    warn_gradients: bool = False
    max_skips: int = DEFAULT_MAX_SKIPS
    # under a GradScaler: where its backoff is a detection (``scaling``)
    min_loss_scale: float = DEFAULT_MIN_LOSS_SCALE
    max_backoffs: int = DEFAULT_MAX_BACKOFFS
    # beyond the module: the op and the line that made the first nan/inf
    find_op: bool = False
    repro: Any = None
    # torch.distributed
    sync: bool = True
    sync_timeout: Optional[datetime.timedelta] = None
    # the flight recorder
    log: Any = None
    log_every: int = 1

    @classmethod
    def of(cls, **options):
        """The options, validated (an unknown name is a TypeError naming the nearest option)."""
        check_names(options)
        merged = {field.name: options.get(field.name, field.default) for field in dataclasses.fields(cls)}
        for name, check in _CHECKS.items():
            merged[name] = check(name, merged[name])
        return cls(**merged)

    def changed(self, **options):
        """These options with some replaced (validated again)."""
        return Options.of(**{**dataclasses.asdict(self), **options})

    @property
    def keeps_calls(self):
        """Whether each call's inputs are kept for a detection's replay (``find_op``, ``repro``)."""
        return self.find_op or self.repro is not None

    @property
    def explain(self):
        """Beyond the drop-in, a report ends with the lines saying where the values were born."""
        return self.kwargs or self.containers or self.backward


def check_names(options, also=()):
    """Raise a TypeError for any name in ``options`` that is neither an option nor in ``also``
    (a caller's own arguments), suggesting the nearest known name of each."""
    known = [field.name for field in dataclasses.fields(Options)] + list(also)
    unknown = [name for name in options if name not in known]
    if not unknown:
        return
    described = []
    for name in unknown:
        near = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        described.append(f"{name!r} (did you mean {near[0]!r}?)" if near else repr(name))
    raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(described)}; every option is "
                    "listed in docs/options.md")


def validated_flag(name, value):
    """A flag's value: True or False, nothing else (the string "no" is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} takes True or False, got {value!r}")
    return value


def _integer(value, name, what):
    if isinstance(value, bool):
        raise TypeError(f"{name} takes {what}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} takes {what}, got {type(value).__name__} {value!r}") from None


def _at_least(least):
    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, int):  # a ValueError, as it always was
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
    value = _integer(value, name, "an int >= 0 or None")
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
        _integer(value, name, "an int or None")
    return value


def _choice(choices):
    def check(name, value):
        if not isinstance(value, str):
            raise TypeError(f"{name} takes one of {', '.join(map(repr, choices))}, got {type(value).__name__} "
                            f"{value!r}")
        if value not in choices:
            raise ValueError(f"{name} takes one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    return check


def _backend(name, value):
    if value is None:
        return None
    return _choice(BACKEND_NAMES)(name, value)


def _on_detect(name, value):
    if callable(value):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} takes one of {', '.join(map(repr, ON_DETECT))} or a callable, got "
                        f"{type(value).__name__} {value!r}")
    if value not in ON_DETECT:
        raise ValueError(f"{name} takes one of {', '.join(map(repr, ON_DETECT))} or a callable, got {value!r}")
    return value


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
        elif not is_dashboard(target):
            raise TypeError(f"{name} takes a path, a SummaryWriter, a wandb run or a list of them, got "
                            f"{type(target).__name__}")
    return tuple(targets) if isinstance(value, (list, tuple)) else value


_CHECKS = {
    "max_frames_to_save": _max_frames,
    "trace_batch_nums": _batch_numbers,
    "abort_after_batch_num": _optional_integer,
    "check": _choice(CHECK_MODES),
    "backend": _backend,
    "buffer_rows": _at_least(1),
    "reuse_stats": validated_flag,
    "defer": validated_flag,
    "stage_bytes": _at_least(0),
    "kwargs": validated_flag,
    "containers": validated_flag,
    "backward": validated_flag,
    "on_detect": _on_detect,
    "ignore": _patterns,
    "warn_above": _fraction,
    "warn_gradients": validated_flag,
    "max_skips": _at_least(0),
    "min_loss_scale": _scale_floor,
    "max_backoffs": _at_least(0),
    "find_op": validated_flag,
    "repro": _directory,
    "sync": validated_flag,
    "sync_timeout": _timeout,
    "log": _log,
    "log_every": _at_least(1),
}


def validated(name, value):
    """One option's value, checked as ``Options.of`` checks it."""
    return _CHECKS[name](name, value)
