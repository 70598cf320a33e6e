"""Rows already read in the current top-level forward, so that a tensor several hooks see (a
module's output is the next module's input and its parent's output) is read once.

A row may only be reused while nothing can have changed the tensor unseen. Within one forward
the version counter tells; between forwards it does not (fused optimizers, ``.data`` writes and
gradient-checkpointing recomputation change weights without bumping it), so the cache lives for
exactly one top-level forward: emptied when it opens and when it closes, never filled outside one.
"""

import weakref

MAX_REMEMBERED = 1 << 16  # entries; past it the table starts over


class ReuseCache:
    __slots__ = ("enabled", "_open", "_rows")

    def __init__(self, enabled=True):
        self.enabled = enabled
        self._open = 0  # top-level forwards running (re-entered, or on several threads)
        self._rows = {}  # id(tensor) -> (weakref, version, row or where the row waits)

    def open(self):
        if self._open == 0:
            self._rows.clear()
        self._open += 1

    def close(self):
        self._open = max(0, self._open - 1)
        if self._open == 0:
            self._rows.clear()

    def clear(self):
        self._rows.clear()

    def reset(self):
        """Forget everything, the open forwards included (hooks removed, detector unpickled)."""
        self._open = 0
        self._rows.clear()

    def open_rows(self, adding):
        """The table ``id(tensor) -> (weak reference, version, row or where it waits)`` for a
        caller that looks up and remembers up to ``adding`` tensors itself, or None outside a
        top-level forward (or with reuse off)."""
        if not (self.enabled and self._open):
            return None
        if len(self._rows) + adding > MAX_REMEMBERED:
            self._rows.clear()
        return self._rows

    def lookup(self, tensors):
        """Each tensor's known row (or None), and the positions still to read."""
        sources = [None] * len(tensors)
        if not self._open or not self._rows:
            return sources, list(range(len(tensors)))
        fresh = []
        rows = self._rows
        for position, tensor in enumerate(tensors):
            entry = rows.get(id(tensor))
            if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
                sources[position] = entry[2]
            else:
                fresh.append(position)
        return sources, fresh

    def remember(self, tensor, source):
        """Keep ``source`` for ``tensor``."""
        if not (self.enabled and self._open):
            return
        if len(self._rows) >= MAX_REMEMBERED:
            self._rows.clear()
        try:
            self._rows[id(tensor)] = (weakref.ref(tensor), tensor._version, source)
        except (RuntimeError, TypeError):
            # inference tensors keep no version counter (a change to them could not be seen), and
            # a tensor subclass may lack one or weak references: read it again
            pass
