"""GracefulTermination in-process: construction, who owns SIGTERM during fit, nothing left after fit."""

from __future__ import annotations

import signal
import threading

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_ft import GracefulTermination  # noqa: E402
from lightning_ft.health import MarkerFileProbe  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)


class HandlerSpy(pl.Callback):
    def __init__(self) -> None:
        self.during_fit = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.during_fit = signal.getsignal(signal.SIGTERM)


def test_defaults_and_bad_configuration_messages(tmp_path):
    callback = GracefulTermination()
    assert callback.margin_steps == 1 and callback.grace_seconds > 0
    assert [p.name for p in callback.health_check.probes][:2] == ["shutdown-marker", "accelerator"]
    custom = GracefulTermination(probes=[MarkerFileProbe(tmp_path / "m")], health_timeout=2,
                                 grace_seconds=20, margin_steps=2, signals=[signal.SIGTERM, signal.SIGUSR1])
    assert custom.health_check.timeout_s == 2 and custom.grace_seconds == 20

    bad = [
        ({"margin_steps": 0}, "margin_steps"),
        ({"margin_steps": 1.5}, "margin_steps"),
        ({"grace_seconds": 0}, "grace_seconds"),
        ({"health_timeout": -1}, "health_timeout"),
        ({"signals": [signal.SIGKILL]}, "signals"),
        ({"signals": []}, "signals"),
        ({"signals": ["TERM"]}, "signals"),
        ({"store": "localhost:29500"}, "store"),
        ({"probes": "marker"}, "probes"),
        ({"probes": [object()]}, "probes"),
        ({"save_safety_factor": 0.9}, "save_safety_factor"),
        ({"exit_reserve_seconds": -1}, "exit_reserve_seconds"),
        ({"exit_reserve_seconds": 40}, "exit_reserve_seconds"),
        ({"margin_steps": 0}, "margin_steps"),
        ({"margin_step": 1}, "margin_step.*did you mean 'margin_steps'"),
        ({"exit_timeout": 5}, "unknown setting.*exit_timeout"),  # an internal bound, not a setting
    ]
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=f"GracefulTermination: .*{name}"):
            GracefulTermination(**kwargs)


def test_owns_sigterm_during_fit_and_leaves_nothing_behind():
    def pre_fit_handler(signum, frame):  # pragma: no cover - never called
        pass

    previous = signal.signal(signal.SIGTERM, pre_fit_handler)
    try:
        # threads of earlier tests in this worker (a bounded call that overran its bound ends on
        # its own later) are not this fit's
        before = set(threading.enumerate())
        spy, callback = HandlerSpy(), GracefulTermination(probes=[])
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, callbacks=[spy, callback])
        trainer.fit(Tiny())
        # during training our recording handler, not Lightning's collective-calling one, owned SIGTERM
        assert type(getattr(spy.during_fit, "__self__", None)).__name__ == "SignalListener"
        # after fit: the pre-fit handler, our wakeup fd gone, our watcher thread gone
        assert signal.getsignal(signal.SIGTERM) is pre_fit_handler
        assert signal.set_wakeup_fd(-1) == -1
        assert not [t for t in threading.enumerate() if t.name.startswith("lightning-ft") and t not in before]
    finally:
        signal.signal(signal.SIGTERM, previous)
