"""The worker side of the run-manager contract: the job spec it reads, the events it writes.

Nothing here imports torch: the run-manager's tests and the coordinator use these
modules without the training stack.
"""

from .events import Artifact, Done, Error, Event, EventSink, JsonLinesSink, Log, Progress, Stopped, event_from_json

__all__ = ["Artifact", "Done", "Error", "Event", "EventSink", "JsonLinesSink", "Log", "Progress", "Stopped", "event_from_json"]
