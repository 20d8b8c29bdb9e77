"""The names Lightning knows the strategies by (shared by the registration and the strategy classes)."""

STRATEGY_NAME = "ddp_ft"
STRATEGY_DESCRIPTION = "DDP over a barrier rendezvous with hot spares and in-process recovery."
FSDP_STRATEGY_NAME = "fsdp_ft"
FSDP_STRATEGY_DESCRIPTION = ("FSDP2 (as ModelParallelStrategy) over a barrier rendezvous: stable ranks, "
                             "sharded snapshots, the SIGTERM path.")
