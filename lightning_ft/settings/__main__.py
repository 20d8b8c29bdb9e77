"""``python -m lightning_ft.settings``: every settings table of the docs, from the declarations.

Public settings go to each component's page; advanced ones to ``docs/advanced-settings.md``, with
the internal constants (bounds that are not settings) listed after them.
"""

from __future__ import annotations

import importlib

from lightning_ft.settings.fields import internal_constants, markdown_table

#: docs page -> the settings classes whose public settings it documents
TABLES = {
    "docs/strategy.md": ["lightning_ft.runtime.settings:StrategySettings"],
    "docs/torchrun.md": ["lightning_ft.rendezvous.settings:TorchrunConfig"],
    "docs/snapshots.md": ["lightning_ft.checkpoint.settings:SnapshotSettings"],
    "docs/sigterm.md": ["lightning_ft.termination.settings:TerminationSettings",
                        "lightning_ft.health.settings:HealthSettings"],
}
#: the page of the advanced settings of all of them
ADVANCED_PAGE = "docs/advanced-settings.md"
#: the classes whose internal constants the advanced page lists
INTERNAL = ["lightning_ft.settings.timeouts:Timeouts", "lightning_ft.runtime.settings:HangSettings"]


def _kind(path: str) -> type:
    module, _, name = path.partition(":")
    kind: type = getattr(importlib.import_module(module), name)
    return kind


def main() -> None:
    for page, kinds in TABLES.items():
        for path in kinds:
            print(f"<!-- {page}: {path.partition(':')[2]} -->\n{markdown_table(_kind(path), tier='public')}\n")
    for kinds in TABLES.values():
        for path in kinds:
            table = markdown_table(_kind(path), tier="advanced")
            if table.count("\n") > 1:
                print(f"<!-- {ADVANCED_PAGE}: {path.partition(':')[2]} -->\n{table}\n")
    rows = ["| constant | value | what it bounds |", "|---|---|---|"]
    rows += [f"| `{info.name}` | `{info.default!r}` | {info.doc} |" for path in INTERNAL
             for info in internal_constants(_kind(path))]
    print(f"<!-- {ADVANCED_PAGE}: internal constants -->\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
