"""What every benchmark report needs: the machine it ran on, and its section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
from pathlib import Path


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, or the platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def machine_line() -> str:
    """One sentence naming the machine and the date."""
    num_cpus = len(os.sched_getaffinity(0))
    return (f"Machine: {num_cpus} CPUs ({cpu_model()}), Python {platform.python_version()}; "
            f"run on {datetime.date.today()}.")


def write_section(path: Path, heading: str, text: str) -> None:
    """Replace the section under heading in path (or append it), leaving other sections as they are."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(old):
        new = pattern.sub(lambda _: text + "\n", old, count=1).rstrip("\n") + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
