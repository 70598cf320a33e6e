"""What the C++ kernel's cache loads (overflow_fast/stats/cpu_build.py): only a module in folders
nobody but this user (and root) can change, and only when its bytes match the checksum its build
recorded. Loading a module runs its code, so every test here plants a library whose constructor
writes a marker file, and a planted module "did not run" means that marker is absent; the control
tests show the same library does run where it is trusted.

Most cases run cpu_build.load() in a small subprocess (cpu_build.py alone, no torch) with a
stand-in build (it copies a tiny library) and a stand-in loader (dlopen through ctypes: the
constructors run as with the real import), so they take milliseconds; a damaged module would kill
the process with SIGBUS, which is why it is a subprocess. The "real" tests import overflow_fast
and compute a row. The owner cases chown to nobody, so they need root."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from overflow_fast.stats import cpu_build

ROOT = Path(__file__).resolve().parents[1]
CPU_BUILD = ROOT / "overflow_fast" / "stats" / "cpu_build.py"
NOBODY = 65534
MARKERS_ENV = "OVERFLOW_FAST_TEST_MARKERS"
needs_root = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                                reason="chown to another user needs root")

# What the stand-in builds are for: a key of its own, so nothing here touches a real build.
FAKE_IDENT = {"isa": "avx2", "torch": "0.0.test", "cxx11_abi": 1, "python": sys.implementation.cache_tag,
              "sources": "0123456789abcdef"}
FAKE_KEY = cpu_build.cache_key(FAKE_IDENT)

# A shared library whose constructor appends this process's id to $OVERFLOW_FAST_TEST_MARKERS/<TAG>.
# The tables make it span several pages of every segment (~280 KB), as the real module does, so
# that a copy cut short at 4 KB or 64 KB ends inside what the loader maps.
_MARKER_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((used)) static const char read_only_table[131072] = {1};
__attribute__((used)) static char writable_table[131072] = {1};
__attribute__((constructor)) static void mark(void) {
  const char *dir = getenv("OVERFLOW_FAST_TEST_MARKERS");
  if (!dir) return;
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, TAG);
  FILE *f = fopen(path, "a");
  if (f) { fprintf(f, "%d\n", (int)getpid()); fclose(f); }
}
"""


@pytest.fixture(scope="session")
def libs(tmp_path_factory):
    """{"planted": path, "good": path}: the library an attacker would plant, and the one the
    stand-in build makes."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which(cpu_build.compiler())
    if compiler is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("marker_libs")
    source = folder / "marker.c"
    source.write_text(_MARKER_SOURCE)
    out = {}
    for tag in ("planted", "good"):
        out[tag] = folder / f"{tag}.so"
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", f'-DTAG="{tag}"', "-o", str(out[tag]), str(source)],
                       check=True, capture_output=True, timeout=120)
    return out


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def plant(directory, library, ident=FAKE_IDENT):
    """A finished build of ``library`` in ``directory``, with a record that matches it (whoever
    can write there can write a valid record too)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(library, directory / "_C.so")
    data = (directory / "_C.so").read_bytes()
    record = {**ident, "seconds": 1.0, "library": "_C.so", "size": len(data), "sha256": sha256(data)}
    (directory / cpu_build.DONE).write_text(json.dumps(record))
    return directory / "_C.so"


