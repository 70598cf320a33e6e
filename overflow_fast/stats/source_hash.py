"""The identity of the C++ sources: part of the name of each build's folder (cpu_build.py, which
setup.py loads on its own for an ahead-of-time build), so that a module built from other sources is
never loaded; also recorded in the module (SOURCE_HASH). Standard library only."""

import hashlib
from pathlib import Path


def source_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
