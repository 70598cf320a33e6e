"""``overflow-fast diff A.jsonl B.jsonl``: where two recorded runs first part.

The entry records of the two logs are aligned by (rank, step, phase, module, entry): the k-th
record of a key in A with the k-th of that key in B (a module called twice in a step has two).
A log without ranks counts as rank 0. An aligned pair *parts* when one run recorded a nan/inf and
the other did not, or when abs-min or abs-max differ by more than ``rtol`` relative to the larger
of the two (differences of at most ``atol`` count as none). The first pair that parts, by step,
then rank, then A's order, is named; then the largest divergence of each module; and what only
one run recorded, named apart: ranks, steps (a run that went on longer, a different
``log_every``), modules, and other entries.

Streaming, in bounded memory: both logs are read at once, each in its own order, and the one that
is behind (by step) goes first. While the two agree record for record (same keys in the same
order, the usual case: the same model and the same logging) each pair is compared as it is read;
where they do not, records wait for their partner, by (rank, step), until the other log has moved
past their step (then they are in one run only). The logs are read as written: in step order for
each rank. A record that comes after a later step of its rank is counted (``out_of_order``), and
so are records given up on when more than ``PENDING_CAP`` wait at once (``window``): the text says
so, as it says when a bound below was reached.

Bounds: ``PENDING_CAP`` waiting records; the ``MAX_MODULES`` modules with the largest divergence
(the table of the largest is exact: a module dropped for a small divergence comes back with the
divergence that puts it in the table); ``DISTINCT_CAP`` steps and module names for what one run
only has; per kept module and step bin, the picture's cells.
"""

import math
from operator import itemgetter

from . import logscan
from .entries import (ABS_MAX, ABS_MIN, CLASS, DTYPE, FIELDS, LINE, MODE, MODULE, NAME, NEGINF, NAN, NUMEL, PHASE,
                      POSINF, RANK, STEP, global_step_of, is_bad, key_of, magnitude)
from .summary import NOT_RECORDED, heatmap_columns, printable, when  # noqa: F401 - NOT_RECORDED: a kind of cell here too
from .timeline import BATCH, OPTIMIZER, _merged, bin_width

INF = float("inf")
MAX_COLUMNS = 200  # step bins of the picture: fewer than 2 * MAX_COLUMNS
MAX_MODULES = 1 << 16
PLOT_ROWS = 512
PENDING_CAP = 1 << 18
DISTINCT_CAP = 1 << 20
TOP = 10
MAX_EXAMPLES = 5
LOOK_AHEAD = 16  # records looked at ahead where two logs at the same step differ: a cost, never a result

BAD = -1  # where a divergence comes from: a nan/inf in one run only (else ABS_MIN or ABS_MAX)
ABS_NAMES = {ABS_MIN: "abs min", ABS_MAX: "abs max", BAD: "nan/inf"}


STATS = {"both": (ABS_MAX, ABS_MIN), "abs_max": (ABS_MAX,), "abs_min": (ABS_MIN,)}
_COUNTS = (NAN, POSINF, NEGINF)  # is_bad's: a count other than "0" is a nan/inf


def divergence(a, b, atol=0.0, fields=STATS["both"]):
    """(relative difference, where it comes from: ABS_MIN, ABS_MAX, BAD, or None when 0) of two
    aligned entries' fields, over ``fields``: |x - y| / max(x, y), 0 where |x - y| <= ``atol``.
    ``INF`` when one recorded a nan/inf and the other did not."""
    if ((a[NAN] != "0" or a[POSINF] != "0" or a[NEGINF] != "0" or a[ABS_MAX][0] == '"')
            != (b[NAN] != "0" or b[POSINF] != "0" or b[NEGINF] != "0" or b[ABS_MAX][0] == '"')):  # is_bad, inline
        return INF, BAD
    largest, which = 0.0, None
    for field in fields:
        text_a, text_b = a[field], b[field]
        if text_a == text_b:
            continue
        try:
            x, y = float(text_a), float(text_b)  # a number's text; "null" and "\"inf\"" are not
        except ValueError:
            value = _special(text_a, text_b)
        else:
            difference = abs(x - y)
            value = 0.0 if difference <= atol else difference / (x if x > y else y)
        if value > largest:
            largest, which = value, field
    return largest, which


def _special(text_a, text_b):
    """The relative difference where one text is not a finite number: nan/inf in one only is INF,
    in both is 0 (both runs broke); null, an empty tensor, is not compared (its element count
    differs, counted apart)."""
    x, y = magnitude(text_a), magnitude(text_b)
    if x is None or y is None:
        return 0.0
    finite_x, finite_y = math.isfinite(x), math.isfinite(y)
    return 0.0 if finite_x == finite_y else INF


class _Capped:
    """A set of hashable values, exact up to ``cap`` of them (then ``over``: no longer known)."""

    def __init__(self, cap):
        self.cap = cap
        self.values = set()
        self.over = False

    def add(self, value):
        if not self.over:
            self.values.add(value)
            if len(self.values) > self.cap:
                self.over, self.values = True, set()

    def update(self, other):
        if other.over:
            self.over, self.values = True, set()
        elif not self.over:
            self.values |= other.values
            if len(self.values) > self.cap:
                self.over, self.values = True, set()


