"""CPU share of each specdec service under load: how many cores the coordinator, draft and
target processes of a running stack each keep busy during a `specdec soak` against it.

    specdec up &                                   # or any stack on this machine
    python scripts/service_cpu.py --address 127.0.0.1:50051 --clients 8 --seconds 90

Prints, per service, CPU seconds (user + system, its threads included) over the soak's
measured part divided by its wall time, then the soak's own report line. Used for README
"Architecture": at 8 clients the draft kept 0.29 of a core busy drafting one session a step
(SPECDEC_DRAFT_MAX_BATCH=1) and 0.21 with its steps batched; the target 1.42 and 1.50.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


def service_processes() -> dict[str, psutil.Process]:
    """The `specdec serve SERVICE` processes on this machine, by service."""
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "specdec.cli" in command and "serve" in command:
            found[command[command.index("serve") + 1]] = process
    return found


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: sum(process.cpu_times()[:2]) for name, process in processes.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the stack's coordinator")
    parser.add_argument("--clients", type=int, default=8, help="concurrent soak clients")
    parser.add_argument("--seconds", type=float, default=90.0, help="length of the soak")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="load before CPU time is counted")
    args = parser.parse_args()
    processes = service_processes()
    if not processes:
        raise SystemExit("no `specdec serve` process runs on this machine: start a stack (specdec up) first")
    soak = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "soak", "--address", args.address, "--clients", str(args.clients),
         "--minutes", str(args.seconds / 60), "--warmup-s", str(args.warmup_s), "--no-progress", "--json"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(args.warmup_s + 2)
    before, started = cpu_seconds(processes), time.monotonic()
    out, _ = soak.communicate()
    after, wall = cpu_seconds(processes), time.monotonic() - started
    for name in sorted(before):
        print(f"{name:12s} {(after[name] - before[name]) / wall:5.2f} cores busy")
    report = json.loads(out)
    print(f"over {wall:.0f} s; soak: {report['requests']} requests, {report['errors']} errors, "
          f"{report['tokens_per_s']:.1f} tokens/s")  # fmt: skip
    return soak.returncode


if __name__ == "__main__":
    sys.exit(main())
