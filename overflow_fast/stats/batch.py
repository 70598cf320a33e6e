"""StatsBatch: the device-resident result of one ``tensor_stats`` call."""

import torch

from .layout import NUM_COLUMNS, decode_row


class StatsBatch:
    """Statistics of a list of tensors, kept on the tensors' devices until ``tolist()``.

    ``groups`` is a list of ``(indices, values)``: ``values`` is an ``[len(indices), 8]`` int64
    tensor (see ``layout``) holding the rows of the tensors at ``indices`` in the input list.
    There is one group per (device, backend) that the input touched.
    """

    __slots__ = ("dtypes", "groups")

    def __init__(self, dtypes, groups):
        self.dtypes = list(dtypes)
        self.groups = list(groups)

    def __len__(self):
        return len(self.dtypes)

    def __repr__(self):
        devices = sorted({str(values.device) for _, values in self.groups})
        return f"StatsBatch({len(self)} tensors on {', '.join(devices) or 'no device'})"

    @property
    def values(self) -> torch.Tensor:
        """All rows as one ``[N, 8]`` int64 tensor on the device, without a host sync.

        Only defined when one device and one backend hold every row (one group in input order);
        ``tensor_stats(..., out=)`` always gives that.
        """
        if len(self.groups) == 1:
            return self.groups[0][1]
        if not self.groups:
            return torch.zeros((0, NUM_COLUMNS), dtype=torch.int64)
        raise ValueError("StatsBatch.values needs every row from one device and backend; use tolist() or out=")

    def row(self, index) -> torch.Tensor:
        """The ``[8]`` row of ``tensors[index]``, a view on the device (no sync)."""
        for indices, values in self.groups:
            if index in indices:
                return values[indices.index(index)]
        raise IndexError(f"no row for tensor {index}")

    def host_rows(self):
        """Rows as lists of Python ints, in input order: one device-to-host copy per group."""
        if len(self.groups) == 1:
            return self.groups[0][1].tolist()  # one device: the rows are already in input order
        rows = [None] * len(self.dtypes)
        for indices, values in self.groups:
            for index, row in zip(indices, values.tolist()):
                rows[index] = row
        return rows

    def tolist(self):
        """One dict per tensor with keys abs_min, abs_max, nan, posinf, neginf, zero, subnormal, numel."""
        return [decode_row(row, dtype) for row, dtype in zip(self.host_rows(), self.dtypes)]

