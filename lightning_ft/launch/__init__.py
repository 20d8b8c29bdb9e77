"""How processes take part in a run: one participant factory, the torchrun handler, the store server.

* :mod:`.factory` -- :func:`~.factory.open_participant`, for the strategy's session and the torchrun
  handler alike: reach (or host) the store, choose the rendezvous backend (plain or fail-over),
  build the barrier rendezvous over it;
* :mod:`.torchrun` -- the torchrun ``RendezvousHandler`` (``--rdzv-backend=lightning_ft``);
* :mod:`.store_server` -- ``lightning-ft store``: the rendezvous store as a process of its own.
"""

# torch's rendezvous package loads out-of-tree backends (ours: .torchrun) while it initializes:
# import it before our modules, so that load finds them complete (see lightning_ft.rendezvous)
import torch.distributed.elastic.rendezvous  # noqa: F401  isort: skip
