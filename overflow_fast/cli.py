"""``overflow-fast`` / ``python -m overflow_fast``: the package's commands. ``report`` summarises
flight-recorder logs, ``diff`` compares two, ``info`` says what runs here, ``replay`` replays a
reproducer file; each has its own ``--help``, and a usage error prints that command's usage.

``report RUN.jsonl [RUN.rank1.jsonl ...] [--png OUT.png]`` and ``diff A.jsonl B.jsonl [--png OUT.png]``
read the logs through one reader (``report/engine.py``): DuckDB where it is installed
(``overflow_fast[logs]``), Python's json into sqlite3 otherwise (said on stderr, with what it costs);
``--engine`` picks one. Every line is checked against ``schema.py``; memory is bounded. Logs
compressed with gzip, bzip2 or xz are read as they are (told by their first bytes, whatever their
names); one cut or damaged is read up to the damage, which counts as a malformed line; a zstd one
is refused (exit 1). ``--png`` draws a picture (matplotlib, ``overflow_fast[plot]``).

Exit codes: 0 ok, 1 a file that cannot be read or has no records (``diff``: no tensor entries), or
matplotlib missing for ``--png``, or DuckDB for ``--engine duckdb``, or the output's reader gone
(``| head``), 2 a usage error.
"""

import argparse
import importlib
import os
import sys
import time
from typing import Optional, Sequence

from ._version import __version__

PROGRESS_BYTES = 32 << 20  # files above this show progress (on a terminal)


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


class _PlainProgress:
    """A periodic line on stderr when tqdm is not installed."""

    def __init__(self, total):
        self.total = max(total, 1)
        self.done = 0
        self.last = 0.0

    def update(self, n):
        self.done += n
        now = time.monotonic()
        if now - self.last >= 2.0:
            self.last = now
            sys.stderr.write(f"reading: {self.done / 1e6:.0f} / {self.total / 1e6:.0f} MB "
                             f"({100 * self.done / self.total:.0f}%)\n")
            sys.stderr.flush()

    def close(self):
        sys.stderr.write(f"reading: done, {self.done / 1e6:.0f} MB\n")


def _progress(total, forced):
    """tqdm (or a plain line) on stderr: for big files on a terminal, or always with --progress."""
    if forced is False:
        return _NoProgress()
    if forced is None and not (total >= PROGRESS_BYTES and sys.stderr.isatty()):
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="B", unit_scale=True, desc="reading", file=sys.stderr, mininterval=0.5)