def private(path):
    """A folder of ours that nobody else can write (pytest's own are 0700 already)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def folder(path):
    """``path``, made private if it is not there (a test may have set its mode already)."""
    return path if path.is_dir() else private(path)


# cpu_build.py alone, with the stand-in build and loader; prints what load() returned.
_WORKER = textwrap.dedent("""
    import ctypes, importlib.util, json, os, shutil, sys, types, warnings
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[1])
    cpu_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_build)
    ident, good = json.loads(sys.argv[2]), sys.argv[3]
    if os.environ.get("TEST_PREBUILT"):
        cpu_build.PREBUILT = Path(os.environ["TEST_PREBUILT"])
    cpu_build.identity = lambda isa, sources=None: dict(ident)
    cpu_build.detect_isa = lambda: ident["isa"]
    builds = []

    def build(isa, build_dir, sources=None, ident=None, verbose=False):
        builds.append(str(build_dir))
        shutil.copy(good, os.path.join(build_dir, "_C.so"))
        return Path(build_dir) / "_C.so"

    def load_module(path):
        ctypes.CDLL(str(path))  # dlopen: the library's constructors run, as on a real import
        return types.SimpleNamespace(__file__=str(path))

    cpu_build.build = build
    cpu_build.load_module = load_module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, reason, details = cpu_build.load()
    print("RESULT " + json.dumps({
        "path": getattr(module, "__file__", None), "reason": reason, "builds": builds,
        "details": {k: v for k, v in details.items() if isinstance(v, (str, bool, type(None)))},
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }), flush=True)
""")


def _environment(tmp_path, **env):
    """The environment of a process under test: no cache variable of the caller's, the default
    cache folder and the temporary folder inside tmp_path, the markers' folder."""
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith("OVERFLOW_FAST_") and k not in ("TORCH_EXTENSIONS_DIR", "CXX")}
    environment.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), TMPDIR=str(folder(tmp_path / "tmp")),
                       **{MARKERS_ENV: str(folder(tmp_path / "markers"))})
    environment.update({k: str(v) for k, v in env.items()})
    return environment


def run_load(tmp_path, libs, **env):
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(CPU_BUILD), json.dumps(FAKE_IDENT), str(libs["good"])],
                          capture_output=True, text=True, env=_environment(tmp_path, **env), timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode} (-7: SIGBUS, -11: SIGSEGV)\n{proc.stderr[-3000:]}"
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    result["stderr"] = proc.stderr
    return result


def ran(tmp_path, tag):
    """Whether the library tagged ``tag`` ran its code in a process under test."""
    return (tmp_path / "markers" / tag).exists()


def default_root(tmp_path):
    return tmp_path / "xdg" / "torch_extensions" / "overflow_fast"


# ---- the controls: where it is trusted, a planted module is loaded (and its marker written) ------

@pytest.mark.parametrize("layout", ["private", "readable by all", "under a sticky folder writable by all"])
def test_a_module_in_a_private_cache_is_loaded(tmp_path, libs, layout):
    """What makes the other tests meaningful: this loader runs the library's code."""
    root = {"private": lambda: private(tmp_path / "cache"),
            "readable by all": lambda: private(tmp_path / "cache"),
            "under a sticky folder writable by all": lambda: private(tmp_path / "shared" / "mine")}[layout]()
    if layout == "readable by all":
        os.chmod(root, 0o755)
    if layout == "under a sticky folder writable by all":
        os.chmod(root.parent, 0o1777)  # as /tmp is: our folder in it stays ours
    library = plant(root / FAKE_KEY, libs["planted"])
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root)
    assert result["path"] == str(library) and result["reason"] is None and result["builds"] == []
    assert result["warnings"] == [] and ran(tmp_path, "planted")


# ---- a cache folder others can change: not used at all ------------------------------------------

def _chowned(path):
    os.chown(path, NOBODY, NOBODY)
    return path


