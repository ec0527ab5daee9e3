"""Processes of a `torchrun` launch, found through /proc (Linux), for tests that kill one rank."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def rank_pid(agent: int, rank: int) -> int | None:
    """The pid of rank `rank` among the workers `torchrun` process `agent` started (by their `RANK`)."""
    for pid in children(agent):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent does not)."""
    try:
        os.kill(pid, 0)
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"
