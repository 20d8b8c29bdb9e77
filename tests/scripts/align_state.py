"""One gloo rank of tests/test_stage_state.py: ``align_module_state`` over a real process group.

``python align_state.py RANK WORLD PORT TRAINED_THROUGH OUT``: rank 0 hosts the TCPStore on
127.0.0.1:PORT; each rank starts from other weights (seeded by its rank, BatchNorm running mean
shifted by it), aligns, and writes ``{"received": ..., "state": [...]}`` (what
``align_module_state`` returned, every parameter and buffer after it) as JSON to OUT.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_ft.runtime.stage_state import align_module_state


def main() -> int:
    rank, world, port, trained_through = (int(arg) for arg in sys.argv[1:5])
    out = Path(sys.argv[5])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(rank)  # each rank starts from other weights
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    module[1].running_mean += rank
    received = align_module_state(module, trained_through, torch.device("cpu"))
    state = [t.detach().clone().tolist() for t in [*module.parameters(), *module.buffers()]]
    out.write_text(json.dumps({"received": list(received) if received is not None else None, "state": state}))
    dist.barrier()  # the store's host (rank 0) leaves last
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