def _layout(name, tmp_path, planted):
    """(environment, the folder the warning must name, a folder to remove afterwards or None) for
    each way a cache can be open to others; each holds ``planted`` as a finished build."""
    if name == "tmp shared by another user":  # TORCH_EXTENSIONS_DIR in the real /tmp, another user's
        shared = Path(tempfile.mkdtemp(prefix="overflow_fast-test-shared-", dir="/tmp"))
        plant(shared / "overflow_fast" / FAKE_KEY, planted)
        for path in (shared / "overflow_fast" / FAKE_KEY, shared / "overflow_fast", shared):
            _chowned(path)
        os.chmod(shared, 0o777)
        return {"TORCH_EXTENSIONS_DIR": shared}, shared, shared
    if name == "folder above writable by all, not sticky":
        cache = private(tmp_path / "open" / "cache")
        plant(cache / FAKE_KEY, planted)
        os.chmod(cache.parent, 0o777)
        return {"OVERFLOW_FAST_CACHE_DIR": cache}, cache.parent, None
    if name == "link to a folder of another user":
        theirs = tmp_path / "theirs"
        plant(theirs / FAKE_KEY, planted)
        os.chmod(theirs, 0o755)
        _chowned(theirs)
        (tmp_path / "link").symlink_to(theirs)
        return {"OVERFLOW_FAST_CACHE_DIR": tmp_path / "link"}, theirs, None
    cache = tmp_path / "cache"
    plant(cache / FAKE_KEY, planted)
    if name == "owned by nobody":
        os.chmod(cache, 0o755)
        _chowned(cache)
    else:
        os.chmod(cache, {"writable by all": 0o777, "writable by all, sticky": 0o1777,
                         "writable by its group": 0o775, "group rwx": 0o770}[name])
    return {"OVERFLOW_FAST_CACHE_DIR": cache}, cache, None


@pytest.mark.parametrize("name, owner, why, mode", [
    pytest.param("owned by nobody", "nobody", "owned by nobody, not by", "drwxr-xr-x 0755", marks=needs_root),
    ("writable by all", None, "writable by its group and others", "drwxrwxrwx 0777"),
    ("writable by all, sticky", None, "writable by its group and others", "drwxrwxrwt 1777"),
    ("writable by its group", None, "writable by its group", "drwxrwxr-x 0775"),
    ("group rwx", None, "writable by its group", "drwxrwx--- 0770"),
    ("folder above writable by all, not sticky", None, "writable by its group and others", "drwxrwxrwx 0777"),
    pytest.param("tmp shared by another user", "nobody", "owned by nobody", "drwxrwxrwx 0777", marks=needs_root),
    pytest.param("link to a folder of another user", "nobody", "owned by nobody", "drwxr-xr-x 0755",
                 marks=needs_root),
])
def test_a_cache_others_can_change_is_not_used(tmp_path, libs, name, owner, why, mode):
    env, folder, remove = _layout(name, tmp_path, libs["planted"])
    try:
        result = run_load(tmp_path, libs, **env)
    finally:
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
    assert not ran(tmp_path, "planted")
    # one warning: the folder, its owner and its mode, and where the build went instead
    assert len(result["warnings"]) == 1, result
    message = result["warnings"][0]
    owner = owner or cpu_build._owner(os.getuid())
    assert f"{folder} is {why}" in message and f"(owner {owner}, mode {mode})" in message, message
    # built, and loaded, in the default cache folder (made private), with the build's own module
    assert result["path"] == str(default_root(tmp_path) / FAKE_KEY / "_C.so") and ran(tmp_path, "good")
    assert f"using {default_root(tmp_path)} instead" in message
    assert result["details"]["cache_root"] == str(default_root(tmp_path))
    assert result["details"]["cache_rejected"].startswith(str(folder))
    assert stat.S_IMODE(default_root(tmp_path).stat().st_mode) == 0o700


def test_when_the_default_folder_is_not_private_either_a_per_user_temporary_one_is_used(tmp_path, libs):
    cache = tmp_path / "cache"
    plant(cache / FAKE_KEY, libs["planted"])
    os.chmod(cache, 0o777)
    plant(default_root(tmp_path) / FAKE_KEY, libs["planted"])
    os.chmod(tmp_path / "xdg", 0o777)
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=cache)
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    fallback = tmp_path / "tmp" / f"overflow_fast-{os.getuid()}"
    assert result["path"] == str(fallback / FAKE_KEY / "_C.so")
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700
    (message,) = result["warnings"]
    assert f"{cache} is writable" in message and f"{tmp_path / 'xdg'} is writable" in message