def build_parser():
    """The parser of the command line (each command's own: ``_command_parser``)."""
    parser = argparse.ArgumentParser(
        prog="overflow-fast", description="overflow_fast's commands, one per line below; "
                                          "`overflow-fast COMMAND --help` says more of each.",
        epilog="The detector itself is a library: overflow_fast.watch(model) or "
               "overflow_fast.DebugUnderflowOverflow(model) in your training script (README.md).")
    parser.add_argument("--version", action="version", version=f"overflow-fast {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    report = commands.add_parser(
        "report", help="summarise a recorded run; --png draws headroom per module over steps",
        description="Summarise a flight-recorder log: steps, the first nan/inf, the modules closest to "
                    "their dtype's limit, underflow hot spots. With --png, draw a heatmap of headroom "
                    "(bits below the dtype's largest finite value, coloured as a share of that dtype's range) "
                    "per module over steps.")
    report.add_argument("logs", nargs="+", metavar="RUN.jsonl",
                        help="log file(s), e.g. one per rank; gzip, bzip2 or xz compressed ones too")
    report.add_argument("--curves", type=int, default=5, metavar="N",
                        help="under the heatmap: the headroom curves of the N modules closest to overflow, and "
                             "the fractions of up to N (at most 4) underflow hot spots (default 5)")
    diff = commands.add_parser(
        "diff", help="where two recorded runs first part; --png draws the divergence per module over steps",
        description="Align the tensor entries of two flight-recorder logs by (rank, step, phase, module, entry) "
                    "and name the first pair whose statistics part: abs min or abs max differing by more than "
                    "--rtol of the larger (abs max only where the runs' dtypes differ), or a nan/inf in one run "
                    "only. Then the largest divergence of each module, and what only one run recorded (ranks, "
                    "steps, modules, entries), named apart.")
    diff.add_argument("log_a", metavar="A.jsonl", help="the run compared against (gzip, bzip2 or xz compressed too)")
    diff.add_argument("log_b", metavar="B.jsonl", help="the other run")
    diff.add_argument("--rtol", type=_tolerance, default=0.01, metavar="R",
                      help="relative tolerance: a pair parts where |A - B| > R * max(A, B) (default 0.01)")
    diff.add_argument("--atol", type=_tolerance, default=0.0, metavar="T",
                      help="differences of at most T count as none (default 0)")
    diff.add_argument("--stat", choices=("both", "abs_max", "abs_min"), default="both",
                      help="the statistics compared (default both; abs_max leaves out abs min, which rounding "
                           "moves by orders of magnitude in a large tensor)")
    diff.add_argument("--curves", type=int, default=5, metavar="N",
                      help="under the heatmap: the divergence curves of the N modules that diverge most (default 5)")
    for command in (report, diff):
        command.add_argument("--png", metavar="OUT.png", help="write a picture (needs matplotlib: "
                                                              "pip install overflow_fast[plot])")
        command.add_argument("--size", metavar="WxH", type=_size, default=None,
                             help="picture size in pixels (default: from the number of modules)")
        command.add_argument("--engine", choices=("auto", "duckdb", "python"), default="auto",
                             help="what reads the logs: DuckDB (pip install overflow_fast[logs]), Python's json "
                                  "(about a tenth of the speed), or auto: DuckDB when it is installed (default)")
        command.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                             help="threads DuckDB reads with (default: one per CPU)")
        progress = command.add_mutually_exclusive_group()
        progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                              help="always show progress on stderr")
        progress.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")
    commands.add_parser(
        "info", help="what runs here: versions, the C++ kernel, backends, devices",
        description="What runs here, one fact a line: the versions of overflow_fast, Python, torch and "
                    "Triton; the C++ CPU kernel (its instruction set, its file and cache, or why it is "
                    "unavailable); the log reader; the default backend of each device type; the CUDA devices "
                    "and how the per-hook read runs on each; the environment variables that change any of it. "
                    "Builds the C++ kernel first if this environment has none yet (about a minute).")
    replay = commands.add_parser(
        "replay", help="replay a reproducer file (repro=DIR) and print its Op: line",
        description="Replay the one module call a reproducer file holds (written with repro=DIR at a "
                    "detection), every op checked, and print the Op: line naming the op and the line of "
                    "code that made the first nan/inf. WARNING: the file is a pickle (torch.save of the "
                    "module and its inputs) and loading a pickle runs code: replay only files you trust.")
    replay.add_argument("file", metavar="FILE.pt", help="overflow-rank<r>-step<s>.pt, from repro=DIR")
    replay.add_argument("--map-location", metavar="DEVICE", default=None,
                        help="load the file's tensors onto DEVICE (e.g. cpu, for a file written on a GPU)")
    return parser


def _command_parser(parser, name):
    """The parser of the command ``name``: its usage is the one a mistake there prints."""
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return commands.choices[name]


def _size(text):
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 1600x1000, got {text!r}")
    if not (100 <= width <= 10000 and 100 <= height <= 10000):
        raise argparse.ArgumentTypeError("width and height must be between 100 and 10000 pixels")
    return width, height


