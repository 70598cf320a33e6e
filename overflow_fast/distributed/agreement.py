"""The agreement: every rank stops together. An ``Agreement`` owns a gloo process group of its
own; each ``agree(detected)`` is one tiny collective on it after which every rank knows which ranks
detected a nan/inf, or every rank raises an ``AgreementError`` (misaligned, timed out).

Hazards of a collective inside the detector (read before wiring or enabling it)
------------------------------------------------------------------------------
A collective returns only when every rank of its group has called it, in the same order as the
other collectives on that group. The detector calls :func:`agree` at points every rank reaches
the same number of times in SPMD training: the end of each forward of the top-level model (and
the end of each backward pass once backward checks exist). That breaks when ranks run different
numbers of forwards:

- generation, evaluation or logging run on rank 0 only (``if rank == 0: model.generate(...)``),
  uneven last batches with ``drop_last=False`` and ``Join``, early-exit loops, pipeline stages with
  different modules: the rank with the extra forward joins one agreement more than the others. Its
  agreements pair with theirs in order (on the agreement's own group, never with the model's
  collectives; numbered by the caller, see :class:`Agreement`, a point one rank skipped raises on
  every rank) and its last one waits for a partner that never comes, until the timeout. Opt out
  around such code with ``with local_only(): ...`` (this thread's calls decide alone, no
  collective), or turn the synchronisation off for a detector (the detector's option); detection
  then works per rank as in the reference.
- A decision per module (``check="module"``) must not run a collective at the module: FSDP2 and
  tensor parallel issue their own collectives inside the forward (parameter all-gathers, TP
  all-reduces), and a rank that stopped at module k to agree would wait for its peers while they
  wait in their all-gather for module k+1 for it (a deadlock that only a timeout ends). So a detecting rank prints its report at once but raises only after
  the agreement at the end of the top-level forward, with everybody else.
- The agreement never pairs with the model's collectives: it runs on its own gloo group (see
  :class:`Agreement`), so a detector on only some ranks, or an agreement some rank skipped, raises
  an :class:`AgreementError` instead of completing (and corrupting) a gradient all-reduce.
- A rank that dies (OOM, a crash) never reaches the collective: the others wait for the
  agreement's ``timeout`` (the default group's timeout, ``init_process_group(timeout=...)``, when
  None) and raise an :class:`AgreementTimeout` saying how long they waited and what probably
  happened. Torchrun's elastic agent also ends the other ranks when one exits with an error.
- The collective runs on the CPU (gloo), also in NCCL jobs: the flags are host values once the
  detector has read its statistics, and the agreement stays off the GPU streams.
"""

import datetime
import hashlib
import struct
import threading
import time

import torch

from ..stats.layout import host_bytes
from .world import _dist, is_local_only, world


# -- the agreement: its own process group, numbered calls ---------------------------------------


class AgreementError(RuntimeError):
    """An agreement that took no decision: created on only some ranks, misaligned, timed out, or
    the :class:`Agreement` is unusable after such an error. Raised on every rank that reaches the
    agreement (see :class:`Agreement`)."""


class AgreementTimeout(AgreementError):
    """This rank waited its timeout for the other ranks (at creation or at an agreement)."""


class AgreementMisaligned(AgreementError):
    """The ranks met at different agreement points (sequence numbers)."""


_STORE_PREFIX = "overflow_fast/agreement"
_instances = {}  # ranks (tuple) -> Agreements this process has created for them in _instances_world
_instances_world = None  # the default group they were created under (a new one numbers from 0)
_instances_lock = threading.Lock()
_abandoned = []  # process groups holding a stuck collective: freeing one waits for it to time out


def _default_store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _default_timeout(dist):
    """The timeout of the default process group (``init_process_group(timeout=...)``), what a
    model's own collective waits; torch's default when it cannot be read."""
    world_group = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world_group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or an older torch
            continue
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout


def _as_timedelta(timeout):
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _ranks_text(ranks):
    """``"0-3, 5"`` for [0, 1, 2, 3, 5]."""
    ranks = sorted(ranks)
    parts, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def _ordinal(n):
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


_REMEDY = ("Wrap code that only some ranks run (generation or evaluation on one rank) in "
           "overflow_fast.distributed.local_only().")


