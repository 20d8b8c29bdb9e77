"""``lightning-ft`` command line: ``store``, ``health``, ``report``, ``exit-code``, ``snapshots``."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help); each module has main(argv) -> int
_SUBCOMMANDS = {
    "store": ("lightning_ft.launch.store_server", "host a standalone rendezvous TCPStore"),
    "health": ("lightning_ft.health.cli", "run the node-health probes and print the report"),
    "report": ("lightning_ft.report.text", "print the recovery timeline of a run directory"),
    "exit-code": ("lightning_ft.termination.exit_records",
                  "run a launcher (torchrun) and exit with the code its ranks recorded"),
    "snapshots": ("lightning_ft.checkpoint.memory.cleanup", "list or remove the snapshots runs left in memory"),
}


def _usage() -> str:
    lines = ["usage: lightning-ft COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in _SUBCOMMANDS:
        print(f"lightning-ft: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
