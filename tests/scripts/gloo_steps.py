"""Worker for torchrun tests: STEPS all-reduce steps over gloo, progress shared through a file.

Writes ``<OUT>/progress`` (last finished step, by group rank 0) so a restarted group resumes,
``<OUT>/ran_<NODE>_<restart>`` when it starts and ``<OUT>/done_<NODE>`` when it finishes.
"""

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(os.environ["TEST_OUT"])
node = os.environ["NODE_NAME"]
steps = int(os.environ.get("STEPS", "40"))
step_time = float(os.environ.get("STEP_TIME", "0.05"))
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank, world = dist.get_rank(), dist.get_world_size()
(out / f"ran_{node}_{restart}").write_text(f"{rank} {world} {os.getpid()}")
progress = out / "progress"
start = int(progress.read_text()) if progress.exists() else 0
start_t = torch.tensor([start])
dist.broadcast(start_t, src=0)
for step in range(int(start_t.item()), steps):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == world
    if rank == 0:
        tmp = out / "progress.tmp"
        tmp.write_text(str(step + 1))
        tmp.replace(progress)
        if step + 1 == int(os.environ.get("MARK_AT_STEP", "-1")):
            (out / "marked").write_text(str(step + 1))
    time.sleep(step_time)
(out / f"done_{node}").write_text(f"{rank} {world}")
dist.destroy_process_group()
