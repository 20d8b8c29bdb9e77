"""Where a run's rendezvous state lives: a TCPStore reached (or hosted) at the endpoint.

* :mod:`.tcp` -- endpoints, reaching or hosting the store, every connection bounded;
* :mod:`.backend` -- :class:`~.backend.RendezvousBackend`, the interface the rendezvous keeps its
  state behind, and :class:`~.backend.StoreBackend`, its plain implementation (the fail-over one
  is :class:`lightning_ft.failover.backend.FailoverBackend`).

``lightning-ft store`` (a store in a process of its own) is :mod:`lightning_ft.launch.store_server`.
"""

# torch's rendezvous package loads out-of-tree backends (lightning_ft.launch.torchrun, which imports
# this package) while it initializes, and modules here import it: import it first, so that load
# finds this package's modules complete (see lightning_ft.rendezvous)
import torch.distributed.elastic.rendezvous  # noqa: F401  isort: skip