@needs_root
def test_a_per_user_temporary_folder_taken_by_another_user_gives_a_fresh_one(tmp_path, libs):
    cache = tmp_path / "cache"
    plant(cache / FAKE_KEY, libs["planted"])
    os.chmod(cache, 0o777)
    os.chmod(private(tmp_path / "xdg"), 0o777)
    taken = tmp_path / "tmp" / f"overflow_fast-{os.getuid()}"
    private(tmp_path / "tmp")
    plant(taken / FAKE_KEY, libs["planted"])
    _chowned(taken)
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=cache)
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    fresh = Path(result["path"]).parent.parent
    assert fresh.parent == tmp_path / "tmp" and fresh.name.startswith(f"overflow_fast-{os.getuid()}-")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_no_private_folder_at_all_falls_back_with_the_reason(tmp_path, libs):
    cache = tmp_path / "cache"
    plant(cache / FAKE_KEY, libs["planted"])
    os.chmod(cache, 0o777)
    os.chmod(private(tmp_path / "xdg"), 0o777)
    os.chmod(private(tmp_path / "tmp"), 0o777)  # not sticky: nothing made in it can be trusted
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=cache)
    assert not ran(tmp_path, "planted") and not ran(tmp_path, "good")
    assert result["path"] is None and result["builds"] == []
    assert result["reason"].startswith(f"no private folder for the C++ kernel's cache ({cache} is writable")
    assert "OVERFLOW_FAST_CACHE_DIR" in result["reason"]


# ---- inside a private cache: a build folder or file others could change is made again ----------

@pytest.mark.parametrize("name", [
    pytest.param("build folder owned by nobody", marks=needs_root),
    pytest.param("module owned by nobody", marks=needs_root),
    pytest.param("record owned by nobody", marks=needs_root),
    "module writable by others",
    "record writable by its group",
    "build folder writable by all",
    "module is a link",
])
def test_a_build_others_could_change_is_built_again(tmp_path, libs, name):
    root = private(tmp_path / "cache")
    library = plant(root / FAKE_KEY, libs["planted"])
    entry = {"build folder owned by nobody": root / FAKE_KEY, "module owned by nobody": library,
             "record owned by nobody": root / FAKE_KEY / cpu_build.DONE, "module writable by others": library,
             "record writable by its group": root / FAKE_KEY / cpu_build.DONE,
             "build folder writable by all": root / FAKE_KEY, "module is a link": library}[name]
    if "nobody" in name:
        _chowned(entry)
    elif name == "module writable by others":
        os.chmod(entry, 0o757)
    elif name == "record writable by its group":
        os.chmod(entry, 0o664)
    elif name == "build folder writable by all":
        os.chmod(entry, 0o777)
    else:  # a link to a copy elsewhere: the record matches what it points to
        target = tmp_path / "elsewhere.so"
        library.rename(target)
        library.symlink_to(target)
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root)
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    assert result["path"] == str(library) and result["builds"] == [str(root / FAKE_KEY)]
    (message,) = result["warnings"]
    assert message.startswith(f"overflow_fast: not loading the cached C++ kernel: {entry} is "), message
    assert "owner " in message and "mode " in message and "building it again in a fresh folder" in message
    assert cpu_build.check_build(root / FAKE_KEY, FAKE_IDENT)[1] is None  # the new build passes


# ---- a damaged module: verified before it is loaded, never a crash -------------------------------

def _damage(library, how):
    data = library.read_bytes()
    damaged = {
        "cut to 4 KB": data[:4096],
        "cut to 64 KB": data[:65536],
        "cut to half": data[:len(data) // 2],
        "garbage": os.urandom(len(data)),
        "ELF header, then zeros": data[:64] + bytes(len(data) - 64),
        "one byte changed": data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:],
    }[how]
    library.write_bytes(damaged)


