"""`make test-versions` (tests/versions_matrix.py) tests what pyproject.toml claims: its oldest
combination is the floor that the metadata states, and it names what it would run."""

import contextlib
import io
import re
import tomllib
from pathlib import Path

import versions_matrix

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def _version(text):
    return tuple(int(part) for part in text.split("."))


def test_the_oldest_combination_is_the_floor_the_metadata_claims():
    python_floor = re.fullmatch(r">=(\d+\.\d+)", PYPROJECT["project"]["requires-python"]).group(1)
    (torch_spec,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    torch_floor = re.fullmatch(r"torch>=(\d+\.\d+)", torch_spec).group(1)
    assert min(_version(py) for py, _, _ in versions_matrix.MATRIX) == _version(python_floor)
    assert min(_version(torch)[:2] for _, torch, _ in versions_matrix.MATRIX) == _version(torch_floor)


def test_list_names_every_combination_and_only_filters():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert versions_matrix.main(["--list"]) == 0
    names = out.getvalue().split()
    assert len(names) == sum(len(transformers) for _, _, transformers in versions_matrix.MATRIX)
    assert all(re.fullmatch(r"py3\.\d+-torch[\d.]+-transformers[\d.]+", name) for name in names)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert versions_matrix.main(["--list", "--only", names[0]]) == 0
        assert versions_matrix.main(["--list", "--only", "no such combination"]) == 2
    assert out.getvalue().split() == [names[0]]