class OutOfRange(Exception):
    """A record outside the steps a part of a split diff may see: the logs are not in step order
    where they were split (``diff_parts`` then compares them whole)."""


class Side:
    """One log as the alignment reads it: its reader, where it is, what waits for a partner, and
    what only this log recorded."""

    def __init__(self, name, reader, steps=None):
        self.name = name
        self.bit = 1 if name == "A" else 2  # in ``Diff.names``
        self.reader = reader
        self._batches = reader.batches()
        self.step_range = steps  # (first, end): the steps this part may see; None: any
        self.frontier = {}  # rank -> the latest step read
        self.pending = {}  # (rank, step) -> {(phase, module, entry, occurrence): Entry}, waiting for a partner
        self.waiting = 0
        self.counts = {}  # (rank, step) -> {(phase, module, entry): records so far}, while not in step
        self.steps = _Capped(DISTINCT_CAP)  # (rank, step) recorded
        self.ranks = set()
        self.first_step = None
        self.last_step = None
        self.out_of_order = 0
        self.first_out_of_order = None  # (line, step, latest step of its rank before it)
        # what only this run recorded (not compared)
        self.only = 0
        self.only_ranks = {}  # rank -> entries, of ranks the other run did not record
        self.only_steps = {}  # rank -> entries, of steps (of that rank) the other run did not record
        self.only_modules = {}  # module -> [entries, class], of modules the other run did not record
        self.only_other = 0  # the rest: entries, or repeated calls, that the other run lacks
        self.only_examples = []  # the first few of the rest (Entry)
        self.window = 0  # of them, given up on: more than PENDING_CAP waited at once
        self.done = False

    def next_batch(self):
        for batch in self._batches:
            return batch
        self.done = True
        self._batches = None  # a generator: the finished Side is plain data (a part's result is pickled)
        return None

    def seen(self, rank, step, line):
        """This log is at (rank, step): True when that is a new step of the rank, False when it
        is the latest, None when a later one came before (out of order)."""
        if self.step_range is not None and not self.step_range[0] <= step < self.step_range[1]:
            raise OutOfRange(f"{self.name} line {line}: step {step} outside {self.step_range}")
        latest = self.frontier.get(rank)
        if latest is not None and step <= latest:
            if step == latest:
                return False
            self.out_of_order += 1
            if self.first_out_of_order is None:
                self.first_out_of_order = (line, step, latest)
            return None
        self.frontier[rank] = step
        self.steps.add((rank, step))
        if latest is None:
            self.ranks.add(rank)
        if self.first_step is None or step < self.first_step:
            self.first_step = step
        if self.last_step is None or step > self.last_step:
            self.last_step = step
        return True

    def merge(self, later):
        """Add ``later``, the same log's side of the next part (later steps)."""
        self.steps.update(later.steps)
        self.ranks |= later.ranks
        if later.first_step is not None:
            self.first_step = later.first_step if self.first_step is None else min(self.first_step, later.first_step)
            self.last_step = later.last_step if self.last_step is None else max(self.last_step, later.last_step)
        self.out_of_order += later.out_of_order
        self.first_out_of_order = self.first_out_of_order or later.first_out_of_order
        self.only += later.only
        _add_counts(self.only_ranks, later.only_ranks)
        _add_counts(self.only_steps, later.only_steps)
        for module, (count, class_name) in later.only_modules.items():
            info = self.only_modules.get(module)
            if info is not None:
                info[0] += count
            elif len(self.only_modules) < DISTINCT_CAP:
                self.only_modules[module] = [count, class_name]
            else:
                self.only_other += count
        self.only_other += later.only_other
        self.only_examples = (self.only_examples + later.only_examples)[:MAX_EXAMPLES]
        self.window += later.window
        self.reader.merge(later.reader)


def _add_counts(counts, more):
    for key, count in more.items():
        counts[key] = counts.get(key, 0) + count


