"""A cache of compiled modules that may be loaded: each build in a folder of its own, named by
its key (everything its module depends on), made at most once at a time across processes (a file
lock), recorded with its checksum, and loaded only from folders that nobody but this user (and
root) can change, once its bytes match that checksum: see "trust" below. A build found damaged is
made again in a fresh folder.

What is built and how is the caller's (``stats/cpu_build.py``: the C++ kernel, with torch); its
trust rule also decides where the log reader may keep its temporary files (``report/engine.py``).
Standard library only: reading a log never imports torch, and setup.py loads this file on its own
for an ahead-of-time build.
"""

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import warnings
from collections import namedtuple
from pathlib import Path

CACHE_ENV = "OVERFLOW_FAST_CACHE_DIR"
JIT_ENV = "OVERFLOW_FAST_JIT"  # "0": never build at run time (a prebuilt module or nothing)
# "1": behave as if no compiled module could be loaded (the kernel's reads go to the torch backend,
# the rest to their Python twins), so that the paths without them are tested on a machine that has them
WITHOUT_ENV = "OVERFLOW_FAST_WITHOUT_EXTENSION"
DONE = "built.json"  # written last: a directory without it holds no finished build
LOG = "build.log"
PACKAGE = Path(__file__).resolve().parent  # overflow_fast/
PREBUILT = PACKAGE / "_prebuilt"  # ahead-of-time builds (setup.py, OVERFLOW_FAST_AOT)

# What a cache holds builds of: the module's full name (its library is the last part plus .so or
# .pyd, its init function PyInit_ and that part), what messages call it (after "the"), how long a build takes.
Target = namedtuple("Target", "module what takes")


def library_names(target):
    stem = target.module.rsplit(".", 1)[-1]
    return (f"{stem}.so", f"{stem}.pyd")


class BuildError(RuntimeError):
    """A build that failed; ``str()`` is one line: the compiler's first error (the log has the rest)."""



def sources_dir(marker):
    """The folder of the C and C++ sources, the one holding ``marker``: package data in an
    installed package, ``csrc/`` beside it in a checkout; None where neither holds it."""
    for folder in (PACKAGE / "csrc", PACKAGE.parent / "csrc"):
        if (folder / marker).is_file():
            return folder
    return None


def first_error_line(log):
    """The line of a build log that says what went wrong first: the compiler's first error, else
    ninja's first failed step, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\b(error|Error|ERROR)\b", line) and not line.startswith(("ninja:", "FAILED:", "Error building")):
            return line[:300]
    for line in lines:
        if line.startswith("FAILED:"):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def cache_root():
    """Where run-time builds go: $OVERFLOW_FAST_CACHE_DIR, else overflow_fast/ under torch's own
    extensions folder ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions). A folder that is
    not private is not used (``cache_folder``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]).expanduser() / "overflow_fast"
    return default_cache_root()


