"""The same user code as ``lightning_user.py``, run through ``LightningCLI`` with a YAML config.

    python lightning_user_cli.py fit --config user_cli.yaml --trainer.strategy=ddp_ft \
        --trainer.default_root_dir ROOT --trainer.logger.init_args.save_dir ROOT

Test knobs come from ``LU_*`` variables (``LU_OUT`` results dir, ``LU_STEP_SLEEP``,
``LU_VAL_SLEEP``, ``LU_SAVE_SLEEP``, ``LU_SETUP_SLEEP``, ``LU_SLEEP_FROM_STEP``,
``LU_SLEEP_UNTIL_STEP``); results go to ``$LU_OUT/result-<pid>.json`` as in script mode.
Lightning's default ``SaveConfigCallback`` is kept (it writes ``config.yaml`` into the log dir).
The script does not import lightning_ft: the installed package's startup hook registers
``ddp_ft`` when Lightning loads, as for any user's unchanged CLI script.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from lightning_user import UserDataModule, UserModel, knobs, progress, write_result


def main() -> int:
    try:
        cli = LightningCLI(UserModel, UserDataModule)
    except SystemExit as exc:
        if exc.code not in (0, None):
            (knobs().out / f"exit-{os.getpid()}").write_text(str(exc.code))
        raise
    progress(cli.trainer, "fit_end")
    write_result(cli.trainer, cli.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
