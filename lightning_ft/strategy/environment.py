"""Lightning ``ClusterEnvironment``\\ s of the ``ddp_ft`` strategy: the rank comes from the round."""

from __future__ import annotations

from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment

from lightning_ft.settings.environment import local_process_index


class RoundEnvironment(ClusterEnvironment):
    """Rank and world size come from the current rendezvous round; Lightning's setters are no-ops."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self._address = address
        self._rank = 0
        self._world_size = 1

    @property
    def creates_processes_externally(self) -> bool:
        return True  # one process per participant, started by srun/JobSet/...: never Lightning's popen

    @property
    def main_address(self) -> str:
        return self._address

    @property
    def main_port(self) -> int:
        return 0  # the group rendezvous through the store, not MASTER_ADDR/MASTER_PORT

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return local_process_index()  # which of this node's devices (Trainer(devices=N)) it trains on

    def node_rank(self) -> int:
        return max(self._rank, 0)

    def assign(self, rank: int, world_size: int) -> None:
        self._rank, self._world_size = rank, world_size


class ElasticEnvironment(TorchElasticEnvironment):
    """torchrun's environment without the ``devices * num_nodes == WORLD_SIZE`` check: with
    hot spares the active world size is torchrun's to decide, not the Trainer arguments'."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        pass