DAMAGE = ["cut to 4 KB", "cut to 64 KB", "cut to half", "garbage", "ELF header, then zeros", "one byte changed"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_module_is_built_again(tmp_path, libs, how):
    root = private(tmp_path / "cache")
    library = plant(root / FAKE_KEY, libs["planted"])
    _damage(library, how)
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root)  # asserts exit 0: no SIGBUS
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    assert result["path"] == str(library) and result["builds"] == [str(root / FAKE_KEY)]
    (message,) = result["warnings"]
    why = "not the file its build wrote" if how in ("garbage", "ELF header, then zeros", "one byte changed") \
        else "cut short or overwritten"
    assert f"not loading the cached C++ kernel: {library} is " in message and why in message, message
    assert cpu_build.check_build(root / FAKE_KEY, FAKE_IDENT)[1] is None
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the damaged folder is gone


@pytest.mark.parametrize("record", ["another torch", "another C++ ABI", "not JSON", "names no module",
                                    "module missing"])
def test_a_build_recorded_for_something_else_is_built_again(tmp_path, libs, record):
    root = private(tmp_path / "cache")
    library = plant(root / FAKE_KEY, libs["planted"])
    done = root / FAKE_KEY / cpu_build.DONE
    info = json.loads(done.read_text())
    if record == "another torch":
        info["torch"] = "9.9.9"
    elif record == "another C++ ABI":
        info["cxx11_abi"] = 0
    elif record == "names no module":
        info["library"] = "../../elsewhere.so"
    elif record == "module missing":
        library.unlink()
    done.write_text("{not json" if record == "not JSON" else json.dumps(info))
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root)
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    assert result["path"] == str(library) and len(result["warnings"]) == 1, result
    assert "not loading the cached C++ kernel" in result["warnings"][0]


def test_a_build_without_a_checksum_is_built_again(tmp_path, libs):
    """A build made by an older overflow_fast recorded no checksum: its module is never loaded
    unverified; it is built again, with one line on stderr (no warning: nothing is wrong)."""
    root = private(tmp_path / "cache")
    library = plant(root / FAKE_KEY, libs["planted"])
    done = root / FAKE_KEY / cpu_build.DONE
    done.write_text(json.dumps({**FAKE_IDENT, "seconds": 50.0}))  # what the older version wrote
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root)
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    assert result["path"] == str(library) and result["warnings"] == []
    assert f"overflow_fast: {root / FAKE_KEY} holds a build made by an older overflow_fast, without a checksum; " \
           "building it again" in result["stderr"]


def test_with_jit_off_a_damaged_module_is_not_loaded_and_the_reason_says_why(tmp_path, libs):
    root = private(tmp_path / "cache")
    library = plant(root / FAKE_KEY, libs["planted"])
    _damage(library, "cut to half")
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root, OVERFLOW_FAST_JIT="0")
    assert not ran(tmp_path, "planted") and result["path"] is None and result["builds"] == []
    assert "OVERFLOW_FAST_JIT=0 forbids building one; the cached one cannot be used: " in result["reason"]
    assert f"{library} is " in result["reason"] and "cut short" in result["reason"]


# ---- the prebuilt modules in the package ---------------------------------------------------------

@pytest.mark.parametrize("name", [
    "trusted", "folder writable by all", pytest.param("module owned by nobody", marks=needs_root),
    "no checksum", "cut short",
])
def test_a_prebuilt_module_is_loaded_only_when_trusted_and_intact(tmp_path, libs, name):
    prebuilt = private(tmp_path / "package" / "_prebuilt")
    os.chmod(prebuilt, 0o755)
    library = plant(prebuilt / FAKE_KEY, libs["planted"])
    if name == "folder writable by all":
        os.chmod(prebuilt, 0o777)
    elif name == "module owned by nobody":
        _chowned(library)
    elif name == "no checksum":  # what setup.py wrote before it recorded one: the module alone
        (prebuilt / FAKE_KEY / cpu_build.DONE).unlink()
    elif name == "cut short":
        _damage(library, "cut to 64 KB")
    root = private(tmp_path / "cache")
    result = run_load(tmp_path, libs, OVERFLOW_FAST_CACHE_DIR=root, TEST_PREBUILT=prebuilt)
    if name == "trusted":
        assert result["path"] == str(library) and ran(tmp_path, "planted") and result["builds"] == []
        assert result["details"]["origin"] == "prebuilt"
        return
    assert not ran(tmp_path, "planted") and ran(tmp_path, "good")
    assert result["path"] == str(root / FAKE_KEY / "_C.so") and result["details"]["origin"] == "cache"
    if name == "no checksum":
        assert result["warnings"] == []
        assert f"not loading the prebuilt C++ kernel in {prebuilt / FAKE_KEY}: it has no checksum" in result["stderr"]
    else:
        (message,) = result["warnings"]
        assert message.startswith("overflow_fast: not loading the prebuilt C++ kernel: ")
        if name == "cut short":
            assert f"{library} is 65536 bytes, not the " in message and "cut short" in message
        else:
            entry = prebuilt if name == "folder writable by all" else library
            assert f"{entry} is " in message and "mode " in message


