"""What every stage gets: the validated spec, the placement, the event sink and the signal flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .events import Artifact, EventSink
from .placement import Placement
from .spec import JobSpec

if TYPE_CHECKING:
    from ..device import DeviceChoice


class Stopped(Exception):
    """Raised by a stage after it committed a checkpoint on SIGTERM."""

    def __init__(self, committed_step: int):
        super().__init__(f"stopped after committing step {committed_step}")
        self.committed_step = committed_step


@dataclass
class StageContext:
    """One job's state while its stages run; the signal handlers set the two flags."""

    spec: JobSpec
    placement: Placement
    emit: EventSink
    # recipe section -> where it runs, decided once by `Placement.devices` before any stage
    devices: Mapping[str, DeviceChoice] = field(default_factory=dict)
    stop_requested: bool = False
    checkpoint_requested: bool = False

    @property
    def job_dir(self) -> Path:
        return self.spec.job_dir

    def _name(self, path: Path) -> str:
        return path.resolve().relative_to(self.job_dir).as_posix()

    def report(self, path: Path, *, kind: str, step: int = 0) -> None:
        """Hash a finished file under the job directory and emit it as an artifact."""
        self.emit(Artifact.for_file(path, artifact=self._name(path), kind=kind, step=step))

    def report_all(self, path: Path, *, kind: str, step: int = 0) -> None:
        """`report` each file under a directory, in name order."""
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            self.report(f, kind=kind, step=step)

    def forward(self, artifact: Artifact) -> None:
        """Emit an artifact a library call described, named relative to the job directory."""
        self.emit(dataclasses.replace(artifact, artifact=self._name(Path(artifact.path))))
