"""Emergency in-memory snapshot vs Lightning's on-exception disk checkpoint vs raw memcpy.

For states of 10 MiB, 100 MiB and 1 GiB (parameters + Adam moments, inside a real
``Trainer.fit``), at a step boundary this measures:

* ours:   ``EmergencyCheckpoint.save_now`` (dump_checkpoint -> committed snapshot in /dev/shm),
          the first save (fresh tmpfs file) and steady state (previous snapshots exist, as with
          periodic snapshots: the oldest file is recycled);
* disk:   ``ModelCheckpoint(save_on_exception=True).on_exception`` -> ``trainer.save_checkpoint``
          to a directory on /work's disk (Lightning's own save path);
* memcpy: ``copy_`` of the same tensors into a preallocated, pre-touched buffer;
* resume: ``SnapshotStore.load`` (verify + copy out) vs ``strategy.load_checkpoint`` of the disk file;
* checksum options over the 1 GiB data region: zlib.crc32 vs our int64 block sums.

Usage: ``.venv/bin/python benchmarks/bench_snapshot.py [--sizes 10,100,1024] [--no-write]``
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ft import EmergencyCheckpoint
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import ReadMap
from lightning_ft.checkpoint.memory.roots import default_root

HERE = Path(__file__).resolve().parent
SECTION = "## In-memory snapshot (issue: SIGTERM path)"
MiB = 1 << 20


class BigModule(pl.LightningModule):
    """Parameters of size/3 bytes; Adam adds two moments of the same size -> ~size bytes of state."""

    def __init__(self, state_bytes: int) -> None:
        super().__init__()
        numel = state_bytes // 3 // 4
        parts = 4
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(numel // parts) * 0.01) for _ in range(parts))
        self.head = torch.nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        loss = self.head(batch).pow(2).mean()
        for p in self.weights:
            loss = loss + p.sum() * 1e-6  # cheap, but gives every parameter a gradient
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(torch.randn(64, 16), batch_size=4)


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _times(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


class Measure(pl.Callback):
    """Drives an EmergencyCheckpoint through a short fit and times every save_now.

    step 1: a save into a fresh file (a second instance with ``preallocate=False``), and the
            one-off spare preallocation done by the default instance's step hook;
    step 2: the first emergency save of the default instance (goes into the spare);
    step 3: second save (into the spare preallocated after step 2);
    step 4+: steady state (keep_last=2 files exist; the oldest is recycled). At each of these
            steps memcpy and the disk save are timed right after ours, so all three see the
            same machine load (other jobs share the 2 cores); the table reports the minimum.
    At the last step: resume-load times and the checksum options.
    """

    def __init__(self, label: str, reps: int, disk_dir: Path, run_id: str, checksum_options: bool) -> None:
        self.label, self.reps, self.disk_dir, self.run_id = label, reps, disk_dir, run_id
        self.checksum_options = checksum_options
        self.result: dict = {}
        self.emergency = EmergencyCheckpoint(run_id=run_id, keep_last=2, auto_resume=False)
        self.times: dict[str, list[float]] = {"ours": [], "memcpy": [], "disk": []}
        self.dst: torch.Tensor | None = None
        self.mc = ModelCheckpoint(dirpath=str(disk_dir), save_on_exception=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        r = self.result
        if step == 1:
            fresh = EmergencyCheckpoint(run_id=self.run_id + "-fresh", auto_resume=False, preallocate=False)
            start = time.perf_counter()
            fresh.save_now(trainer, reason="bench-fresh")
            r["ours_fresh"] = time.perf_counter() - start
            fresh.store.delete(fresh.last_snapshot)
            fresh.store.close()
        start = time.perf_counter()
        self.emergency.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # preallocates if needed
        if step == 1:
            r["prealloc"] = time.perf_counter() - start
            return
        start = time.perf_counter()
        self.emergency.save_now(trainer, reason="bench")
        seconds = time.perf_counter() - start
        if step == 2:
            r["ours_first"] = seconds
        if step >= 4:
            self.times["ours"].append(seconds)
            self.times["memcpy"].append(self._memcpy(trainer))
            self.times["disk"].append(self._disk(trainer, pl_module))
        if step == trainer.max_steps:
            self._finish(trainer, pl_module)

    def _memcpy(self, trainer) -> float:
        """copy_ of the same tensors into a preallocated, already touched buffer."""
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        tensors = _tensors(ckpt, [])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.result["state_bytes"] = nbytes
        if self.dst is None:
            self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.dst[off: off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n
        return time.perf_counter() - start

    def _disk(self, trainer, pl_module) -> float:
        """Lightning's own on-exception save path, to a file on /work's disk."""
        self._clear_disk()
        start = time.perf_counter()
        self.mc.on_exception(trainer, pl_module, RuntimeError("benchmark"))
        return time.perf_counter() - start

    def _clear_disk(self) -> None:
        self.mc._last_global_step_saved = -1  # otherwise it skips a second save at the same step
        for p in self.disk_dir.glob("*.ckpt"):
            p.unlink()

    def _finish(self, trainer, pl_module):
        r = self.result
        for key, values in self.times.items():
            r[key] = min(values)
            r[key + "_median"] = statistics.median(values)
        r["snapshot_bytes"] = self.emergency.last_snapshot.nbytes
        self.dst = None
        store = self.emergency.store
        info = store.latest()
        r["ours_load"] = min(_times(lambda: store.load(info), self.reps))
        if self.checksum_options:
            with ReadMap(info.path) as (mm, size):
                header = fmt.Header.unpack(mm)
                data = fmt.frombuffer_u8(mm, header.data_off, header.data_len)
                r["sum_digest"] = min(_times(lambda: fmt.block_sums(data), 5))
                view = memoryview(mm)[header.data_off: header.file_size]
                r["crc32_digest"] = min(_times(lambda: zlib.crc32(view), 3))
                view.release()
                del data
        disk_file = next(self.disk_dir.glob("*.ckpt"))
        r["disk_bytes"] = disk_file.stat().st_size
        r["disk_load"] = min(_times(lambda: trainer.strategy.load_checkpoint(str(disk_file)), self.reps))
        self._clear_disk()
        self.emergency.teardown(trainer, pl_module, "fit")


def run_size(size_mib: int, disk_parent: Path) -> dict:
    label = f"{size_mib} MiB" if size_mib < 1024 else f"{size_mib // 1024} GiB"
    reps = 5 if size_mib <= 100 else 6
    run_id = f"bench-{os.getpid()}-{size_mib}"
    disk_dir = Path(tempfile.mkdtemp(prefix=".bench-disk-", dir=disk_parent))
    measure = Measure(label, reps, disk_dir, run_id, checksum_options=size_mib >= 1024)
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3 + reps, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, callbacks=[measure])
        trainer.fit(BigModule(size_mib * MiB))
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        for rid in (run_id, run_id + "-fresh"):
            shutil.rmtree(os.path.join(os.environ.get("LIGHTNING_FT_SNAPSHOT_DIR") or default_root(), rid),
                          ignore_errors=True)
    return {"label": label, **measure.result}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def render(results: list[dict]) -> str:
    lines = [
        "| state | memcpy | ours: save_now steady | ours: first save (spare) | ours: fresh file | "
        "disk: on-exception ckpt | **disk / ours** steady (first) | **ours / memcpy** steady (first) | "
        "spare prealloc (one-off) | resume load: ours / disk |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n = r["state_bytes"]

        def cell(key: str, r: dict = r, n: int = n) -> str:
            return f"{r[key] * 1e3:.1f} ms ({_gbps(n, r[key]):.1f} GB/s)"
        lines.append(
            f"| {r['label']} | {cell('memcpy')} | {cell('ours')} | {cell('ours_first')} | {cell('ours_fresh')} "
            f"| {r['disk'] * 1e3:.0f} ms ({_gbps(n, r['disk']):.2f} GB/s) "
            f"| **{r['disk'] / r['ours']:.1f}x** ({r['disk'] / r['ours_first']:.1f}x) "
            f"| **{r['memcpy'] / r['ours'] * 100:.0f}%** ({r['memcpy'] / r['ours_first'] * 100:.0f}%) "
            f"| {r['prealloc'] * 1e3:.0f} ms "
            f"| {r['ours_load'] * 1e3:.0f} ms / {r['disk_load'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def render_verdict(results: list[dict]) -> str:
    out = []
    for r in results:
        speedup, share = r["disk"] / r["ours"], r["memcpy"] / r["ours"]
        first = r["disk"] / r["ours_first"]
        out.append(f"- {r['label']}: disk / ours {speedup:.1f}x steady, {first:.1f}x first save "
                   f"({'meets' if min(speedup, first) >= 5 else 'misses'} >= 5x); ours / memcpy {share * 100:.0f}%"
                   f" ({'meets' if share >= 0.5 else 'misses'} >= 50%).")
    small = [r for r in results if r["disk"] / min(r["ours"], r["ours_first"]) < 5]
    if small:
        out.append("- Where 5x is missed (small states), both paths take single-digit milliseconds: ours spends ~1 ms "
                   "per save besides the copy (Lightning's dump_checkpoint, metadata pickle, the checksum pass, "
                   "directory listing and renames), which a few MB of copying cannot amortize; irrelevant against a "
                   "25-30 s SIGTERM budget.")
    return "Outcome:\n\n" + "\n".join(out)


def render_checksums(results: list[dict]) -> str:
    big = [r for r in results if "sum_digest" in r]
    if not big:
        return ""
    r = big[-1]
    n = r["snapshot_bytes"]

    def row(name: str, key: str) -> str:
        t = r[key]
        return (f"| {name} | {t * 1e3:.0f} ms | {_gbps(n, t):.1f} GB/s | {t / r['memcpy'] * 100:.0f}% "
                f"| {r['memcpy'] / (r['memcpy'] + t) * 100:.0f}% |")
    return "\n".join([
        f"Checksum options, one pass over the {r['label']} data region of a committed snapshot (same run):",
        "",
        "| digest over all data | pass time | bandwidth | cost vs. the memcpy of the same bytes "
        "| best possible ours / memcpy (copy at memcpy speed + this pass) |",
        "|---|---|---|---|---|",
        row("int64 sums per 1 MiB block (chosen)", "sum_digest"),
        row("zlib.crc32", "crc32_digest"),
    ])


def write_results(text: str, section: str = SECTION) -> Path:
    """Put ``text`` (which starts with ``section``) into RESULTS.md in place of that section."""
    path = HERE / "RESULTS.md"
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    start = old.find(section)
    if start == -1:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        nxt = old.find("\n## ", start + len(section))
        new = old[:start] + text.rstrip("\n") + "\n" + (old[nxt:] if nxt != -1 else "")
    path.write_text(new)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1024", help="state sizes in MiB")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update RESULTS.md")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    disk_parent = HERE  # on /work's disk, not tmpfs
    started = time.time()
    load_before = os.getloadavg()[0]
    results = [run_size(int(s), disk_parent) for s in args.sizes.split(",")]
    table = render(results)
    checks = render_checksums(results)
    for r in results:
        print(r["label"], {k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in r.items()
                           if k != "label"}, "(times in ms)")
    print(table)
    print()
    print(checks)
    print(f"\n(total {time.time() - started:.0f} s)")
    if not args.no_write:
        note = (f"Run of {time.strftime('%Y-%m-%d %H:%M')}, {time.time() - started:.0f} s; 1-min load average "
                f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after (other jobs share the 2 cores).")
        print("updated", write_results(report(table, checks, note, render_verdict(results))))


def report(table: str, checks: str, note: str, verdict: str) -> str:
    return f"""{SECTION}

