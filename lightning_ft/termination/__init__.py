"""The SIGTERM path: agree on a stop step, probe node health, then snapshot or exit at once.

``lightning_ft.GracefulTermination`` (in :mod:`lightning_ft.termination.callback`) is the
Lightning callback. The other submodules do not import Lightning: ``decision`` (pure
decisions), ``coordination`` (stop-step agreement over a Store), ``signals`` (recording
handlers + watcher thread), ``exit`` (exit code, watchdog, process-group destroy) and
``exit_records`` (per-rank exit records and the ``python -m
lightning_ft.termination.exit_records -- torchrun ...`` wrapper that turns them into a
truthful node exit code).
"""