# ---- what a build leaves ---------------------------------------------------------------------------

def test_what_a_build_makes_is_private_whatever_the_umask(tmp_path):
    root = tmp_path / "new" / "cache"

    def loose_build(directory):
        library = Path(directory) / "_C.so"
        library.write_bytes(b"\x7fELF a module" * 100)
        os.chmod(library, 0o777)  # a linker under umask 000
        return {"seconds": 0}

    previous = os.umask(0)
    try:
        directory, reason, built = cpu_build.obtain(root, "key", loose_build)
    finally:
        os.umask(previous)
    assert reason is None and built
    for folder in (tmp_path / "new", root, root / "key"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE((root / "key" / "_C.so").stat().st_mode) & 0o022 == 0
    assert stat.S_IMODE((root / "key" / cpu_build.DONE).stat().st_mode) == 0o644
    assert stat.S_IMODE((root / "key.lock").stat().st_mode) == 0o600
    record = json.loads((root / "key" / cpu_build.DONE).read_text())
    data = (root / "key" / "_C.so").read_bytes()
    assert record == {"seconds": 0, "library": "_C.so", "size": len(data), "sha256": sha256(data)}
    assert not [p.name for p in (root / "key").iterdir() if p.name.endswith(".tmp")]  # written by rename


def test_obtain_refuses_a_root_others_can_write(tmp_path):
    root = private(tmp_path / "cache")
    os.chmod(root, 0o777)
    directory, reason, built = cpu_build.obtain(root, "key", lambda d: pytest.fail("must not build"))
    assert directory is None and not built
    assert reason.startswith(f"the cache folder is not private: {root} is writable by its group and others")


@pytest.mark.parametrize("mode, above, ok", [
    (0o755, False, True), (0o700, False, True), (0o775, False, False), (0o757, False, False),
    (0o1777, False, False),  # the cache folder itself: never, sticky or not
    (0o1777, True, True),  # a folder above it, as /tmp
    (0o1775, True, True), (0o777, True, False), (0o775, True, False),
])
def test_the_rule_for_one_folder(tmp_path, mode, above, ok):
    folder = tmp_path / "f"
    folder.mkdir()
    os.chmod(folder, mode)
    problem = cpu_build._entry_problem(folder, os.lstat(folder), folder=True, above=above)
    assert (problem is None) == ok, problem


# ---- the real package: a damaged or planted module never kills or runs in the user's process ---

_STATS = textwrap.dedent("""
    import warnings
    warnings.simplefilter("always")
    import torch, overflow_fast
    x = torch.tensor([1.0, float("inf"), -3.0, float("nan")])
    row = overflow_fast.tensor_stats([x]).tolist()[0]
    assert row["posinf"] == 1 and row["nan"] == 1 and row["numel"] == 4, row
    print("ROW OK", flush=True)
""")


def _real_key(root, monkeypatch=None):
    """The identity and key of the build that the package loads or makes in the cache folder
    ``root``, as the product decides it on this CPU: under _run_stats's compiler (given
    ``monkeypatch``), or this environment's. An AVX-512 CPU gets an AVX2 build where the compiler
    cannot build AVX-512 code (CXX=false cannot build anything)."""
    if monkeypatch is not None:
        monkeypatch.setenv("CXX", RUN_STATS_CXX)
    ident = cpu_build.identity(cpu_build.isa_to_build(root))
    return ident, cpu_build.cache_key(ident)


RUN_STATS_CXX = "false"


def _run_stats(tmp_path, **env):
    """tensor_stats on a CPU tensor in a fresh process, with a compiler that fails at once (CXX=false):
    a rebuild is tried and fails in seconds, and the torch backend answers."""
    environment = _environment(tmp_path, CXX=RUN_STATS_CXX, **env)
    proc = subprocess.run([sys.executable, "-c", _STATS], capture_output=True, text=True, env=environment,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "ROW OK" in proc.stdout, \
        f"exit {proc.returncode} (-7: SIGBUS, -11: SIGSEGV)\n{proc.stderr[-3000:]}"
    return proc.stderr


@pytest.mark.parametrize("how", ["cut to 4 KB", "cut to 64 KB", "cut to half", "garbage"])
def test_a_damaged_kernel_never_kills_the_process(tmp_path, libs, how, monkeypatch):
    root = private(tmp_path / "cache")
    ident, key = _real_key(root, monkeypatch)
    library = plant(root / key, libs["planted"], ident)
    _damage(library, how)
    stderr = _run_stats(tmp_path, OVERFLOW_FAST_CACHE_DIR=root)
    assert not ran(tmp_path, "planted")
    warned = [line for line in stderr.splitlines() if "RuntimeWarning" in line]
    assert any(f"not loading the cached C++ kernel: {library} is " in line for line in warned), stderr
    assert f"building the C++ kernel ({ident['isa']}, torch {ident['torch']}) in {root / key}" in stderr
    assert not library.exists() and (root / key / cpu_build.LOG).is_file()  # set aside; the rebuild's log


@needs_root
def test_a_kernel_planted_in_a_cache_of_another_user_never_runs(tmp_path, libs, monkeypatch):
    ident, key = _real_key(default_root(tmp_path), monkeypatch)  # where the build goes instead
    cache = tmp_path / "cache"
    plant(cache / key, libs["planted"], ident)
    os.chmod(cache, 0o777)
    _chowned(cache)
    stderr = _run_stats(tmp_path, OVERFLOW_FAST_CACHE_DIR=cache)
    assert not ran(tmp_path, "planted")
    assert f"{cache} is owned by nobody, not by root (owner nobody, mode drwxrwxrwx 0777)" in stderr
    assert f"building the C++ kernel ({ident['isa']}, torch {ident['torch']}) in {default_root(tmp_path) / key}" \
        in stderr


@pytest.mark.slow  # one real build of the kernel (about a minute)
def test_a_kernel_cut_short_is_rebuilt_and_used(tmp_path):
    from overflow_fast.stats import cpu_backend

    if cpu_backend.extension() is None:
        pytest.skip(f"no kernel here to damage: {cpu_backend.unavailable_reason()}")
    root = private(tmp_path / "cache")
    ident, key = _real_key(root)
    library = plant(root / key, cpu_backend.extension().__file__, ident)
    _damage(library, "cut to half")
    script = _STATS + textwrap.dedent("""
        from overflow_fast.stats import cpu_backend
        assert cpu_backend.extension() is not None, cpu_backend.unavailable_reason()
        print("DETAILS", cpu_backend.details()["origin"], cpu_backend.details()["built_now"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env=_environment(tmp_path, OVERFLOW_FAST_CACHE_DIR=root))
    assert proc.returncode == 0 and "ROW OK" in proc.stdout, proc.stderr[-3000:]
    assert "DETAILS cache True" in proc.stdout
    assert f"not loading the cached C++ kernel: {library} is " in proc.stderr
    assert f"built the C++ kernel ({ident['isa']}, torch {ident['torch']}) in " in proc.stderr
    assert f" s: {library}" in proc.stderr
    assert cpu_build.check_build(root / key, ident) == (library, None)