def default_cache_root():
    """The cache folder when no variable names one: ~/.cache/torch_extensions/overflow_fast."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "torch_extensions" / "overflow_fast"


# ---- trust: who could have written what is loaded ------------------------------------------------
#
# Loading a module runs its code (its constructors run inside dlopen), so a module is loaded only
# from where nobody but this user and root could have put or changed it, as ssh checks its key
# files: every folder from / down to the module, and the module and its built.json, must be owned
# by this user or root and writable by neither their group nor others. Root can replace any file
# anyway (python itself), so its files cost no trust. Group-writable is refused even where the
# group holds only this user, as ssh does: a group's members are not ours to know. Write access
# given by an ACL shows in the group bits (the ACL mask), so it is refused too.
#
# One exception, for /tmp and its like: a folder *above* the cache may be writable by others if it
# is sticky (+t). In a sticky folder only an entry's owner, the folder's owner or root may rename
# or delete the entry, so the folder below it, checked next and found ours, stays ours. A
# foreign-writable folder without the sticky bit lets anyone rename our folder away and put theirs
# in its place; the cache folder itself may never be writable by others, sticky or not (anyone
# could add a build folder to it). Folders are checked from / down, so each one is known to be
# unchangeable by others before what it holds is looked at; symbolic links are resolved once, and
# everything is then found through the real path.

def _trusted(uid):
    return uid == 0 or uid == os.getuid()


def _owner(uid):
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def _entry_problem(path, st, folder, above=False):
    """Why the folder (or file) ``path``, whose lstat is ``st``, cannot be trusted, or None.
    ``above``: a folder above the cache, which may be writable by others where it is sticky."""
    if os.name != "posix":
        return None  # no owners and mode bits to go by
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        what = "a symbolic link"
    elif folder and not stat.S_ISDIR(mode):
        what = "not a folder"
    elif not folder and not stat.S_ISREG(mode):
        what = "not a regular file"
    elif not _trusted(st.st_uid):
        you = "root" if os.getuid() == 0 else f"you ({_owner(os.getuid())}) or root"
        what = f"owned by {_owner(st.st_uid)}, not by {you}"
    elif mode & 0o022 and not (above and mode & stat.S_ISVTX):
        what = "writable by " + {0o020: "its group", 0o002: "others", 0o022: "its group and others"}[mode & 0o022]
    else:
        return None
    return f"{path} is {what} (owner {_owner(st.st_uid)}, mode {stat.filemode(mode)} {stat.S_IMODE(mode):04o})"


def private_folder(path, create=False):
    """``(folder, None)`` where ``path`` and every folder above it pass the rule above, ``folder``
    being its real path (what is used from then on); else ``(folder, why not)``, naming the first
    folder that fails, its owner and its mode. ``create``: make what is missing, private (0700).
    A folder that does not exist (and is not made) holds nothing to distrust."""
    folder = Path(os.path.realpath(os.path.expanduser(str(path))))
    parts = folder.parts
    for depth in range(1, len(parts) + 1):
        current = Path(*parts[:depth])
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return folder, None
            try:
                os.mkdir(current, 0o700)  # whatever the umask: nobody else may ever reach in
            except FileExistsError:
                pass  # made meanwhile by someone else: checked below as any other
            st = os.lstat(current)
        except OSError as error:
            return folder, f"{current} cannot be examined ({type(error).__name__}: {error})"
        problem = _entry_problem(current, st, folder=True, above=depth < len(parts))
        if problem is not None:
            return folder, problem
    return folder, None


def _read_trusted(path):
    """``(content, None)`` of the file ``path``, read only if it passes the rule above (never
    through a symbolic link); ``(None, None)`` where there is none; else ``(None, why not)``."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, None
    except OSError as error:
        try:
            problem = _entry_problem(path, os.lstat(path), folder=False)
        except OSError:
            problem = None
        return None, problem or f"{path} cannot be read ({type(error).__name__}: {error})"
    with os.fdopen(fd, "rb") as file:
        problem = _entry_problem(path, os.fstat(file.fileno()), folder=False)  # the file read, not a name
        if problem is not None:
            return None, problem
        return file.read(), None


def check_build(directory, ident=None, *, target):
    """``(library, None)`` where ``directory`` holds a finished build that may be loaded: the
    folder and its files pass the rule above (the folders above it are the caller's to check:
    ``private_folder``), built.json names the module, and the module is byte for byte what its
    build recorded there (size and sha256), for ``ident`` where given. Else ``(None, (kind,
    why))``, kind one of "missing" (no finished build), "old" (recorded by an older overflow_fast,
    without a checksum), "damaged" and "unsafe"."""
    directory = Path(directory)
    try:
        problem = _entry_problem(directory, os.lstat(directory), folder=True)
    except FileNotFoundError:
        return None, ("missing", f"{directory} holds no build")
    if problem is not None:
        return None, ("unsafe", problem)
    text, problem = _read_trusted(directory / DONE)
    if problem is not None:
        return None, ("unsafe", problem)
    if text is None:
        return None, ("missing", f"{directory} holds no finished build")
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return None, ("damaged", f"{directory / DONE} is not a build record")
    if "sha256" not in record:
        return None, ("old", f"{directory} holds a build made by an older overflow_fast, without a checksum")
    for field, value in (ident or {}).items():
        if record.get(field) != value:
            return None, ("damaged", f"{directory} holds a build for {field} {record.get(field)!r}, not {value!r}")
    if record.get("library") not in library_names(target):
        return None, ("damaged", f"{directory / DONE} names no module")
    library = directory / record["library"]
    data, problem = _read_trusted(library)
    if problem is not None:
        return None, ("unsafe", problem)
    if data is None:
        return None, ("damaged", f"{library} is missing")
    if len(data) != record.get("size"):
        return None, ("damaged", f"{library} is {len(data)} bytes, not the {record.get('size')} its build "
                                 "wrote (cut short or overwritten)")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        return None, ("damaged", f"{library} is not the file its build wrote (its sha256 differs)")
    return library, None


