"""The identity of the C++ sources, recorded in the extension at build time (setup.py loads this
file on its own) and compared at load time, so that a module built from older sources is seen as
stale. Standard library only."""

import hashlib
from pathlib import Path


def source_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
