"""``python -m lightning_ft.settings``: every settings table of the docs, from the declarations."""

from __future__ import annotations

import importlib

from lightning_ft.settings.fields import markdown_table

#: docs page -> the settings classes it documents
TABLES = {
    "docs/strategy.md": ["lightning_ft.runtime.settings:StrategySettings"],
    "docs/torchrun.md": ["lightning_ft.rendezvous.settings:TorchrunConfig"],
    "docs/snapshots.md": ["lightning_ft.checkpoint.settings:SnapshotSettings"],
    "docs/sigterm.md": ["lightning_ft.termination.settings:TerminationSettings",
                        "lightning_ft.health.settings:HealthSettings"],
}


def main() -> None:
    for page, kinds in TABLES.items():
        for kind in kinds:
            module, _, name = kind.partition(":")
            print(f"<!-- {page}: {name} -->\n{markdown_table(getattr(importlib.import_module(module), name))}\n")


if __name__ == "__main__":
    main()
