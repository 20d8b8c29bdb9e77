"""The durable tier: committed snapshot files copied verbatim to a directory or an object store.

* :mod:`.tier` -- :class:`~.tier.DurableTier`: upload a shard, publish complete steps, list,
  fetch, prune (the layout and the protocol);
* :mod:`.persister` -- :class:`~.persister.DurablePersister`: one rank's background uploader;
* :mod:`.targets` -- where copies go: a directory or an fsspec URL (atomic object writes);
* :mod:`.settings` -- ``persist_to`` and the ``LIGHTNING_FT_PERSIST_*`` settings.

The rules (complete steps, retention, pacing, flush budget) are pure functions in
:mod:`lightning_ft.checkpoint.tiers`.
"""
