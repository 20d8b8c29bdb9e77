"""After a partition: a process that was frozen while the others failed over finds their store.

Before it re-joins after a failure, a participant asks the first fail-over candidates which store
they follow; it moves to a newer one only when a strict majority of those not proven gone --
itself included, which stays -- follow it, at an endpoint a candidate announced or the job
listed, once that store serves the epoch
(:meth:`~lightning_ft.failover.switchboard.StoreSwitchboard.follow`). A majority, not the first
that answers: one answer proves little without a job secret (a squatter on a dead participant's
ports can give it), and the store it names opened with a majority behind it.
"""

from __future__ import annotations

from lightning_ft.failover.presence import ask_each
from lightning_ft.failover.rebuild import follow_settled, store_to_follow
from lightning_ft.failover.switchboard import StoreSwitchboard
from lightning_ft.schema.run import ROSTER_HEAD


def follow_newest(board: StoreSwitchboard) -> bool:
    """Follow a newer store if a majority of the first candidates not proven gone, this process
    included, follow it (see the module); True when this process moved."""
    others = [c for c in board.candidates if c.participant_id != board.participant_id][:ROSTER_HEAD]
    if not others or board.scope is None:
        return False
    announced = board.announced()
    # this process is a voter too, one that stays: the majority is of every candidate not proven
    # gone, itself included, as a successor opens only with a majority of them. Without it, in a
    # job of two the lost peer's answer alone was a majority -- and a squatter on its ports gives it
    answers: list[tuple[str, int, str]] = [("alive", board.epoch, "")]
    asked = len(others) + 1
    # half first: when nobody moved (the common case, every re-join after a peer loss) their
    # answers settle it, and a failure round of N participants makes N x half the probes
    first = (len(others) + 1) // 2
    for wave in (others[:first], others[first:]):
        if not wave or follow_settled(board.epoch, answers, asked, announced):
            break
        answers += [(a.state, a.epoch, a.store) for a in ask_each(wave, lambda c: board.probe(c, "STATUS"))]
    target = store_to_follow(board.epoch, answers, announced)
    return target is not None and board.follow(*target)
