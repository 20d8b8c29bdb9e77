"""The name Lightning knows the strategy by (shared by the registration and the strategy class)."""

STRATEGY_NAME = "ddp_ft"
STRATEGY_DESCRIPTION = "DDP over a barrier rendezvous with hot spares and in-process recovery."
