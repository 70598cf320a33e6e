"""The ``overflow-fast report`` command: reading logs, the summary, its text, the picture."""