class Diff:
    """The comparison of two logs, in bounded memory. ``run(reader_a, reader_b)`` reads them
    (``entries.EntryReader``), ``finish()`` settles what one run only recorded; the results are
    attributes, and ``text()`` prints them. A part of a split diff (``diff_parts``) runs on a
    range of steps, and the parts, in order, ``merge`` into one before ``finish()``."""

    def __init__(self, rtol=1e-2, atol=0.0, stat="both", grid=False, max_modules=MAX_MODULES,
                 pending_cap=PENDING_CAP):
        if not (rtol >= 0 and math.isfinite(rtol)) or not (atol >= 0 and math.isfinite(atol)):
            raise ValueError("rtol and atol must be finite numbers >= 0")
        if stat not in STATS:
            raise ValueError(f"stat must be one of {', '.join(STATS)}, not {stat!r}")
        self.rtol = rtol
        self.atol = atol
        self.stat = stat
        self.fields = STATS[stat]
        self.max_modules = max_modules
        self.pending_cap = pending_cap
        self.pairs = 0
        self.parted = 0  # pairs beyond the tolerance
        self.first = None  # (order, Entry of A, Entry of B, divergence, field) of the first pair that parts
        self.dtype_differs = 0
        self.first_dtype = None  # (Entry of A, Entry of B)
        self.numel_differs = 0
        self.first_numel = None
        # module -> [order, largest divergence, (field, a, b) of it or None, first parting (a, b, divergence,
        # field) or None, pairs parted]
        self.modules = {}
        self.modules_dropped = 0
        self.dropped_parted = False  # a module that had parted was dropped: its first parting may be later
        self._order = 0
        self.names = {}  # module -> the logs that recorded it (1: A, 2: B, 3: both), up to DISTINCT_CAP names
        self.names_over = False
        self.grid = Grid(MAX_COLUMNS) if grid else None
        self.sides = None
        self.parts = 1  # processes that read it (``diff_parts``)
        self.part_failed = None  # why a diff in parts was read again in one pass
        self._native = logscan.native()  # csrc/logscan.c, or None: its Python twins here

    def __getstate__(self):  # a part's Diff goes to the parent process: the module is not data
        return {**self.__dict__, "_native": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._native = logscan.native()

    # -- reading ---------------------------------------------------------------------------------

    def run(self, reader_a, reader_b, steps=None):
        """Read both logs to their ends; ``steps``: (first, end), the only steps they may hold
        (``OutOfRange`` otherwise)."""
        a_side, b_side = self.sides = (Side("A", reader_a, steps), Side("B", reader_b, steps))
        batch_a, batch_b = a_side.next_batch(), b_side.next_batch()
        ia = ib = 0
        in_step = True  # nothing waits: the two logs are at the same record
        # the texts of (rank, step) of the last pair read in step, while the records read before it were
        # pairs in step
        last_rank = last_step = None
        pairs_before = False
        grid = self.grid
        pair = self._pair
        run_length = _run_length if self._native is None else self._native.run_length
        while batch_a is not None or batch_b is not None:
            if batch_a is not None and ia == len(batch_a):
                batch_a, ia = a_side.next_batch(), 0
                continue
            if batch_b is not None and ib == len(batch_b):
                batch_b, ib = b_side.next_batch(), 0
                continue
            if batch_a is not None and batch_b is not None:
                # the same key, and as many of it read in both (always so when nothing waits): pairs,
                # as many as follow one another in one step. Nothing is counted: counts that both logs
                # would add alike leave every pairing as it is
                n = run_length(batch_a, ia, batch_b, ib, _KEY, _WHERE)
                if n and not in_step:
                    n = self._counted_alike(a_side, b_side, batch_a, ia, n)
                if n:
                    a, b = batch_a[ia], batch_b[ib]
                    fa = a[FIELDS]
                    if fa[STEP] != last_step or fa[RANK] != last_rank or not pairs_before:
                        last_rank, last_step = fa[RANK], fa[STEP]
                        if grid is not None:
                            grid.add_x(int(last_step))
                        self._at(a_side, b_side, a)
                        self._at(b_side, a_side, b)
                        pairs_before = True
                        if not in_step:
                            in_step = self._in_step()
                    for a, b in zip(batch_a[ia:ia + n], batch_b[ib:ib + n]):
                        pair(a, b)
                    ia += n
                    ib += n
                    continue
                fa, fb = batch_a[ia][FIELDS], batch_b[ib][FIELDS]
                # the log behind goes first; at the same step, the one whose head the other log
                # does not hold just ahead (a record that only it has: the other catches up after)
                key = key_of(fa)
                step_b = int(fb[STEP])
                take_a = key[1] < step_b or (key[1] == step_b and not _ahead(batch_b, ib, key))
            else:
                take_a = batch_a is not None
            pairs_before = False
            if take_a:
                self._take(a_side, b_side, batch_a[ia])
                ia += 1
            else:
                self._take(b_side, a_side, batch_b[ib])
                ib += 1
            in_step = self._in_step()
        for side, other in ((a_side, b_side), (b_side, a_side)):
            for group in side.pending.values():
                for entry in group.values():
                    self._one_sided(side, other, entry)
            side.pending.clear()
            side.waiting = 0
            side.counts.clear()
            side.frontier.clear()

    def _in_step(self):
        """Whether nothing waits; then every key so far has had as many records in both logs, and
        the counts start afresh."""
        a_side, b_side = self.sides
        if a_side.waiting or b_side.waiting:
            return False
        a_side.counts.clear()
        b_side.counts.clear()
        return True

    @staticmethod
    def _counted_alike(a_side, b_side, batch, index, n):
        """Of the ``n`` records from ``batch[index]`` on (of one step), how many in a row the two
        logs have read as many of (out of step): those that are the same occurrence in both."""
        where = key_of(batch[index][FIELDS])[:2]
        counts_a, counts_b = a_side.counts.get(where) or {}, b_side.counts.get(where) or {}
        if not counts_a and not counts_b:
            return n
        for k in range(n):
            fields = batch[index + k][FIELDS]
            name = (fields[PHASE], fields[MODULE], fields[NAME])  # key_of's last three
            if counts_a.get(name, 0) != counts_b.get(name, 0):
                return k
        return n

    def _at(self, side, other, entry):
        """``side`` has read ``entry``: at a new step of its rank, the other log's records of
        earlier steps of that rank wait in vain, and their counts go."""
        key = key_of(entry[FIELDS])
        rank, step = key[0], key[1]
        if side.seen(rank, step, entry[LINE]):
            if other.pending:
                for where in [w for w in other.pending if w[0] == rank and w[1] < step]:
                    for waiting in other.pending.pop(where).values():
                        other.waiting -= 1
                        self._one_sided(other, side, waiting)
            if side.counts:
                for where in [w for w in side.counts if w[0] == rank and w[1] < step]:
                    del side.counts[where]

    def _take(self, side, other, entry):
        """One record read out of step: pair it with the one waiting for it, or wait."""
        key = key_of(entry[FIELDS])
        if self.grid is not None:
            self.grid.add_x(key[1])
        self._at(side, other, entry)
        where = key[:2]
        counts = side.counts.get(where)
        if counts is None:
            counts = side.counts[where] = {}
        name = key[2:]
        occurrence = counts.get(name, 0)
        counts[name] = occurrence + 1
        name += (occurrence,)
        group = other.pending.get(where)
        if group is not None:
            partner = group.pop(name, None)
            if partner is not None:
                other.waiting -= 1
                if not group:
                    del other.pending[where]
                if side.bit == 1:
                    self._pair(entry, partner)
                else:
                    self._pair(partner, entry)
                return
        latest = other.frontier.get(where[0])
        if other.done or (latest is not None and latest > where[1]):
            self._one_sided(side, other, entry)
            return
        group = side.pending.get(where)
        if group is None:
            group = side.pending[where] = {}
        group[name] = entry
        side.waiting += 1
        if side.waiting + other.waiting > self.pending_cap:
            self._give_up(side, other)

    def _give_up(self, side, other):
        """Too many records wait: the oldest group of the side with the most goes as one-sided."""
        if other.waiting > side.waiting:
            side, other = other, side
        where = next(iter(side.pending))
        group = side.pending.pop(where)
        side.waiting -= len(group)
        side.window += len(group)
        for entry in group.values():
            self._one_sided(side, other, entry)

    def _one_sided(self, side, other, entry):
        """A record of one log that the other did not record. Its step is over in the other log
        (or that log is read): whether the other recorded that step is known; whether it recorded
        the module at all, only at the end (``finish``)."""
        side.only += 1
        key = key_of(entry[FIELDS])
        rank, module = key[0], key[3]
        self._name(module, side.bit)
        if self.grid is not None:
            self.grid.add_one_sided(module, key[1])
        if not other.steps.over and (rank, key[1]) not in other.steps.values:
            side.only_steps[rank] = side.only_steps.get(rank, 0) + 1
        elif not self.names_over and not self.names.get(module, 0) & other.bit:
            info = side.only_modules.get(module)
            if info is not None:
                info[0] += 1
            elif len(side.only_modules) < DISTINCT_CAP:
                side.only_modules[module] = [1, entry[FIELDS][CLASS]]
            else:
                self._other(side, entry)
        else:
            self._other(side, entry)

    @staticmethod
    def _other(side, entry):
        side.only_other += 1
        if len(side.only_examples) < MAX_EXAMPLES:
            side.only_examples.append(entry)

    def _name(self, module, bit):
        names = self.names
        seen = names.get(module)
        if seen is None:
            if self.names_over:
                return
            if len(names) >= DISTINCT_CAP:
                self.names_over = True
                names.clear()
                return
            names[module] = bit
        elif not seen & bit:
            names[module] = seen | bit

    # -- one aligned pair ------------------------------------------------------------------------

    def _pair(self, a, b):
        self.pairs += 1
        fa, fb = a[FIELDS], b[FIELDS]
        if (fa[ABS_MAX] == fb[ABS_MAX] and fa[ABS_MIN] == fb[ABS_MIN] and fa[NAN] == fb[NAN]
                and fa[POSINF] == fb[POSINF] and fa[NEGINF] == fb[NEGINF]):
            value, field = 0.0, None
        elif self._native is not None:
            value, field = self._native.divergence(fa, fb, self.atol, self.fields, _COUNTS, ABS_MAX, BAD)
        else:
            value, field = divergence(fa, fb, self.atol, self.fields)
        if fa[DTYPE] != fb[DTYPE] or fa[NUMEL] != fb[NUMEL]:
            self._shapes(a, b)
        module = fa[MODULE]
        if self.grid is not None:
            self.grid.add(module, int(fa[STEP]), value)
        info = self.modules.get(module)
        new = info is None
        if new:
            self._name(module, 3)
            info = self.modules[module] = [self._order, 0.0, None, None, 0]
            self._order += 1
        if value > 0.0:
            if value > info[1]:
                info[1], info[2] = value, (field, a, b)
            if value > self.rtol:
                self.parted += 1
                info[4] += 1
                if info[3] is None:
                    info[3] = (a, b, value, field)
                first = self.first
                if first is None or int(fa[STEP]) <= first[0][0]:  # (most pairs come later: no key read)
                    order = _order_of(a)
                    if first is None or order < first[0]:
                        self.first = (order, a, b, value, field)
        if new and len(self.modules) > self.max_modules:  # (after this pair counted: it may decide)
            self._drop_modules()

    def _shapes(self, a, b):
        fa, fb = a[FIELDS], b[FIELDS]
        if fa[DTYPE] != fb[DTYPE]:
            self.dtype_differs += 1
            if self.first_dtype is None:
                self.first_dtype = (a, b)
        if fa[NUMEL] != fb[NUMEL]:
            self.numel_differs += 1
            if self.first_numel is None:
                self.first_numel = (a, b)

    def _drop_modules(self):
        ranked = sorted(self.modules.items(), key=lambda item: -item[1][1])
        keep = self.max_modules * 3 // 4
        dropped = ranked[keep:]
        self.modules_dropped += len(dropped)
        if any(info[3] is not None for _, info in dropped):
            self.dropped_parted = True
        if self.grid is not None:
            self.grid.forget(name for name, _ in dropped)
        self.modules = dict(ranked[:keep])

    # -- parts and the end -----------------------------------------------------------------------

    def merge(self, later):
        """Add ``later``, the diff of the next part (the same logs' later steps, read with the
        same options; its lines numbered from its start in each log)."""
        later._shift_lines([side.reader.lines for side in self.sides])
        self.pairs += later.pairs
        self.parted += later.parted
        if later.first is not None and (self.first is None or later.first[0] < self.first[0]):
            self.first = later.first
        self.dtype_differs += later.dtype_differs
        self.first_dtype = self.first_dtype or later.first_dtype
        self.numel_differs += later.numel_differs
        self.first_numel = self.first_numel or later.first_numel
        for module, info in sorted(later.modules.items(), key=lambda item: item[1][0]):
            mine = self.modules.get(module)
            if mine is None:
                self.modules[module] = [self._order] + info[1:]
                self._order += 1
                continue
            if info[1] > mine[1]:
                mine[1], mine[2] = info[1], info[2]
            mine[3] = mine[3] or info[3]
            mine[4] += info[4]
        self.modules_dropped += later.modules_dropped
        self.dropped_parted = self.dropped_parted or later.dropped_parted
        if len(self.modules) > self.max_modules:
            self._drop_modules()
        if later.names_over:
            self.names_over = True
            self.names.clear()
        elif not self.names_over:
            for module, bits in later.names.items():
                self._name(module, bits)
        if self.grid is not None:
            self.grid.merge(later.grid)
            self.grid.forget([m for m in list(self.grid.cells) if m not in self.modules])
        for side, more in zip(self.sides, later.sides):
            side.merge(more)

    def _shift_lines(self, offsets):
        """Number the lines of the entries kept as if ``offsets`` lines (of A, of B) came first."""
        def shifted(a, b):
            return (a[FIELDS], a[LINE] + offsets[0]), (b[FIELDS], b[LINE] + offsets[1])

        if self.first is not None:
            _, a, b, value, field = self.first
            a, b = shifted(a, b)
            self.first = (_order_of(a), a, b, value, field)
        if self.first_dtype is not None:
            self.first_dtype = shifted(*self.first_dtype)
        if self.first_numel is not None:
            self.first_numel = shifted(*self.first_numel)
        for info in self.modules.values():
            if info[2] is not None:
                info[2] = (info[2][0], *shifted(*info[2][1:]))
            if info[3] is not None:
                info[3] = (*shifted(*info[3][:2]), *info[3][2:])
        for side, offset in zip(self.sides, offsets):
            side.only_examples = [(fields, line + offset) for fields, line in side.only_examples]
            if side.first_out_of_order is not None:
                line, step, latest = side.first_out_of_order
                side.first_out_of_order = (line + offset, step, latest)
            side.reader.shift_lines(offset)

    def finish(self):
        """Settle what one log only recorded, now that both are read: the steps of a rank that the
        other log never recorded are that rank's; the modules the other log recorded after all
        are other entries."""
        for side, other in (self.sides, self.sides[::-1]):
            for rank in [r for r in side.only_steps if r not in other.ranks]:
                side.only_ranks[rank] = side.only_ranks.get(rank, 0) + side.only_steps.pop(rank)
            if not self.names_over:
                for module in [m for m in side.only_modules if self.names.get(m, 0) & other.bit]:
                    count = side.only_modules.pop(module)[0]
                    side.only_other += count

    # -- results ---------------------------------------------------------------------------------

    def largest(self, n=TOP):
        """[(module, info)] of the n modules with the largest divergence, largest first (ties:
        the one that parted first)."""
        rows = [(name, info) for name, info in self.modules.items() if info[1] > 0]
        rows.sort(key=lambda row: (-row[1][1], (INF,) if row[1][3] is None else _order_of(row[1][3][0]), row[1][0]))
        return rows[:n]

    def plot_modules(self):
        """The modules the picture draws, in the order they were first compared: all of them, or
        the ``PLOT_ROWS`` with the largest divergence."""
        ranked = sorted(self.modules.items(), key=lambda item: -item[1][1])[:PLOT_ROWS]
        ranked.sort(key=lambda item: item[1][0])
        return [name for name, _ in ranked]

    @staticmethod
    def steps_only_in(side, other):
        """(count, first, last) of the steps that ``side`` recorded, of ranks both recorded, and
        ``other`` did not (a step counts once for each such rank); None when there were too many
        to keep."""
        if side.steps.over or other.steps.over:
            return None
        steps = sorted(step for rank, step in side.steps.values - other.steps.values if rank in other.ranks)
        if not steps:
            return 0, None, None
        return len(steps), steps[0], steps[-1]

    def text(self, paths):
        return "\n".join(_text_lines(self, paths))


_KEY = (MODULE, NAME, STEP, PHASE, RANK)  # key_of's fields, as texts
_WHERE = (STEP, RANK)


def _run_length(batch_a, a, batch_b, b, keys=_KEY, same=_WHERE):
    """How many pairs (batch_a[a + i], batch_b[b + i]) from i = 0 on have equal ``keys`` fields,
    and ``same`` fields equal to the first pair's (csrc/logscan.c's ``run_length``, in Python)."""
    most = min(len(batch_a) - a, len(batch_b) - b)
    if a < 0 or b < 0 or most <= 0:
        return 0
    key, where = itemgetter(*keys), itemgetter(*same)
    first = where(batch_a[a][FIELDS])
    n = 0
    while n < most:
        fa = batch_a[a + n][FIELDS]
        if key(fa) != key(batch_b[b + n][FIELDS]) or where(fa) != first:
            break
        n += 1
    return n


def _ahead(batch, index, key, look=LOOK_AHEAD):
    """Whether ``key`` is among the next few records of ``batch`` after ``index``."""
    for later in batch[index + 1:index + 1 + look]:
        if key_of(later[FIELDS]) == key:
            return True
    return False


def _order_of(entry):
    """Where a pair sits among the pairs that part: by step, then rank, then A's order."""
    key = key_of(entry[FIELDS])
    return key[1], key[0], entry[LINE]


class Grid:
    """The picture's cells in bounded memory: per module, the largest divergence in each bin of
    ``width`` steps (a power of two; bins widen as the steps spread, fewer than ``2 *
    max_columns``), and the bins where one run only recorded it."""

    def __init__(self, max_columns):
        self.max_columns = max_columns
        self.width = 1
        self.first = self.last = None
        self.cells = {}  # module -> {bin: largest divergence}
        self.one_sided = {}  # module -> {bin: True}

    def add_x(self, step):
        if self.first is None:
            self.first = self.last = step
        elif step < self.first or step > self.last:
            self.first, self.last = min(self.first, step), max(self.last, step)
            width = bin_width(self.first, self.last, self.max_columns)
            if width > self.width:
                factor = width // self.width
                self.width = width
                self.cells = {m: _merged(bins, factor, max) for m, bins in self.cells.items()}
                self.one_sided = {m: _merged(bins, factor, max) for m, bins in self.one_sided.items()}

    def add(self, module, step, value):
        bins = self.cells.get(module)
        if bins is None:
            bins = self.cells[module] = {}
        index = step // self.width
        current = bins.get(index)
        if current is None or value > current:
            bins[index] = value

    def add_one_sided(self, module, step):
        self.one_sided.setdefault(module, {})[step // self.width] = True

    def merge(self, other):
        """Add the cells of ``other`` (another part's), both in bins as wide as the two need."""
        if other.first is None:
            return
        if self.first is None:
            self.first, self.last, self.width = other.first, other.last, other.width
            self.cells, self.one_sided = other.cells, other.one_sided
            return
        self.add_x(other.first)
        self.add_x(other.last)
        factor = self.width // other.width
        for table, more in ((self.cells, other.cells), (self.one_sided, other.one_sided)):
            for module, bins in more.items():
                bins = _merged(bins, factor, max)
                mine = table.setdefault(module, {})
                for index, value in bins.items():
                    current = mine.get(index)
                    if current is None or value > current:
                        mine[index] = value

    def forget(self, modules):
        for module in modules:
            self.cells.pop(module, None)
            self.one_sided.pop(module, None)


# -- the picture's data ----------------------------------------------------------------------------

# what a cell of the picture shows
DIFFERS = "differs"  # the largest divergence of the module's aligned entries there (> 0)
IDENTICAL = "identical"  # aligned entries there, all with equal statistics
NONFINITE = "nan/inf in one run"  # a nan/inf that the other run did not have
ONE_RUN = "one run only"  # entries there that only one run recorded, none aligned
# NOT_RECORDED (the report's): no entry of the module there


class Picture:
    """What ``diff --png`` draws, as plain data (``diff_plot`` only draws it): rows ``modules``
    (in the order they were first compared), columns (bins of ``width`` steps), per cell
    ``values`` (the largest divergence, or None) and ``kinds``; ``first`` the first parting
    (``x``, ``row``, ``text``); ``curves`` the modules with the largest divergence."""

    def __init__(self, diff, curves=5):
        grid = diff.grid
        self.rtol = diff.rtol
        self.width = width = grid.width
        self.modules = modules = diff.plot_modules()
        self.columns, self.centres, position, self.values, self.kinds = heatmap_columns(
            modules, (grid.cells, grid.one_sided), width)
        for i, name in enumerate(modules):
            values, kinds = self.values[i], self.kinds[i]
            for c in grid.one_sided.get(name, ()):
                kinds[position[c]] = ONE_RUN
            for c, value in grid.cells.get(name, {}).items():
                j = position[c]
                if value == INF:
                    kinds[j] = NONFINITE
                elif value > 0:
                    values[j], kinds[j] = value, DIFFERS
                else:
                    kinds[j] = IDENTICAL
        self.xlabel = "step (the detector's batch number)" + (
            f"; a column covers {width} steps: its largest divergence is shown" if width > 1 else "")
        self.first = None
        if diff.first is not None:
            _, a, _, value, field = diff.first
            fields = a[FIELDS]
            module = fields[MODULE]
            on_map = module in modules
            self.first = {
                "x": int(fields[STEP]), "row": modules.index(module) if on_map else None,
                "text": (f"first parting: {_when(a)}, {fields[PHASE]}\n{_name(module)} {printable(fields[NAME])}: "
                         + ("nan/inf in one run" if field == BAD else f"{ABS_NAMES[field]} {_percent(value)}")
                         + ("" if on_map else "\n(not among the modules drawn)")),
            }
        drawn = set(modules)
        self.curves = [name for name, _ in diff.largest(max(curves, 0)) if name in drawn] if curves > 0 else []


# -- the text ------------------------------------------------------------------------------------

def _when(entry):
    fields = entry[FIELDS]
    global_step = global_step_of(fields)
    return when(int(fields[STEP]), global_step, fields[MODE] or None, BATCH if global_step is None else OPTIMIZER)


def _name(module):
    return printable(module) if module else "(model)"


def _number(value):
    return f"{value:,}"


def _percent(value):
    if value == INF:
        return "inf"
    return f"{100 * value:.3g}%"


def _g(value):
    return "-" if value is None else f"{value:.6g}"


def _stat_text(entry):
    fields = entry[FIELDS]
    low, high = magnitude(fields[ABS_MIN]), magnitude(fields[ABS_MAX])
    return (f"abs min {_g(low)}, abs max {_g(high)}" + (" (nan/inf)" if is_bad(fields) else "")
            + f" [{printable(fields[DTYPE])}, {fields[NUMEL]} elements]")


def _what(entry):
    """"module entry" of an Entry, printable."""
    fields = entry[FIELDS]
    return f"{_name(fields[MODULE])} {printable(fields[NAME])}"


def _list(values, limit=8):
    if len(values) <= limit:
        return ", ".join(map(str, values))
    return f"{values[0]} to {values[-1]} ({len(values)})"


def _text_lines(diff, paths):
    out = []
    for side, path in zip(diff.sides, paths):
        reader = side.reader
        steps = ("no tensor entries" if side.first_step is None else
                 f"{_number(reader.entries)} tensor entries, steps {side.first_step} to {side.last_step}")
        ranks = sorted(side.ranks)
        out.append(f"{side.name}: {printable(path)}: {steps}"
                   + (f", ranks {_list(ranks)}" if ranks and ranks != [0] else ""))
        if reader.malformed:
            named = ", ".join(f"{n} ({printable(reason)})" for n, reason in reader.malformed_lines)
            out.append(f"   malformed lines skipped: {_number(reader.malformed)} (first: line {named})")
        if reader.detection is not None:
            det = reader.detection
            unit = BATCH if det.get("global_step") is None else OPTIMIZER
            out.append(f"   detection record: {when(det['step'], det.get('global_step'), det.get('mode'), unit)}, "
                       f"{det['phase']}, module {_name(det['module'])} ({printable(det['class'])})")
    stats = {"both": "abs min or abs max", "abs_max": "abs max", "abs_min": "abs min"}[diff.stat]
    out.append(f"aligned: {_number(diff.pairs)} entry pairs, by (rank, step, phase, module, entry); they part "
               f"where {stats} differs by more than rtol {diff.rtol:g} of the larger"
               + (f" (differences up to atol {diff.atol:g} count as none)" if diff.atol else "")
               + ", or where one run only has a nan/inf")
    for section in (_first_lines, _largest_lines, _one_sided_lines, _notes):
        lines = section(diff)
        if lines:
            out.append("")
            out.extend(lines)
    return out


def _first_lines(diff):
    out = []
    if diff.first is None:
        out.append("first parting: none (every aligned pair within the tolerance)")
    else:
        _, a, b, value, field = diff.first
        key, fields = key_of(a[FIELDS]), a[FIELDS]
        ranks = diff.sides[0].ranks | diff.sides[1].ranks
        rank = f", rank {key[0]}" if ranks != {0} else ""
        out.append(f"first parting: {_when(a)}, {key[2]}{rank}, module {_name(key[3])} ({printable(fields[CLASS])}), "
                   f"entry {printable(key[4])}")
        out.append(f"   A: {_stat_text(a)}  (line {a[LINE]})")
        out.append(f"   B: {_stat_text(b)}  (line {b[LINE]})")
        if field == BAD:
            out.append(f"   a nan/inf in {'A' if is_bad(a[FIELDS]) else 'B'} only")
        else:
            out.append(f"   {ABS_NAMES[field]} differs by {_percent(value)}")
    out.append(f"pairs beyond the tolerance: {_number(diff.parted)} of {_number(diff.pairs)}"
               + (f" ({100 * diff.parted / diff.pairs:.3g}%)" if diff.pairs else "")
               + (f", in {sum(1 for info in diff.modules.values() if info[4])} of {len(diff.modules)} modules"
                  if diff.parted and not diff.modules_dropped else ""))
    if diff.dtype_differs:
        a, b = diff.first_dtype
        out.append(f"dtype differs in {_number(diff.dtype_differs)} pairs (first: {_when(a)}, {_what(a)}: "
                   f"{printable(a[FIELDS][DTYPE])} in A, {printable(b[FIELDS][DTYPE])} in B)")
    if diff.numel_differs:
        a, b = diff.first_numel
        out.append(f"element count differs in {_number(diff.numel_differs)} pairs (first: {_when(a)}, {_what(a)}: "
                   f"{a[FIELDS][NUMEL]} in A, {b[FIELDS][NUMEL]} in B)")
    return out


def _largest_lines(diff):
    out = ["largest divergence per module (its largest relative difference; parted: where it first went "
           "beyond the tolerance):"]
    rows = diff.largest()
    if not rows:
        out.append("  (no aligned pair differs)")
        return out
    table = [("divergence", "stat", "at", "parted", "A", "B", "module / entry")]
    for module, info in rows:
        field, a, b = info[2]
        if field == BAD:
            value_a, value_b = (("nan/inf" if is_bad(e[FIELDS]) else "finite") for e in (a, b))
        else:
            value_a, value_b = _g(magnitude(a[FIELDS][field])), _g(magnitude(b[FIELDS][field]))
        parted = "-" if info[3] is None else _when(info[3][0])
        table.append((_percent(info[1]), ABS_NAMES[field], _when(a), parted, value_a, value_b,
                      f"{_what(a)} ({a[FIELDS][PHASE]})"))
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    for row in table:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]), row[3].ljust(widths[3]),
                 row[4].rjust(widths[4]), row[5].rjust(widths[5]), row[6]]
        out.append("  " + "  ".join(cells))
    more = sum(1 for info in diff.modules.values() if info[1] > 0) - len(rows)
    if more > 0:
        out.append(f"  ... and {more} more modules that differ")
    return out


