"""Snapshot save and load of this tree's code against an older commit's, side by side in one run.

The older commit's ``lightning_ft/checkpoint`` store, file layer, policy and format are copied out
of git into a temporary package and driven with the same states, alternating old and new at
every repetition, so both see the same machine load (other jobs share the 2 cores). Reported:
the minimum and median of each, and new / old (below 1.00 = the new code is faster).

States (a Lightning-like checkpoint dict: ``state_dict``, AdamW ``optimizer_states``, loops,
callbacks, hyper-parameters):

* ``N MiB, 4 params``: four parameters and their two Adam moments (as ``bench_snapshot.py``);
  the copy and the checksums dominate;
* ``tiny``: four 1 KiB parameters: what every save and load costs besides the data;
* ``many tensors``: 400 parameters of a transformer-like model with Adam state (1,200 tensors
  plus 400 step counters); pickling the metadata and the per-tensor work dominate.

save = ``SnapshotStore.save`` in steady state (``keep_last=2``, the oldest file and its map are
recycled); first save = a new store writing a fresh file (a process's first snapshot; version 2
decodes the metadata once there as a load would); load = ``SnapshotStore.load`` (verify, decode,
copy out, verify again); the new code loads with the expected identity, as auto-resume does.

Usage: ``.venv/bin/python benchmarks/bench_snapshot_compare.py [--ref 588c8c8] [--sizes 10,100,1024]
[--reps 7] [--write]``. The default ref is the last commit with snapshot format version 1. States
under 1 MiB get 20x, under 256 MiB 4x the repetitions; every case starts with 3 untimed rounds.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_snapshot import write_results  # this directory is on sys.path when run as a script

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECTION = "## Snapshot save/load: format version 2 against version 1 (issue 10)"
MiB = 1 << 20
_REF_FILES = ("snapshot_format.py", "files.py", "policy.py", "store.py")


def load_reference(ref: str, into: Path):
    """The store module of ``ref``'s ``lightning_ft/checkpoint``, importable as ``_snapshot_ref.store``."""
    package = into / "_snapshot_ref"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in _REF_FILES:
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:lightning_ft/checkpoint/{name}"],
                                check=True, capture_output=True, text=True).stdout
        source = source.replace("from lightning_ft.checkpoint import snapshot_format",
                                "from _snapshot_ref import snapshot_format")
        source = source.replace("from lightning_ft.checkpoint.", "from _snapshot_ref.")
        (package / name).write_text(source)
    sys.path.insert(0, str(into))
    return importlib.import_module("_snapshot_ref.store")


def few_tensors_state(nbytes: int) -> dict:
    numel = nbytes // 3 // 4 // 4
    params = [torch.randn(numel) for _ in range(4)]
    return _lightning_like(collections.OrderedDict((f"weights.{i}", p) for i, p in enumerate(params)))


def many_tensors_state(layers: int = 50) -> dict:
    state_dict = collections.OrderedDict()
    for layer in range(layers):
        for name, shape in (("attn.qkv.weight", (384, 128)), ("attn.qkv.bias", (384,)), ("attn.out.weight", (128, 128)),
                            ("attn.out.bias", (128,)), ("mlp.up.weight", (512, 128)), ("mlp.up.bias", (512,)),
                            ("mlp.down.weight", (128, 512)), ("norm.weight", (128,))):
            state_dict[f"blocks.{layer}.{name}"] = torch.randn(shape)
    return _lightning_like(state_dict)


def _lightning_like(state_dict: dict) -> dict:
    optimizer = {"state": {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn_like(t),
                               "exp_avg_sq": torch.rand_like(t)} for i, t in enumerate(state_dict.values())},
                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                   "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                                   "differentiable": False, "fused": None, "params": list(range(len(state_dict)))}]}
    progress = {"total": {"ready": 100, "completed": 100}, "current": {"ready": 4, "completed": 4}}
    return {"epoch": 3, "global_step": 100, "pytorch-lightning_version": "2.6.6", "state_dict": state_dict,
            "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_batches_that_stepped": 100},
                                   "epoch_loop.batch_progress": progress, "epoch_progress": progress}},
            "callbacks": {"ModelCheckpoint{'monitor': 'val_acc'}": {"best_model_score": torch.tensor(0.9),
                                                                      "best_k_models": {"a.ckpt": torch.tensor(0.9)}}},
            "optimizer_states": [optimizer],
            "lr_schedulers": [{"base_lrs": [1e-3], "last_epoch": 100, "_step_count": 101}],
            "hparams_name": "kwargs", "hyper_parameters": {"lr": 1e-3, "hidden": 128, "name": "bench"}}


def state_bytes(state: dict) -> int:
    total = 0
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


def measure(label: str, state: dict, stores: dict, reps: int) -> dict:
    from lightning_ft.checkpoint.identity import model_fingerprint

    times = {(impl, op): [] for impl in stores for op in ("save", "load")}
    expect = stores["new"].expected_identity(model=model_fingerprint(state))
    step = 0
    for _ in range(3):  # warm up (maps, allocator); keep_last=2 files exist, so every timed save recycles one
        step += 1
        for store in stores.values():
            store.load(store.save(state, step=step), **({"expect": expect} if store is stores["new"] else {}))
    for rep in range(reps):
        step += 1
        order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
        for impl in order:
            store = stores[impl]
            start = time.perf_counter()
            info = store.save(state, step=step)
            times[(impl, "save")].append(time.perf_counter() - start)
            kwargs = {"expect": expect} if impl == "new" else {}
            start = time.perf_counter()
            store.load(info, **kwargs)
            times[(impl, "load")].append(time.perf_counter() - start)
    result = {"label": label, "bytes": state_bytes(state)}
    for (impl, op), values in times.items():
        result[f"{impl}_{op}_min"] = min(values)
        result[f"{impl}_{op}_median"] = statistics.median(values)
    return result


