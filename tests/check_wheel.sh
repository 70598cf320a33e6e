#!/usr/bin/env bash
# Packaging check (issue 8 item 10): what a packager does must give a working C++ kernel.
# Builds the sdist, builds a wheel from that sdist alone (not from the checkout), installs it
# into a scratch directory and, from outside the checkout, checks that overflow_fast._C loads
# and computes a correct row. About 1-2 minutes (the extension is compiled again).
#
#     tests/check_wheel.sh [python]      (default: .venv/bin/python)
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
"$PY" -m build --sdist --no-isolation --outdir "$work/dist" "$work/src" >"$work/sdist.log" 2>&1 \
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

# torch is not a build requirement (the extension must match the installed torch): no isolation
"$PY" -m pip wheel --quiet --no-build-isolation --no-deps --wheel-dir "$work/wheel" "${sdist[0]}" \
    >"$work/wheel.log" 2>&1 || { tail -n 60 "$work/wheel.log"; exit 1; }
wheel=("$work"/wheel/*.whl)
echo "wheel: $(basename "${wheel[0]}")"
"$PY" -m pip install --quiet --no-deps --target "$work/site" "${wheel[0]}"

cd "$work"  # nothing of the checkout on sys.path
PYTHONPATH="$work/site" "$PY" - "$work/site" <<'PYEOF'
import math
import sys

import torch

import overflow_fast
from overflow_fast.stats import cpu_backend
from overflow_fast.stats.layout import decode_row

site = sys.argv[1]
assert overflow_fast.__file__.startswith(site), f"imported {overflow_fast.__file__}, not the installed wheel"
reason = cpu_backend.unavailable_reason()
assert reason is None, f"the C++ kernel of the installed wheel is unavailable: {reason}"
x = torch.tensor([0.0, -3.0, float("inf"), 1e-40, float("-inf")])
row = decode_row(overflow_fast._C.compute([x])[0].tolist(), x.dtype)
assert row == {"abs_min": 0.0, "abs_max": math.inf, "nan": 0, "posinf": 1, "neginf": 1, "zero": 1,
               "subnormal": 1, "numel": 5}, row
print(f"installed wheel OK: {overflow_fast._C.__file__} (kernel {overflow_fast._C.capability()}), row {row}")
PYEOF
