"""`make demo` runs overflow_fast.demo: it must show the report and stop at the same module each way."""

import contextlib
import io

import pytest

from overflow_fast import demo


@pytest.mark.parametrize("args", [[], ["--check", "module"], ["--drop-in"], ["--drop-in", "--check", "batch"]])
def test_demo_reports_the_overflow_in_the_last_block(args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert demo.main(args) == 0
    text = out.getvalue()
    assert "output has infs" in text
    assert "                  blocks.3.fc_out Linear" in text
    assert text.rstrip().endswith("The run stopped with: ValueError: DebugUnderflowOverflow: inf/nan detected, "
                                  "aborting as there is no point running further. Please scroll up above this "
                                  "traceback to see the activation values prior to this event.")
    source = "Source: born in forward of blocks.3.fc_out (Linear): output from finite inputs and weights"
    assert (source in text) == ("--drop-in" not in args)
    # the rows of the batch that hold the inf, just before the Source line
    where = "Where: rows 0, 1 of 2; first at [0, 0, 21]; 4 of 1,024 elements are inf\n" + source
    assert (where in text) == ("--drop-in" not in args)