def measure_first_save(state: dict, open_store: dict, root: Path, reps: int) -> dict[str, float]:
    """The first save of a process: a new store writing a fresh file (this is where version 2
    decodes the metadata once as a load would). Old and new alternate; min over ``reps``."""
    times: dict[str, list[float]] = {impl: [] for impl in open_store}
    for rep in range(reps):
        for impl in (["old", "new"] if rep % 2 == 0 else ["new", "old"]):
            directory = root / f"first-{impl}-{rep}"
            start = time.perf_counter()
            store = open_store[impl](directory)
            store.save(state, step=1)
            times[impl].append(time.perf_counter() - start)
            store.close()
            shutil.rmtree(directory, ignore_errors=True)
    return {f"{impl}_first_min": min(values) for impl, values in times.items()}


def render(results: list[dict]) -> str:
    lines = ["| state | save old | save new | **save new/old** min (median) | load old | load new "
             "| **load new/old** min (median) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        def ms(key: str, r: dict = r) -> str:
            return f"{r[key] * 1e3:.1f} ms" if r[key] >= 1e-3 else f"{r[key] * 1e6:.0f} us"

        def ratio(op: str, r: dict = r) -> str:
            return (f"**{r[f'new_{op}_min'] / r[f'old_{op}_min']:.2f}** "
                    f"({r[f'new_{op}_median'] / r[f'old_{op}_median']:.2f})")
        size = f"{r['bytes'] / MiB:.0f} MiB" if r["bytes"] >= MiB else f"{r['bytes'] // 1024} KiB"
        lines.append(f"| {r['label']} ({size}) | {ms('old_save_min')} | {ms('new_save_min')} "
                     f"| {ratio('save')} | {ms('old_load_min')} | {ms('new_load_min')} | {ratio('load')} |")
    lines += ["", "| state | first save of a process, old | new | **new/old** |", "|---|---|---|---|"]
    for r in results:
        if "new_first_min" in r:
            lines.append(f"| {r['label']} | {r['old_first_min'] * 1e3:.1f} ms | {r['new_first_min'] * 1e3:.1f} ms "
                         f"| **{r['new_first_min'] / r['old_first_min']:.2f}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="588c8c8", help="the older commit (default: last with format version 1)")
    parser.add_argument("--sizes", default="10,100,1024", help="sizes in MiB of the 4-parameter states")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="put the table into RESULTS.md")
    args = parser.parse_args()
    from lightning_ft.checkpoint.memory.store import SnapshotStore

    scratch = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    shm = Path(tempfile.mkdtemp(prefix=f"lightning_ft-bench-{os.getpid()}-", dir="/dev/shm"))
    started, load_before = time.time(), os.getloadavg()[0]
    try:
        old_store = load_reference(args.ref, scratch)
        cases = [(f"{int(s)} MiB, 4 params" if int(s) < 1024 else f"{int(s) // 1024} GiB, 4 params",
                  lambda s=s: few_tensors_state(int(s) * MiB)) for s in args.sizes.split(",")]
        cases.insert(0, ("tiny: per-save/load fixed cost", lambda: few_tensors_state(4 * 3 * 4 * 256)))
        cases.insert(2, ("many tensors (400 params)", many_tensors_state))
        results = []
        for index, (label, make) in enumerate(cases):
            state = make()
            # cheap states get more repetitions: their minimum is what noise hides most
            reps = args.reps * (20 if state_bytes(state) < MiB else 4 if state_bytes(state) < 256 * MiB else 1)
            stores = {"old": old_store.SnapshotStore(root=shm / "old", run_id=f"c{index}", rank=0, keep_last=2),
                      "new": SnapshotStore(root=shm / "new", run_id=f"c{index}", rank=0, keep_last=2)}
            results.append(measure(label, state, stores, reps))
            if state_bytes(state) >= MiB and state_bytes(state) < 256 * MiB:
                results[-1].update(measure_first_save(state, {
                    "old": lambda d: old_store.SnapshotStore(root=d, run_id="first", rank=0),
                    "new": lambda d: SnapshotStore(root=d, run_id="first", rank=0)}, shm, args.reps))
            for store in stores.values():
                store.close()
            shutil.rmtree(shm / "old" / f"c{index}", ignore_errors=True)
            shutil.rmtree(shm / "new" / f"c{index}", ignore_errors=True)
            print(results[-1]["label"], {k: round(v * 1e3, 2) for k, v in results[-1].items()
                                         if isinstance(v, float)}, "(ms)", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    table = render(results)
    note = (f"`benchmarks/bench_snapshot_compare.py --ref {args.ref} --reps {args.reps}`, "
            f"{time.strftime('%Y-%m-%d %H:%M')}, {time.time() - started:.0f} s; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; 1-min load average {load_before:.1f} before / "
            f"{os.getloadavg()[0]:.1f} after (the 2 cores are shared with other jobs).")
    print(table)
    print(note)
    if args.write:
        text = (f"{SECTION}\n\n{note} Old and new alternate at every repetition; min and median of "
                f"{args.reps} repetitions (20x as many under 1 MiB, 4x under 256 MiB), after 3 untimed rounds. "
                f"new / old below 1.00 means the new code is faster.\n\n{table}\n")
        print("updated", write_results(text, SECTION))


if __name__ == "__main__":
    main()