`benchmarks/bench_snapshot.py` (2 vCPU KVM guest shared with other jobs, 24 GiB, /dev/shm tmpfs, /work on
virtio disk; torch {torch.__version__}, {torch.get_num_threads()} intra-op threads). State = parameters + Adam
moments inside a real `Trainer.fit`, measured at step boundaries (`on_train_batch_end`).

- **memcpy**: `copy_` of the same tensors into a preallocated, pre-touched buffer (upper bound for any copy).
- **ours**: `EmergencyCheckpoint.save_now()` = `dump_checkpoint()` -> metadata pickle + flat data region copied
  into an mmap'd file in `/dev/shm` -> block checksums -> atomic rename -> prune.
  *steady*: `keep_last=2` snapshots exist (periodic snapshots), the oldest file and its mapping are reused.
  *first save (spare)*: the first-ever snapshot with the default `preallocate=True` (written into the spare file
  the callback preallocated at step 1; the one-off preallocation is the "spare prealloc" column).
  *fresh file*: the first-ever snapshot with `preallocate=False`: the kernel allocates and zeroes every tmpfs
  page during the copy (2-3 GB/s here; up to 5x slower when the VM touches memory for the first time after boot).
  The default instead pays that cost once, at the first step boundary ("spare prealloc").
- **disk**: `ModelCheckpoint(save_on_exception=True).on_exception()` -> `trainer.save_checkpoint()` to a file on
  /work's disk (torch.save to a buffer, then write; Lightning does not fsync, so this is the page-cache best case).