def _write_atomic(path, text):
    """Write ``path`` whole or not at all (a reader sees the old file or the new one), mode 0644."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as file:
        if hasattr(os, "fchmod"):
            os.fchmod(file.fileno(), 0o644)  # a leftover of a killed process keeps its own mode otherwise
        file.write(text)
    os.replace(tmp, path)


def write_build_record(directory, library, info):
    """Write ``directory``'s built.json, last and atomically: ``info`` plus the module's name, size
    and sha256, which check_build compares before every load. The module is first made writable by
    its owner only (the linker follows the umask)."""
    library = Path(library)
    mode = stat.S_IMODE(os.stat(library).st_mode)
    if mode & 0o022:
        os.chmod(library, mode & ~0o022)
    data = library.read_bytes()
    record = {**info, "library": library.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_atomic(Path(directory) / DONE, json.dumps(record))


def _set_aside(directory):
    """Remove a build folder that must not be used: renamed first (one step: no process sees it
    half gone), then deleted as far as this user may."""
    if not os.path.lexists(directory):
        return
    aside = directory.with_name(f".{directory.name}.rejected-{os.getpid()}-{os.urandom(4).hex()}")
    os.rename(directory, aside)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


# ---- the cache ----------------------------------------------------------------------------------

class _FileLock:
    """An exclusive lock on a file (flock: released by the kernel if the holder dies)."""

    def __init__(self, path, on_wait=None):
        self.path = Path(path)
        self.on_wait = on_wait
        self.file = None

    def __enter__(self):
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        self.file = os.fdopen(os.open(self.path, flags, 0o600), "r+")
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (concurrent builds of one key may collide)
            return self
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.on_wait is not None:
                self.on_wait()
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.file.close()  # releases the lock
        return False


def _read(path):
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _say(message):
    sys.stderr.write(f"overflow_fast: {message}\n")
    sys.stderr.flush()


def _warn(message):
    warnings.warn(f"overflow_fast: {message}", RuntimeWarning, stacklevel=3)


def _failure_reason(record):
    try:
        return json.loads(record)["reason"]
    except (ValueError, KeyError, TypeError):
        return "an earlier build failed (its record is unreadable)"


def obtain(root, key, build_fn, describe="", ident=None, *, target):
    """The folder ``root/key`` holding a finished build that check_build accepts (for ``ident``),
    building it with ``build_fn(folder)`` if needed, at most one process at a time. Returns
    ``(folder, None, built_here)`` or ``(None, reason, built_here)``; ``folder`` is under the real
    path of ``root``, which must pass private_folder's rule (it is made, private, if missing).

    A build found damaged, not private or without a checksum is removed and made again in a
    fresh folder, under the lock (so is an unfinished one). A process that waited while another
    built the same key takes that build, or that build's failure (one failure for eight ranks,
    not eight); a later process tries again.
    """
    root, problem = private_folder(root, create=True)
    if problem is not None:
        return None, f"the cache folder is not private: {problem}", False
    directory = root / key
    if check_build(directory, ident, target=target)[0] is not None:
        return directory, None, False
    failed = root / f"{key}.failed"
    failure_before = _read_trusted(failed)[0]
    wait_start = []

    def waiting():
        wait_start.append(time.monotonic())
        _say(f"waiting for another process building the {target.what}{describe} in {directory}")

    def done_waiting(what):
        if wait_start:
            _say(f"done waiting ({time.monotonic() - wait_start[0]:.0f} s): {what}")

    with _FileLock(root / f"{key}.lock", on_wait=waiting):
        library, problem = check_build(directory, ident, target=target)
        if library is not None:
            done_waiting(f"the other process built the {target.what}{describe}: {library}")
            return directory, None, False
        failure = _read_trusted(failed)[0]
        if failure is not None and failure != failure_before:
            done_waiting(f"the other process could not build the {target.what}{describe}")
            return None, _failure_reason(failure), False
        done_waiting("the other process left no finished build; building it here")
        kind, why = problem
        if kind in ("damaged", "unsafe"):
            _warn(f"not loading the cached {target.what}: {why}; building it again in a fresh folder")
        elif kind == "old":
            _say(f"{why}; building it again")
        _set_aside(directory)
        os.mkdir(directory, 0o700)  # nobody else can reach a build's files, whatever the umask
        _say(f"building the {target.what}{describe} in {directory} ({target.takes})")
        start = time.monotonic()
        try:
            info = build_fn(directory) or {}
            library = library_in(directory, target=target)
            if library is None:
                raise BuildError(f"the build left no module in {directory}")
        except BuildError as error:
            record = json.dumps({"reason": str(error), "pid": os.getpid(), "token": os.urandom(8).hex()})
            _write_atomic(failed, record)
            _say(f"could not build the {target.what}{describe} ({time.monotonic() - start:.0f} s): {error}")
            return None, str(error), True
        failed.unlink(missing_ok=True)
        write_build_record(directory, library, info)
        _say(f"built the {target.what}{describe} in {time.monotonic() - start:.0f} s: {library}")
        return directory, None, True


def cache_folder(fresh=False):
    """``(folder, rejected)``: the cache folder to use, the first of cache_root(), the default
    one, a per-user folder in the temporary folder (and, ``fresh``, a new private one made there)
    that passes private_folder's rule; ``rejected`` says why those before it did not, or is None.
    ``folder`` is None where none passes."""
    candidates = [cache_root(), default_cache_root(), Path(tempfile.gettempdir()) / f"overflow_fast-{os.getuid()}"] \
        if hasattr(os, "getuid") else [cache_root()]
    rejected, seen = [], set()
    for candidate in candidates:
        folder, problem = private_folder(candidate)
        if folder in seen:
            continue
        seen.add(folder)
        if problem is None:
            return folder, "; ".join(rejected) or None
        rejected.append(problem)
    if fresh:
        folder, problem = private_folder(tempfile.mkdtemp(prefix=f"overflow_fast-{os.getuid()}-"))
        if problem is None:
            return folder, "; ".join(rejected)
        rejected.append(problem)
    return None, "; ".join(rejected)


def library_in(directory, *, target):
    for name in library_names(target):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def load_module(path, *, target):
    """Import the library at ``path`` as ``target.module`` (a submodule of overflow_fast)."""
    name = target.module
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == str(path):
        return existing
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    package = sys.modules.get("overflow_fast")
    if package is not None:
        setattr(package, name.rsplit(".", 1)[-1], module)  # as an imported submodule would be
    return module


def prebuilt_library(directory, ident, *, target):
    """The module prebuilt in ``directory`` (``PREBUILT / key``), if it holds one that may be loaded. The
    same rule and check as for the cache: site-packages is usually root's, or the user's own in a
    virtual environment, and not writable by others; a module there that others could replace is
    not loaded (the package's .py files beside it would be as exposed, but a module is not loaded
    on that ground alone)."""
    if not os.path.lexists(directory):
        return None
    folder, problem = private_folder(directory)
    if problem is None:
        library, found = check_build(folder, ident, target=target)
        if library is not None:
            return library
        kind, problem = found
        if kind in ("missing", "old"):
            if library_in(folder, target=target) is not None:
                _say(f"not loading the prebuilt {target.what} in {folder}: it has no checksum (built by an older "
                     "overflow_fast); reinstall with OVERFLOW_FAST_AOT to have it again")
            return None
    _warn(f"not loading the prebuilt {target.what}: {problem}")
    return None




# Other records of this user's kept under the same rules (the direct launch's verdicts: a record
# nobody else could have written, written whole, one writer at a time).
FileLock, read_trusted, write_atomic = _FileLock, _read_trusted, _write_atomic