class Agreement:
    """Every rank learns which ranks detected a nan/inf, over a process group of its own.

    ``Agreement(timeout=None, group=None)`` is collective: every rank of ``group`` (default: the
    world) must create it, at the same point of its program, in the same order as its other
    Agreements. Then ``agree(detected)`` (collective too) returns the sorted global ranks that
    passed ``detected=True``, the same list on every rank.

    Its own group. The agreement never runs on the model's process groups, so it can never pair
    with a collective of the model (a detector on only some ranks used to complete the model's
    gradient all_reduce on the others with its flags). It is a gloo group on the CPU, also in NCCL
    jobs: the flags are host values once the detector has read its statistics, an NCCL collective
    would queue behind the model's communication on the GPU, and an NCCL collective abandoned
    after a timeout cannot be taken back (the watchdog aborts the communicator), where a gloo one
    only keeps a CPU thread. The group is built directly on the default store under a key of its
    own, not with ``dist.new_group``, whose groups are numbered by a per-process counter: a
    new_group called on only some ranks would shift every later group of the model.

    Creation. Each rank announces itself in the default store and waits until all have, for
    ``timeout`` (the default group's timeout when None). Created on only some ranks, it raises an
    :class:`AgreementTimeout` there, naming the ranks that never came; no collective ran, so the
    other ranks' collectives are untouched, and a rank that creates it later gets an
    :class:`AgreementError` at once (the attempt is marked abandoned in the store).

    Sequence numbers. Each ``agree()`` carries a sequence number: ``seq`` if given (the caller's
    number of the agreement point, the same on every rank, increasing: e.g. the count of top-level
    forwards that reach an agreement, counting those that raised before it), else the count of this
    object's agreements. The ranks exchange them with their flags, so ranks that meet at different
    points raise an :class:`AgreementMisaligned` on every rank, naming the ranks and their numbers,
    and decide nothing. Without ``seq`` only calls that this object abandoned can misalign (a point
    some rank never reached pairs its peers with that rank's next call, unseen); pass ``seq`` to
    catch it.

    Timeouts and errors. ``agree()`` waits ``timeout`` for the other ranks, then raises an
    :class:`AgreementTimeout` stating the time it actually waited. Its collective stays queued
    in gloo (until gloo's own timeout, twice the wait): a rank arriving late could still complete
    it. So the rank that gives up records that in the store, and a rank whose call completes late
    (it sees from the others' start times that one may have given up) checks, both through one
    compare-and-set per agreement number: either the call completed first and the rank that timed
    out waits for it and returns its result, or every rank raises. After any error the object is
    unusable: every later ``agree()`` raises at once (never a result that could be off by one);
    create a new Agreement on every rank to go on. The ranks compare start times in wall-clock
    time: clocks more than half the timeout apart can leave a late rank with a result for the
    agreement its peer gave up on; it then raises at its next agreement.

    Without a process group, in a group of one rank, or inside :func:`local_only`, no collective
    runs: ``agree`` returns ``[this rank]`` or ``[]`` and numbers nothing.
    """

    def __init__(self, timeout=None, group=None):
        self.timeout = _as_timedelta(timeout)
        if self.timeout is not None and self.timeout.total_seconds() <= 0:
            raise ValueError(f"Agreement: timeout must be positive, not {timeout!r}")
        self.seq = 0  # the last agreement's sequence number
        self.broken = None  # the error that made this object unusable
        self._lock = threading.Lock()
        self._process_group = None
        dist = _dist()
        where = world(group) if dist is not None else None
        self.rank = dist.get_rank() if dist is not None else 0
        if where is None:
            self.ranks = [self.rank]
            return
        self.ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(where[1]))
        if self.rank not in self.ranks:
            raise ValueError(f"Agreement: rank {self.rank} is not in the group (ranks {_ranks_text(self.ranks)})")
        self._index = self.ranks.index(self.rank)
        self._wait = self.timeout if self.timeout is not None else _default_timeout(dist)
        ranks_key = tuple(self.ranks)
        global _instances_world
        with _instances_lock:
            if _instances_world is not dist.group.WORLD:  # the process group was made anew
                _instances.clear()
                _agreements.clear()
                _instances_world = dist.group.WORLD
            number = _instances.get(ranks_key, 0)
            _instances[ranks_key] = number + 1
        name = f"ranks {_ranks_text(self.ranks)}"
        self._name = f"the {_ordinal(number + 1)} Agreement of {name}"
        digest = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:16]
        self._store = dist.PrefixStore(f"{_STORE_PREFIX}/{len(self.ranks)}-{digest}/{number}/", _default_store())
        self._handshake()
        # gloo's own timeout, after which a collective fails and the group's connections close, is
        # twice the wait: a rank that gave up just as a peer completed the agreement (see _give_up)
        # can then still take the result
        self._process_group = dist.ProcessGroupGloo(dist.PrefixStore("group/", self._store), self._index,
                                                    len(self.ranks), 2 * self._wait)
        rows = torch.zeros((len(self.ranks), 4), dtype=torch.int64)
        self._rows = (rows, host_bytes(rows))

    @classmethod
    def over(cls, process_group, store, ranks, rank, timeout):
        """This rank's Agreement among ``ranks`` over a process group and a store made by the
        caller (anything with gloo's ``allreduce`` and a store's ``set``/``get``/``check``), without
        the handshake: how a test runs the races of several ranks in one process."""
        agreement = cls.__new__(cls)
        agreement.timeout = agreement._wait = _as_timedelta(timeout)
        agreement.seq = 0
        agreement.broken = None
        agreement._lock = threading.Lock()
        agreement.ranks, agreement.rank = list(ranks), rank
        agreement._index = agreement.ranks.index(rank)
        agreement._name = f"the Agreement of ranks {_ranks_text(agreement.ranks)}"
        agreement._store, agreement._process_group = store, process_group
        rows = torch.zeros((len(agreement.ranks), 4), dtype=torch.int64)
        agreement._rows = (rows, host_bytes(rows))
        return agreement

    # -- creation ------------------------------------------------------------------------------

    def _handshake(self):
        """Wait until every rank has created this Agreement, or give up after the timeout."""
        store, size = self._store, len(self.ranks)
        started = time.monotonic()
        store.set(f"rank/{self._index}", "1")
        if store.add("arrived", 1) == size:  # the last one to arrive opens the group
            store.compare_set("verdict", "", "go")
        pause = 0.001
        while not store.check(["verdict"]):
            if time.monotonic() - started >= self._wait.total_seconds():
                missing = [rank for index, rank in enumerate(self.ranks) if not store.check([f"rank/{index}"])]
                waited = time.monotonic() - started
                message = (f"overflow_fast: {self._name} must be created on every one of those ranks at the "
                           f"same point; rank {self.rank} waited {waited:.2f} s and rank(s) "
                           f"{_ranks_text(missing) or '?'} never created it (a detector built on only some "
                           "ranks?). No collective ran.")
                verdict = store.compare_set("verdict", "", "abandoned: " + message).decode()
                if verdict == "go":  # everybody came just now
                    break
                raise AgreementTimeout(message)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        verdict = store.get("verdict").decode()
        if verdict != "go":
            raise AgreementError(f"overflow_fast: rank {self.rank} created {self._name} after it was "
                                 f"given up: {verdict.removeprefix('abandoned: ')}")

    # -- agreeing ------------------------------------------------------------------------------

    def agree(self, detected, seq=None):
        """The sorted global ranks that passed ``detected=True`` (the same list on every rank).

        ``seq``: this agreement's sequence number, the same on every rank and larger than the
        previous one (default: the previous one plus one). Raises an :class:`AgreementError` (see
        the class) instead of deciding when the ranks do not meet at the same point in time."""
        detected = bool(detected)
        if self._process_group is None or is_local_only():
            return [self.rank] if detected else []
        with self._lock:
            if self.broken is not None:
                raise AgreementError(f"overflow_fast: this Agreement is unusable since an earlier error; create "
                                     f"a new one on every rank to go on. The error: {self.broken}")
            if seq is None:
                seq = self.seq + 1
            elif int(seq) <= self.seq:
                raise ValueError(f"Agreement.agree: seq {seq} is not above the previous agreement's {self.seq}")
            seq = int(seq)
            self.seq = seq
            try:
                return self._agree(detected, seq)
            except AgreementError as error:
                self.broken = str(error)
                raise

    def _agree(self, detected, seq):
        # each rank's row: its sequence number, flag, start (wall clock, ms) and timeout (ms),
        # written through a view of its bytes (a torch op per field costs more than the collective's
        # own work); one buffer for every call: a call whose collective could still write it breaks
        # the object
        rows, view = self._rows
        view[:] = bytes(len(view))
        struct.pack_into("4q", view, self._index * 32, seq, int(detected), time.time_ns() // 1_000_000,
                         int(self._wait.total_seconds() * 1000))
        started = time.monotonic()
        work = self._process_group.allreduce([rows])
        try:
            work.wait(self._wait)
        except Exception as error:  # a timeout, or gloo's error (a peer died)
            self._give_up(work, seq, started, error)
        seqs, flags, starts, waits = zip(*rows.tolist())
        if len(set(seqs)) > 1:
            by_seq = {}
            for rank, number in zip(self.ranks, seqs):
                by_seq.setdefault(number, []).append(rank)
            where = "; ".join(f"rank(s) {_ranks_text(ranks)} at agreement {number}" for number, ranks in
                              sorted(by_seq.items()))
            raise AgreementMisaligned(
                f"overflow_fast: the nan/inf agreement is misaligned: {where}. Some rank skipped or abandoned "
                f"an agreement point, or the ranks call agree() unevenly; nothing was decided. {_REMEDY} This "
                "Agreement is now unusable; create a new one on every rank to go on.")
        # A rank whose wait may have run out gives up through the store; settle with it.
        now = time.time_ns() // 1_000_000
        if any(now - start >= limit / 2 for start, limit in zip(starts, waits)):
            verdict = self._store.compare_set(f"verdict/{seq}", "", "done").decode()
            if verdict != "done":
                raise AgreementError(
                    f"overflow_fast: rank {self.rank}'s agreement {seq} completed only after "
                    f"{verdict.removeprefix('abandoned: ')}; nothing was decided. {_REMEDY} This Agreement is now "
                    "unusable; create a new one on every rank to go on.")
        return [rank for rank, flag in zip(self.ranks, flags) if flag]

    def _give_up(self, work, seq, started, error):
        """This rank's wait ended without the agreement (its timeout, or gloo's error once a peer
        gave up or died): record that for the other ranks, unless one of them completed the
        agreement first (then wait for it here too); else raise."""
        others = _ranks_text([rank for rank in self.ranks if rank != self.rank])
        waited = time.monotonic() - started
        record = f"rank {self.rank} gave up agreement {seq} after waiting {waited:.2f} s for rank(s) {others}"
        verdict = self._store.compare_set(f"verdict/{seq}", "", "abandoned: " + record).decode()
        if verdict == "done":
            try:
                work.wait(self._wait)
                return
            except Exception as second:
                error = second
                waited = time.monotonic() - started
        _abandoned.append(self._process_group)  # freeing it would wait for the stuck collective
        after = (f"{_REMEDY} This Agreement is now unusable; create a new one on every rank to go on. "
                 f"({type(error).__name__}: {error})")
        first = verdict.removeprefix("abandoned: ")
        earlier = first if verdict.startswith("abandoned: ") and first != record else None  # another rank's
        if waited >= 0.99 * self._wait.total_seconds():
            raise AgreementTimeout(
                f"overflow_fast: rank {self.rank} waited {waited:.2f} s at agreement {seq} for rank(s) {others} "
                "and gave up: some rank runs forwards the others do not, skipped this agreement, or died."
                + (f" ({earlier[0].upper()}{earlier[1:]} too.)" if earlier else "") + f" {after}"
            ) from error
        if earlier:  # gloo's error once a peer that gave up closed its connections
            raise AgreementError(f"overflow_fast: rank {self.rank}'s agreement {seq} failed after {waited:.2f} s: "
                                 f"{earlier}. {after}") from error
        raise AgreementError(f"overflow_fast: rank {self.rank}'s agreement {seq} failed after {waited:.2f} s "
                             f"(a rank died?). {after}") from error

    def __repr__(self):
        state = f"broken: {self.broken}" if self.broken else f"seq={self.seq}"
        return f"Agreement(ranks {_ranks_text(self.ranks)}, rank {self.rank}, {state})"


