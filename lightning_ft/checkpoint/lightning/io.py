"""``MemoryCheckpointIO``: Lightning CheckpointIO that serves ``mem://`` paths from the snapshot store."""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from lightning_ft._lightning.checkpointing import module_being_restored
from lightning_ft._validation import require_number
from lightning_ft.checkpoint.durable.settings import resolve_durable_settings
from lightning_ft.checkpoint.durable.tier import DurableTier
from lightning_ft.checkpoint.exchange.agreement import resume_from_newest_intact
from lightning_ft.checkpoint.identity import ExpectedIdentity, identity_mismatch, state_dict_fingerprint
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.roots import (
    RUN_ID_ENV_VARS,
    configured_run_id,
    current_rank,
    ensure_writable_root,
    resolve_root,
    resolve_run_id,
)
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import parse_mem_url, pick_disk_checkpoint
from lightning_ft.checkpoint.tiers import every_copy_damaged

log = logging.getLogger(__name__)


class MemoryCheckpointIO(CheckpointIO):
    """Routes ``mem://latest`` and ``mem://<step>`` to in-memory snapshots; any other path
    goes to the wrapped ``checkpoint_io`` (default ``TorchCheckpointIO``).

    ``Trainer(plugins=[MemoryCheckpointIO()]).fit(model, ckpt_path="mem://latest")`` resumes from
    the newest snapshot of this run id and this model (same parameter names and shapes) every
    rank can read (ranks agree over the default process group when one is initialized). With no
    such snapshot, the newest ``*.ckpt`` in ``fallback_dir`` is loaded if given, else
    FileNotFoundError is raised. ``mem://<step>`` naming a snapshot of another run or model, or
    any ``mem://`` path without a configured run id, fails with a message that says why.

    Args:
        checkpoint_io: IO for ordinary paths (default ``TorchCheckpointIO()``).
        root, run_id, keep_last: as for ``SnapshotStore``.
        replicated: ranks hold identical state (DDP), so a rank may load a peer rank's snapshot
            from the same host. Set False for sharded strategies.
        fallback_dir: directory whose newest ``*.ckpt`` is used when no snapshot exists.
        persist_to, storage_options: the durable tier to resume from when memory lacks the step
            (default ``$LIGHTNING_FT_PERSIST_TO``; see ``EmergencyCheckpoint``): ``mem://latest``
            takes the newest step every rank can get from memory or durable storage.

    ``save_checkpoint("mem://...")`` through ``Trainer.save_checkpoint`` only runs on global
    rank 0 (Lightning's rule); per-rank snapshots come from ``EmergencyCheckpoint``.
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None, root: str | None = None,
                 run_id: str | None = None, keep_last: int = 2, replicated: bool = True,
                 fallback_dir: str | os.PathLike | None = None, persist_to: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        require_number("keep_last", keep_last, integer=True, minimum=1, inclusive=True)
        if checkpoint_io is not None and not isinstance(checkpoint_io, CheckpointIO):
            raise ValueError(f"checkpoint_io must be a CheckpointIO, got {type(checkpoint_io).__name__}")
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self.root = resolve_root(root)
        ensure_writable_root(self.root)
        self.run_id = resolve_run_id(run_id)
        self._configured_run_id = configured_run_id(run_id)
        self.keep_last = keep_last
        self.replicated = replicated
        self.fallback_dir = None if fallback_dir is None else os.fspath(fallback_dir)
        self._store: SnapshotStore | None = None
        settings = resolve_durable_settings(persist_to, storage_options=storage_options)
        self.durable = (DurableTier.from_settings(settings, self._configured_run_id)
                        if settings is not None and self._configured_run_id is not None and replicated else None)

    @property
    def store(self) -> SnapshotStore:
        # The rank is only known once the process group exists, so the store is built lazily.
        rank = current_rank()
        if self._store is None or self._store.rank != rank:
            if self._store is not None:
                self._store.close()
            self._store = SnapshotStore(self.root, self._configured_run_id, rank, self.keep_last)
        return self._store

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        spec = parse_mem_url(path)
        if spec is None:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        step = int(checkpoint.get("global_step", 0)) if spec == "latest" else spec
        self.store.save(checkpoint, step, reason="CheckpointIO")

    def _expected_identity(self, store: SnapshotStore) -> ExpectedIdentity:
        module = module_being_restored()
        model = state_dict_fingerprint(module.state_dict()) if module is not None else None
        return store.expected_identity(model=model, rank=None if self.replicated else store.rank)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        spec = parse_mem_url(path)
        if spec is None:
            return self.checkpoint_io.load_checkpoint(path, *args, **kwargs)
        store = self.store
        expect = self._expected_identity(store)
        no_run_id = (f"no run id is set (run_id=, {', '.join(RUN_ID_ENV_VARS)}), so no snapshot can be shown to "
                     "belong to this job; set one that stays the same across restarts of the job")
        if spec == "latest":
            scan = store.scan(include_peers=self.replicated, expect=expect)
            choice = resume_from_newest_intact(scan.readable, self.durable, store, store.rank, expect)
            step = choice.step
            if step is None:
                why = no_run_id if store.configured_run_id is None else "; ".join(
                    f"step {info.step} skipped: {reason}" for info, reason in scan.foreign[:3])
                if choice.damaged and self.durable is not None:
                    why = "; ".join(filter(None, (every_copy_damaged(choice.damaged, self.durable.target.url), why)))
                fallback = self._fallback_path()
                if fallback is None:
                    raise FileNotFoundError(
                        f"{path}: no intact snapshot of run {store.run_id!r} under {store.run_dir}"
                        + (f" and no *.ckpt in {self.fallback_dir}" if self.fallback_dir else "")
                        + (f" ({why})" if why else ""))
                (log.warning if choice.damaged else log.info)(
                    "%s: no snapshot of run %r%s; falling back to disk checkpoint %s", path, store.run_id,
                    f" ({why})" if why else "", fallback)
                return self.checkpoint_io.load_checkpoint(fallback, *args, **kwargs)
        else:
            step = spec
            if store.configured_run_id is None:
                raise ValueError(f"{path}: {no_run_id}")
        info = store.find(step, include_peers=self.replicated)
        if info is None:
            raise FileNotFoundError(f"{path}: no intact snapshot at step {step} for rank {store.rank} "
                                    f"of run {store.run_id!r}")
        refusal = identity_mismatch(store.identity(info), expect)
        if refusal is not None:
            raise SnapshotError(f"{path}: refusing to load the snapshot at step {step} ({info.path}): {refusal}. "
                                f"Resume a snapshot only into the job and model that wrote it; to train this one "
                                f"from scratch, drop ckpt_path={path!r}.")
        return store.load(info, expect=expect)

    def _fallback_path(self) -> str | None:
        if not self.fallback_dir:
            return None
        paths = glob.glob(os.path.join(glob.escape(self.fallback_dir), "*.ckpt"))
        return pick_disk_checkpoint((p, os.path.getmtime(p)) for p in paths if os.path.isfile(p))

    def remove_checkpoint(self, path: Any) -> None:
        spec = parse_mem_url(path)
        if spec is None:
            self.checkpoint_io.remove_checkpoint(path)
            return
        store = self.store
        infos = store.list()
        for info in infos[:1] if spec == "latest" else [i for i in infos if i.step == spec]:
            store.delete(info)

    def teardown(self) -> None:
        self.checkpoint_io.teardown()
        if self._store is not None:
            self._store.close()
