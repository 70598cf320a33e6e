"""Re-running what went wrong, in one sandbox (``sandbox``): one module call with every op checked
(``op_replay``, chosen by ``culprit``: find_op's Op line; ``repro``: the same replay from a file),
or a whole step with the full detector attached (``step``: check="step"'s replay of its first bad
step). It knows nothing of hooks: what it replays and what watches the replay are given to it."""