_agreements = {}  # (ranks, timeout) -> the Agreement agree() uses


def agree(detected, group=None, timeout=None):
    """The sorted ranks of ``group`` (global ranks) that passed ``detected=True``.

    :meth:`Agreement.agree` on an :class:`Agreement` this function creates at its first call
    for ``group`` and ``timeout`` (so that first call is where every rank must meet to create it)
    and keeps; after an error it is dropped, and the next call creates a new one (on every rank:
    each rank saw the error). Without an initialized process group, in a group of one rank, or
    inside :func:`local_only`, no collective runs: ``[this rank]`` or ``[]``.
    ``timeout`` (seconds or a timedelta): how long to wait for the other ranks before raising an
    :class:`AgreementError` (a RuntimeError; otherwise the default group's timeout applies).
    """
    detected = bool(detected)
    dist = _dist()
    where = world(group) if dist is not None else None
    if where is None or is_local_only():
        rank = dist.get_rank() if dist is not None else 0
        return [rank] if detected else []
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(where[1]))
    key = (ranks, _as_timedelta(timeout))
    try:
        agreement = _agreements.get(key) if _instances_world is dist.group.WORLD else None
        if agreement is None:
            agreement = Agreement(timeout=timeout, group=group)
            _agreements[key] = agreement
        return agreement.agree(detected)
    except AgreementError:
        _agreements.pop(key, None)
        raise
