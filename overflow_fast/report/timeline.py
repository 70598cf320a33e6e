"""The picture's train timeline, in bounded memory: what ``report --png`` draws from.

Its x is the trainer's optimizer step (``unit == OPTIMIZER``) or the detector's batch number
(``BATCH``). Steps go into bins of ``width`` steps (a power of two, aligned to its multiples),
widened as the steps seen spread, so that there are fewer than ``2 * max_columns`` of them. Per
kept module: the lowest headroom ratio in each bin (``cells``), the bins with a nan/inf
(``bad_cells``) and, for bins with no headroom, what was there (``quiet``: INTEGER | ZERO); the
bins where evaluation ran (``eval_bins``); and per tracked (module, entry) the largest subnormal and
zero fractions in each bin (``sub_bins``).
"""

BATCH, OPTIMIZER = "batch", "optimizer"  # the timeline's unit
# what entries without headroom held, in a bin that ends with no headroom at all
INTEGER = 1  # entries of a dtype without a largest finite value (integer, bool)
ZERO = 2  # floating-point entries whose largest |value| is 0 (all zeros, or empty)


def bin_width(first, last, max_columns):
    """The smallest power of two such that bins of that many steps, aligned to multiples of it,
    cover [first, last] in fewer than 2 * max_columns columns."""
    width = 1
    while last // width - first // width >= 2 * max_columns:
        width *= 2
    return width


class Timeline:
    """The bins of one summary; ``keep_bins=False`` keeps only the range of steps (``--png`` alone
    needs the bins)."""

    def __init__(self, max_columns, keep_bins=True):
        self.max_columns = max_columns
        self.keep_bins = keep_bins
        self.unit = BATCH
        self.first_x = None
        self.last_x = None
        self.width = 1
        self.cells = {}
        self.bad_cells = {}
        self.quiet = {}
        self.eval_bins = set()
        self.sub_bins = {}  # (module, entry) -> {bin index: [largest subnormal fraction, largest zero fraction]}

    def set_unit(self, unit):
        """The x from now on. The bins so far were of the other unit: they go (the records before
        the first optimizer step have none, and are off its timeline). True when it changed."""
        if unit == self.unit:
            return False
        self.unit = unit
        self.first_x = self.last_x = None
        self.width = 1
        self.cells, self.bad_cells, self.quiet, self.eval_bins = {}, {}, {}, set()
        for bins in self.sub_bins.values():
            bins.clear()
        return True

    def add_x(self, first, last):
        """Positions on the timeline (train and eval): the bins widen to keep them few."""
        if self.first_x is None:
            self.first_x, self.last_x = first, last
        elif first < self.first_x or last > self.last_x:
            self.first_x = min(self.first_x, first)
            self.last_x = max(self.last_x, last)
        else:
            return
        if self.keep_bins:
            width = bin_width(self.first_x, self.last_x, self.max_columns)
            if width > self.width:
                self._coarsen(width)

    def add_cell(self, module, index, ratio, bad, flags=0):
        """The lowest headroom ratio in bin ``index`` (at ``self.width``) of the train timeline;
        ``bad``: a nan/inf; ``flags``: what entries without headroom were there (INTEGER, ZERO),
        kept only for a bin that ends with no headroom at all."""
        cells = self.cells.setdefault(module, {})
        if ratio is not None:
            current = cells.get(index)
            if current is None or ratio < current:
                cells[index] = ratio
            quiet = self.quiet.get(module)
            if quiet is not None and quiet.pop(index, None) is not None and not quiet:
                del self.quiet[module]
        elif flags and index not in cells:
            quiet = self.quiet.setdefault(module, {})
            quiet[index] = quiet.get(index, 0) | flags
        if bad:
            self.bad_cells.setdefault(module, set()).add(index)

    def add_eval_bin(self, index):
        self.eval_bins.add(index)

    def track_underflow(self, key):
        """From now on, keep the fractions of (module, entry) ``key`` per bin."""
        self.sub_bins.setdefault(key, {})

    def add_underflow(self, key, index, subnormal_frac, zero_frac):
        """The largest subnormal and zero fractions of (module, entry) ``key`` in bin ``index``."""
        bins = self.sub_bins.setdefault(key, {})
        current = bins.get(index)
        if current is None:
            bins[index] = [subnormal_frac, zero_frac]
        else:
            current[0] = max(current[0], subnormal_frac)
            current[1] = max(current[1], zero_frac)

    def forget_underflow(self, keys):
        for key in keys:
            self.sub_bins.pop(key, None)

    def forget_modules(self, names):
        for name in names:
            self.cells.pop(name, None)
            self.bad_cells.pop(name, None)
            self.quiet.pop(name, None)

    def columns(self):
        """Indices of the bins that hold any record, in order."""
        used = set()
        for table in (self.cells, self.bad_cells, self.quiet):
            for bins in table.values():
                used.update(bins)
        return sorted(used)

    def bin_steps(self, index):
        """The steps [first, last] that bin ``index`` covers."""
        return index * self.width, index * self.width + self.width - 1

    def _coarsen(self, width):
        factor = width // self.width
        self.width = width
        self.cells = {module: _merged(cells, factor, min) for module, cells in self.cells.items()}
        self.bad_cells = {module: {index // factor for index in bad} for module, bad in self.bad_cells.items()}
        for module in list(self.quiet):
            cells = self.cells.get(module, {})
            merged = {}
            for index, flags in self.quiet[module].items():
                index //= factor
                if index not in cells:
                    merged[index] = merged.get(index, 0) | flags
            if merged:
                self.quiet[module] = merged
            else:
                del self.quiet[module]
        self.eval_bins = {index // factor for index in self.eval_bins}
        for key, bins in self.sub_bins.items():
            merged = {}
            for index, (sub, zero) in bins.items():
                index //= factor
                current = merged.get(index)
                if current is None:
                    merged[index] = [sub, zero]
                else:
                    current[0], current[1] = max(current[0], sub), max(current[1], zero)
            self.sub_bins[key] = merged


def _merged(bins, factor, pick):
    """``bins`` ({index: value}) in bins ``factor`` times as wide, ``pick`` of the values that meet."""
    merged = {}
    for index, value in bins.items():
        index //= factor
        current = merged.get(index)
        merged[index] = value if current is None else pick(current, value)
    return merged
