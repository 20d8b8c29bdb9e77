"""The Lightning-facing pieces of the checkpoint layer (importing them imports Lightning).

* :mod:`.callback` -- ``EmergencyCheckpoint``: periodic and on-demand snapshots, auto-resume;
  its parts: :mod:`.calibration` (the snapshot schedule), :mod:`.auto_resume`,
  :mod:`.durable_copies` (offers to the durable tier, the SIGTERM flush), :mod:`.background`
  (background copies and their optimizer step pre-hooks);
* :mod:`.io` -- ``MemoryCheckpointIO``: ``mem://`` paths for ``ckpt_path``.

Only Lightning's public API is used here; what needs its internals is in
:mod:`lightning_ft._lightning.checkpointing`.
"""
