"""What tests read of processes they started, from /proc."""

from __future__ import annotations

from pathlib import Path


def is_alive(pid: int) -> bool:
    """Whether pid runs (a zombie its parent has yet to reap does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
