"""The memory tier: snapshots in host shared memory, one directory per run and rank.

* :mod:`.store` -- :class:`~.store.SnapshotStore`, the one object callers use;
* :mod:`.listing`, :mod:`.reading`, :mod:`.writing` -- what it does: list the committed files,
  check and load them, write (save, commit, prune, spare file, received copies);
* :mod:`.format` -- the file format (encode, verify, decode); :mod:`.copying` -- copying the
  tensors into a file (and the background copy); :mod:`.files` -- safe file operations and maps;
* :mod:`.roots` -- where: the root, the run's directory, this process's rank.
"""