def _tolerance(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _jobs(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {text!r}")
    return value


def _read(args, groups, build):
    """``build(logs)`` of ``groups`` of logs read with the engine ``--engine`` asks for (auto: DuckDB
    where installed, the json reader if DuckDB fails); (result, the logs' notes) or (None, exit status)."""
    from .report import engine
    from .report.logfile import BadFile, check_readable

    paths = [path for group in groups for path in group]
    choice = args.engine
    if choice == "duckdb" and "duckdb" not in engine.available_engines():
        print("overflow-fast: --engine duckdb needs DuckDB 1.3 or newer; install it with: "
              "pip install overflow_fast[logs]", file=sys.stderr)
        return None, 1
    if choice == "auto" and "duckdb" not in engine.available_engines():
        print(f"overflow-fast: {engine.FALLBACK_NOTE}", file=sys.stderr)
    try:
        total = check_readable(paths)
        while True:
            bar = _progress(total, args.progress)
            try:
                with engine.Logs(groups, choice, threads=args.jobs, progress=bar) as logs:
                    return build(logs), logs.notes
            except engine.EngineError as error:
                if choice != "auto":
                    raise BadFile(str(error)) from None
                print(f"overflow-fast: {error}; reading with Python's json instead", file=sys.stderr)
                choice = "python"
            finally:
                bar.close()
    except BadFile as error:
        print(f"overflow-fast: {error}", file=sys.stderr)
        return None, 1


def run_report(args):
    from .report import logfile, summary

    plot = _drawing("plot") if args.png else None
    if args.png and plot is None:
        return 1
    paths = logfile.unique_paths(args.logs)
    result, notes = _read(args, [paths], lambda logs: summary.Summary(logs, bins=plot is not None))
    if result is None:
        return notes
    if result.records == 0:
        print(f"overflow-fast: no flight-recorder records in {', '.join(args.logs)}"
              + (f" ({result.malformed} malformed lines; first: {summary.malformed_names(result.notes)})"
                 if result.malformed else ""), file=sys.stderr)
        return 1
    print(summary.summary_text(result))
    if plot is None:
        return 0
    return _draw(plot, result, result.entries, "tensor entries", args, ", ".join(os.path.basename(p) for p in paths))


def run_diff(args):
    from .report import diff as diffing

    plot = _drawing("diff_plot") if args.png else None
    if args.png and plot is None:
        return 1
    paths = [args.log_a, args.log_b]
    options = dict(rtol=args.rtol, atol=args.atol, stat=args.stat, grid=plot is not None)
    result, notes = _read(args, [[path] for path in paths], lambda logs: diffing.Diff(logs, **options))
    if result is None:
        return notes
    empty = [side for side in result.sides if not side.entries]
    if empty:
        side = empty[0]
        malformed = side.notes.malformed_lines
        print(f"overflow-fast: no tensor entries in {', '.join(s.path for s in empty)}"
              + (f" ({side.notes.malformed} malformed lines; first: line {malformed[0][1]} ({malformed[0][2]}))"
                 if malformed else ""), file=sys.stderr)
        return 1
    print(result.text())
    if plot is None:
        return 0
    return _draw(plot, result, result.pairs or any(side.only for side in result.sides), "aligned entries", args,
                 " vs ".join(os.path.basename(p) for p in paths))


def _drawing(name):
    """``--png``'s module ``report.<name>``, asked before a big file is read; None, said, without
    matplotlib."""
    try:
        return importlib.import_module(f"{__package__}.report.{name}")
    except ImportError as error:
        print(f"overflow-fast: --png needs matplotlib ({error}); install it with: "
              f"pip install overflow_fast[plot]", file=sys.stderr)
        return None


def _draw(plot, drawn, rows, what, args, title_source):
    """``--png``: ``plot`` draws ``drawn`` (a summary or a diff) where it has ``rows`` of ``what``;
    the exit status."""
    if not rows:
        print(f"overflow-fast: no {what} to draw", file=sys.stderr)
        return 1
    try:
        size = plot.draw(drawn, args.png, size=args.size, curves=args.curves, title_source=title_source)
    except OSError as error:
        print(f"overflow-fast: cannot write {args.png}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"\npicture: {args.png} ({size[0]}x{size[1]} pixels)")
    return 0


def run_replay(args):
    from .replay import op_replay, repro

    try:
        payload = repro.load_repro(args.file, map_location=args.map_location)
    except repro.ReproError as error:
        print(f"overflow-fast: {error}", file=sys.stderr)
        return 1
    detection = payload.get("detection") or {}
    # the call replayed: the module whose own code ran the op (an enclosing one where the module the
    # detection names is torch's own, as a Linear is)
    name = payload.get("name")
    if name is None:  # a file written before it named its module
        name = detection.get("module")
    replayed = f"{name or '(model)'} ({type(payload['module']).__name__})"
    shown = detection.get("module")
    first = f", where {shown or '(model)'} ({detection.get('class')}) first showed it" if shown not in (None, name) else ""
    print(f"{args.file}: {payload['phase']} of {replayed}{first}, rank {payload.get('rank') or 0}, "
          f"step {payload.get('step') or 0}; written by torch {payload.get('torch_version')}, "
          f"overflow_fast {payload.get('overflow_fast_version')}")
    if payload.get("torch_version") != torch_version():
        print(f"note: this is torch {torch_version()}: the replay may differ", file=sys.stderr)
    result = repro.replay_repro(payload)
    recorded = detection.get("op") or {}
    if result.get("op") is not None and result.get("file") is None and result["op"] == recorded.get("op"):
        # no line of code outside torch ran it: the module whose torch code did, as the run named it
        result = {**result, "module": recorded.get("module")}
    print(op_replay.op_line(result))
    return 0


def torch_version():
    import torch

    return torch.__version__


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)  # usage errors exit with 2
    if unknown:  # said with the command's own usage, not the top level's
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("report", "diff"):
        try:
            code = run_report(args) if args.command == "report" else run_diff(args)
            sys.stdout.flush()
            return code
        except BrokenPipeError:  # its reader left (`| head`): what was cut off is said by the exit code alone
            _silence_stdout()
            return 1
    if args.command == "info":
        from .info import main as info_main
        return info_main()
    if args.command == "replay":
        return run_replay(args)
    parser.error(f"unknown command {args.command!r}")  # exits with 2
    return 2


def _silence_stdout():
    """Stdout to /dev/null, so that the interpreter's own flush at exit meets no broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
