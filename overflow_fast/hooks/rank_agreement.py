"""Under torch.distributed every rank stops together: at the end of each pass one small collective,
on a gloo process group of its own (``distributed.Agreement``), tells every rank which ranks
detected; all raise together (with on_detect="skip": all skip the step together). Its sequence
number counts the agreement points and tells their kinds apart, so ranks that meet at different
points (uneven forwards, a backward one rank skipped after its forward raised) get an error naming
them, never a decision."""

from .. import distributed
from .errors import OverflowDetectedOnRanks

# the kinds of agreement point (a sequence number's low bits)
FORWARD_END, BACKWARD_END, REPLAYED = 0, 1, 2


class RankAgreement:
    """One detector's agreements (``sync``, ``sync_timeout``: its options; ``strategy``: its
    ``on_detect``'s, which says whether its decisions are agreed at all)."""

    def __init__(self, sync, sync_timeout, strategy):
        self.sync = sync
        self.timeout = sync_timeout
        self.strategy = strategy
        self.agreement = None  # made when first needed, if not here
        self.points = 0  # agreement points reached
        if self.wanted():
            # collective: every rank builds its detector here; a rank alone fails here, in time
            self.agreement = distributed.Agreement(timeout=self.timeout)

    def wanted(self):
        """Whether this detector's decisions are agreed between ranks (see overflow_fast.distributed)."""
        return (self.sync and self.strategy.agreed and distributed.world() is not None
                and not distributed.is_local_only())

    def ranks(self, flag, kind):
        """The ranks whose ``flag`` is true, agreed at a point of ``kind`` (one collective)."""
        if self.agreement is None:
            self.agreement = distributed.Agreement(timeout=self.timeout)
        self.points += 1
        return self.agreement.agree(flag, seq=4 * self.points + kind)

    def end_of_pass(self, stop, kind, state):
        """A pass ended on every rank: raise ``OverflowDetectedOnRanks`` on all of them when one
        detected. ``stop``: this rank's detection, (detection, frames), or None; ``state``: the
        reference's state machine (its flag is set when another rank detected)."""
        ranks = self.ranks(bool(stop) or self.strategy.skipping(), kind)
        if ranks and (stop or not self.strategy.ranks_detected()):
            state.set_detected_overflow(True)
            raise OverflowDetectedOnRanks(ranks, distributed.world()[1], *(stop or ()))
