"""``lightning-ft health``: run the node-health probes, print the report, exit non-zero when unhealthy.

Exit status: 0 healthy, 82 (``ExitCode.UNHEALTHY_NODE``) unhealthy, 2 bad arguments. The
82 lets a Kubernetes init container or a SLURM prolog that runs this command share the
scheduler rule for "unhealthy node" with the training processes.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_ft.exit_codes import ExitCode
from lightning_ft.health.check import NodeHealthCheck
from lightning_ft.health.probes import default_probes
from lightning_ft.health.settings import DEFAULT_MIN_AVAILABLE_MEMORY_MB, DEFAULT_MIN_FREE_DISK_MB, HealthSettings
from lightning_ft.settings import Timeouts, describe, load

_ENV = {info.name: info.env for info in describe(HealthSettings) + describe(Timeouts)}
ENV_TIMEOUT = _ENV["health_timeout"]
ENV_HOST_ROOT, ENV_MARKERS, ENV_COMMAND = _ENV["host_root"], _ENV["markers"], _ENV["command"]
ENV_DISK_PATHS, ENV_MIN_FREE_DISK_MB = _ENV["disk_paths"], _ENV["min_free_disk_mb"]
ENV_MIN_AVAILABLE_MEMORY_MB, ENV_REQUIRE_CUDA = _ENV["min_available_memory_mb"], _ENV["require_cuda"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ft health",
        description="Run the node-health probes and print the report. Flags override the "
                    "LIGHTNING_FT_* environment variables named in each help text.",
    )
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"deadline for all probes in seconds ({ENV_TIMEOUT}, default 5)")
    parser.add_argument("--host-root", default=None,
                        help=f"where the host's / is visible, for /run/nologin ({ENV_HOST_ROOT}, default /)")
    parser.add_argument("--marker", action="append", default=None, metavar="PATH",
                        help=f"marker file: exists = unhealthy, content = reason; repeatable ({ENV_MARKERS})")
    parser.add_argument("--command", default=None,
                        help=f"external check, exit 0 = healthy, killed at the deadline ({ENV_COMMAND})")
    parser.add_argument("--disk-path", action="append", default=None, metavar="PATH",
                        help=f"filesystem to check for free space; repeatable ({ENV_DISK_PATHS}, default the temp dir)")
    parser.add_argument("--min-free-disk-mb", type=float, default=None,
                        help=f"minimum free disk in MiB, 0 disables ({ENV_MIN_FREE_DISK_MB}, "
                             f"default {DEFAULT_MIN_FREE_DISK_MB:g})")
    parser.add_argument("--min-available-memory-mb", type=float, default=None,
                        help=f"minimum available memory in MiB, 0 disables ({ENV_MIN_AVAILABLE_MEMORY_MB}, "
                             f"default {DEFAULT_MIN_AVAILABLE_MEMORY_MB:g})")
    parser.add_argument("--no-accelerator", action="store_true", help="skip the CUDA device query")
    parser.add_argument("--require-cuda", action="store_true",
                        help=f"a node without a usable CUDA device is unhealthy ({ENV_REQUIRE_CUDA}=1)")
    parser.add_argument("--overrun-healthy", action="store_true",
                        help="a probe that does not answer by the deadline is reported but not counted")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    for flag, value in (("--timeout", args.timeout), ("--min-free-disk-mb", args.min_free_disk_mb),
                        ("--min-available-memory-mb", args.min_available_memory_mb)):
        if value is not None and value < 0:
            print(f"lightning-ft health: {flag} must be >= 0, got {value}", file=sys.stderr)
            return 2
    try:
        probes = default_probes(
            host_root=args.host_root, markers=args.marker, command=args.command,
            disk_paths=args.disk_path, min_free_disk_mb=args.min_free_disk_mb,
            min_available_memory_mb=args.min_available_memory_mb, accelerator=not args.no_accelerator,
            require_cuda=True if args.require_cuda else None,
        )
        timeout = args.timeout or load(Timeouts, {}).health_timeout
        check = NodeHealthCheck(probes, timeout_s=timeout, overrun_is_unhealthy=not args.overrun_healthy,
                                stop_at_first_unhealthy=False)
    except ValueError as exc:
        print(f"lightning-ft health: {exc}", file=sys.stderr)
        return 2

    report = check.run()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        width = max((len(r.name) for r in report.results), default=0)
        for result in report.results:
            status = {True: "ok", False: "FAIL", None: "-"}[result.healthy]
            print(f"{status:<4}  {result.name:<{width}}  {result.duration_s * 1000:8.1f} ms  {result.reason}")
        print(f"node: {report.summary()}")
    return 0 if report.healthy else int(ExitCode.UNHEALTHY_NODE)


if __name__ == "__main__":
    sys.exit(main())