- **resume load**: `SnapshotStore.load()` (verify checksums + copy every tensor out) vs
  `strategy.load_checkpoint()` of the disk file (what `fit(ckpt_path=...)` does).

Steady-state ours, memcpy and disk were timed back to back at each of 5-6 steps and the table shows the
minimum of each (the machine is shared; medians are in the raw output); first / fresh / prealloc are single
samples. Ratios in bold: disk / ours (goal >= 5x) and ours bandwidth / memcpy bandwidth (goal >= 50% at 1 GiB),
steady state first, first save (spare) in parentheses.

{note}
Spread across the development runs of this script (same machine, varying load from other jobs): 1 GiB steady save
141-184 ms, memcpy 96-140 ms, disk 2.0-3.2 s (6.3 s under heavy load); the int64 sum pass 37-41 ms (26-29 GB/s)
when the machine was quiet.

{table}

{verdict}

{checks}

The int64 block sums are a bandwidth-bound torch reduction; crc32 (zlib 1.2.13 here) runs at ~2 GB/s and would by
itself cost several memcpys of the data, putting the 1 GiB goal out of reach. What the chosen check detects: the
header has its own crc32; crc32 covers the block-sum table and the pickled metadata; the file size must equal the
size in the header; the data region is covered by wrap-around int64 sums per 1 MiB block. Together: truncated /
torn files, any single flipped bit or byte anywhere, zeroed or stale pages, data from an older snapshot left in a
recycled file, bytes moved between blocks. Not detected: 8-byte words swapped within one 1 MiB block, or several
changes that cancel in a block's sum (neither is how a crash or a partial copy damages a file). A kill -9
mid-write never produces a committed file at all (temp name + rename).
"""


if __name__ == "__main__":
    main()
