#!/usr/bin/env bash
# Packaging check: what a user gets. Builds the sdist and, from it alone, the wheel with
# `python -m build` (build isolation on: no torch needed to build), checks that the wheel is pure
# Python carrying the C++ sources, installs it with this torch into a fresh virtual environment
# outside the checkout and, from there, runs `overflow-fast info`, which builds the C++ kernel from
# the installed sources into an empty cache and must report it in use (and name the log reader),
# then computes a row through the kernel. A few minutes (the venv's torch, one build of the
# kernel).
#
#     tests/check_wheel.sh [python]      (default: .venv/bin/python; needs `build` installed)
#     CHECK_WHEEL_SDIST_ONLY=1 tests/check_wheel.sh     the sdist's contents only (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
PY="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute, symlink kept (a venv's python)
export MAX_JOBS="${MAX_JOBS:-2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# From a copy of the files git knows (tracked, or untracked and not ignored), as a fresh clone
# has them: setuptools also packs whatever a stale *.egg-info/SOURCES.txt in the checkout lists.
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$work/src"
"$PY" -m build --sdist --outdir "$work/dist" "$work/src" >"$work/sdist.log" 2>&1 \
    || { cat "$work/sdist.log"; exit 1; }
sdist=("$work"/dist/*.tar.gz)
echo "sdist: $(basename "${sdist[0]}")"
listing="$(tar -tzf "${sdist[0]}")"
missing=0
for source in csrc/*.cpp csrc/*.h; do
    if ! grep -qx "[^/]*/$source" <<<"$listing"; then
        echo "missing from the sdist: $source"
        missing=1
    fi
done
[ "$missing" = 0 ]
if [ "${CHECK_WHEEL_SDIST_ONLY:-0}" = 1 ]; then
    echo "sdist OK: every C++ source is in it"
    exit 0
fi

# The wheel from the sdist alone, build isolation on, as pip does for a user.
"$PY" -m build --wheel --outdir "$work/wheel" "${sdist[0]}" >"$work/wheel.log" 2>&1 \
    || { tail -n 60 "$work/wheel.log"; exit 1; }
wheel=("$work"/wheel/*.whl)
echo "wheel: $(basename "${wheel[0]}")"
case "$(basename "${wheel[0]}")" in
    *-py3-none-any.whl) ;;
    *) echo "the wheel should be pure Python (the kernel is built where it runs)"; exit 1 ;;
esac
wheel_listing="$(unzip -Z1 "${wheel[0]}")"
for source in csrc/*.cpp csrc/*.h; do
    grep -qx "overflow_fast/$source" <<<"$wheel_listing" || { echo "missing from the wheel: overflow_fast/$source"; exit 1; }
done

# A fresh environment outside the tree, holding this torch (pinned: never another download) and
# the wheel; not activated, so ninja is not on PATH either, as for a user calling its bin/ directly.
torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "torch==$torch_version" "${wheel[0]}" \
    >"$work/install.log" 2>&1 || { tail -n 40 "$work/install.log"; exit 1; }

cd "$work"  # nothing of the checkout on sys.path
export OVERFLOW_FAST_CACHE_DIR="$work/cache"  # an empty cache: the kernel is built from the wheel's sources
"$work/venv/bin/overflow-fast" info >"$work/info.txt" 2>"$work/info.err" || { cat "$work/info.txt" "$work/info.err"; exit 1; }
cat "$work/info.txt"
grep -Eq '^cpu kernel: (avx512|avx2|baseline)$' "$work/info.txt" \
    || { echo "the installed wheel's C++ kernel is not in use"; cat "$work/info.err"; exit 1; }
grep -q "^cpu kernel file: $work/cache/.*(built just now" "$work/info.txt"
grep -q "^log reader: " "$work/info.txt" || { echo "info does not name the log reader"; exit 1; }
"$work/venv/bin/python" - "$work/venv" <<'PYEOF'
import math
import sys

import torch

import overflow_fast
from overflow_fast.stats import cpu_backend
from overflow_fast.stats.layout import decode_row

venv = sys.argv[1]
assert overflow_fast.__file__.startswith(venv), f"imported {overflow_fast.__file__}, not the installed wheel"
assert cpu_backend.details()["origin"] == "cache" and not cpu_backend.details()["built_now"]  # built by info
C = cpu_backend.extension()
assert C is not None, cpu_backend.unavailable_reason()
x = torch.tensor([0.0, -3.0, float("inf"), 1e-40, float("-inf")])
row = decode_row(C.compute([x])[0].tolist(), x.dtype)
assert row == {"abs_min": 0.0, "abs_max": math.inf, "nan": 0, "posinf": 1, "neginf": 1, "zero": 1,
               "subnormal": 1, "numel": 5}, row
print(f"installed wheel OK: {C.__file__} (kernel {C.capability()}), row {row}")
PYEOF
