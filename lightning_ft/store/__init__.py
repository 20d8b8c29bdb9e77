"""Where a run's rendezvous state lives: a TCPStore reached (or hosted) at the endpoint.

* :mod:`.tcp` -- endpoints, reaching or hosting the store, every connection bounded;
* :mod:`.backend` -- :class:`~.backend.RendezvousBackend`, the interface the rendezvous keeps its
  state behind, and :class:`~.backend.StoreBackend`, its plain implementation (the fail-over one
  is :class:`lightning_ft.failover.backend.FailoverBackend`).

``lightning-ft store`` (a store in a process of its own) is :mod:`lightning_ft.launch.store_server`.
"""
