"""The fault-tolerance runtime: everything a fault-tolerant strategy does, held as one object.

:class:`~.runtime.FaultToleranceRuntime` (one per process) owns the rendezvous session and its
rounds (:mod:`.session`), the loop that runs ``fit()`` round by round (:mod:`.fit_loop`), what
happens when a round fails (:mod:`.recovery`, deciding with the pure rules of :mod:`.decisions`),
the round's watchdog (:mod:`.watchdog`) and transport (:mod:`.transport`), a hot spare's monitor
(:mod:`.spare_monitor`) and the settings (:mod:`.settings`). What differs between replicated and
sharded state is a layout (:mod:`.layout`). The Lightning strategies in :mod:`lightning_ft.strategy`
hold a runtime and forward Lightning's hooks to it.
"""

# torch's rendezvous package loads out-of-tree backends (lightning_ft.launch.torchrun, which imports
# this package) while it initializes, and modules here import it: import it first, so that load
# finds this package's modules complete (see lightning_ft.rendezvous)
import torch.distributed.elastic.rendezvous  # noqa: F401  isort: skip
