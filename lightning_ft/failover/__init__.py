"""The rendezvous store fails over to a surviving participant (a :class:`~.backend.FailoverBackend`).

* :mod:`.switchboard` -- where the store is now and the fail-over that moves it;
* :mod:`.connection` -- :class:`~.connection.FailoverStore`, a connection that follows it (every
  connection of the process is one);
* :mod:`.presence` -- the presence protocol (who is alive, proven) and probing a participant;
* :mod:`.listener` -- each participant's presence listener;
* :mod:`.rebuild` -- pure rules: who may serve (a quorum), the state rebuilt from the views;
* :mod:`.candidates` -- who may host the store next, as the participant learns it each round;
* :mod:`.reach` -- bounded connects to a store, and what a failed one means (refused, full);
* :mod:`.backend` -- the :class:`~lightning_ft.store.backend.RendezvousBackend` that ties them together.
"""

# torch's rendezvous package loads out-of-tree backends (lightning_ft.launch.torchrun, which imports
# this package) while it initializes, and modules here import it: import it first, so that load
# finds this package's modules complete (see lightning_ft.rendezvous)
import torch.distributed.elastic.rendezvous  # noqa: F401  isort: skip
