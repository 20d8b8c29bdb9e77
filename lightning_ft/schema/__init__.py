"""Every key lightning_ft keeps in a ``torch.distributed`` Store, and how each value is encoded.

One module per scope, each with encode/decode pairs next to the keys:

* :mod:`.run` -- the rendezvous of one run (``lightning_ft/<run_id>/``): the current round,
  slots, ranks, heartbeats, closing (:class:`~.run.CloseReason`), shutdown acknowledgements;
* :mod:`.round` -- the training job of one round (under the round's prefix): members,
  progress, failures, snapshot replicas, the process group's own keys;
* :mod:`.termination` -- the SIGTERM path (``lightning_ft/termination/<namespace>/``): the
  agreed stop step and unhealthy notices.

No Lightning; only torch's elastic key names are imported (by :mod:`.run`).
"""
