"""The SIGTERM path: agree on a stop step, probe node health, then snapshot or exit at once.

``lightning_ft.GracefulTermination`` (in :mod:`lightning_ft.termination.callback`) is the
Lightning callback. The submodules ``decision``, ``coordination``, ``signals`` and
``exit`` do not import Lightning.
"""
