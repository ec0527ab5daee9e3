"""The worker side of the run-manager contract: the job spec it reads (`spec`), how it applies the
provider's device policy (`placement`), the events it writes (`events`) and the stages it runs (`stages`).

Importing this package does not import torch: the run-manager's tests and the coordinator use these
modules without the training stack (the stages import it when they run).
"""

from .events import Artifact, Done, Error, Event, EventSink, JsonLinesSink, Log, Progress, Stopped, event_from_json
from .placement import Placement
from .spec import JobSpec

__all__ = [
    "Artifact", "Done", "Error", "Event", "EventSink", "JobSpec", "JsonLinesSink", "Log", "Placement", "Progress", "Stopped",
    "event_from_json",
]  # fmt: skip