def _one_sided_lines(diff):
    out = []
    for side, other in (diff.sides, diff.sides[::-1]):
        if not side.only:
            out.append(f"in {side.name} only: nothing")
            continue
        out.append(f"in {side.name} only (not compared): {_number(side.only)} tensor entries")
        if side.only_ranks:
            out.append(f"   ranks {other.name} did not record: {_list(sorted(side.only_ranks))} "
                       f"({_number(sum(side.only_ranks.values()))} entries)")
        if side.only_steps:
            steps = diff.steps_only_in(side, other)
            span = "" if steps is None or not steps[0] else f": {_number(steps[0])}, {steps[1]} to {steps[2]}"
            out.append(f"   steps {other.name} did not record{span} "
                       f"({_number(sum(side.only_steps.values()))} entries)")
        if side.only_modules:
            names = list(side.only_modules.items())
            shown = ", ".join(f"{_name(m)} ({printable(c)}, {n} entries)" for m, (n, c) in names[:MAX_EXAMPLES])
            more = f", and {len(names) - MAX_EXAMPLES} more" if len(names) > MAX_EXAMPLES else ""
            out.append(f"   modules {other.name} did not record: {len(names)}: {shown}{more}")
        if side.only_other:
            shown = "; ".join(f"{_when(e)} {e[FIELDS][PHASE]} {_what(e)} (line {e[LINE]})" for e in side.only_examples)
            out.append(f"   other entries (an entry, or a repeated call, that {other.name} lacks): "
                       f"{_number(side.only_other)}; first: {shown}")
        if side.window:
            out.append(f"   of them, {_number(side.window)} were given up on: more than {_number(diff.pending_cap)} "
                       f"records waited for a partner at once (the logs differ too much there to align)")
    return out


def _notes(diff):
    out = []
    if diff.part_failed:
        out.append(f"note: read in one pass: {diff.part_failed}")
    for side in diff.sides:
        if side.out_of_order:
            line, step, latest = side.first_out_of_order
            out.append(f"note: {side.name} is not in step order ({_number(side.out_of_order)} entries; first at line "
                       f"{line}: step {step} after step {latest}): where the logs differ there, an entry finds "
                       f"its partner only while it waits")
    if diff.modules_dropped:
        out.append(f"note: more than {_number(diff.max_modules)} modules: those with the largest divergence are kept"
                   + ("; one dropped and taken back shows where it parted since" if diff.dropped_parted else ""))
    if diff.names_over:
        out.append(f"note: more than {_number(DISTINCT_CAP)} module names: modules in one run only are not told apart")
    for side in diff.sides:
        if side.steps.over:
            out.append(f"note: {side.name} has more than {_number(DISTINCT_CAP)} steps: the steps one run only "
                       f"recorded are not told apart")
    return out
