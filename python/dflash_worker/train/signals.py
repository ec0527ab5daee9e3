"""Stop and checkpoint requests delivered as signals, acted on at the next step boundary.

SIGINT / SIGTERM: commit a checkpoint after the current optimizer step and stop (exit 0).
SIGUSR1: commit a checkpoint after the current optimizer step and continue.

Handlers only set flags (a signal can arrive mid-step, inside torch); the training loop polls
them between steps. Previous handlers are restored on exit. Outside the main thread signals
cannot be caught, so the guard does nothing there and only the flags set by `request_*` apply.
"""

from __future__ import annotations

import signal
import threading


class StopFlags:
    """Flags set by signal handlers (or directly, by a job runner) and read by the loop."""

    def __init__(self) -> None:
        self.stop_signal: str | None = None
        self.checkpoint_now = False

    def request_stop(self, name: str = "request") -> None:
        self.stop_signal = self.stop_signal or name

    def request_checkpoint(self) -> None:
        self.checkpoint_now = True

    def take_checkpoint_request(self) -> bool:
        wanted, self.checkpoint_now = self.checkpoint_now, False
        return wanted


class SignalGuard:
    """Context manager installing the handlers above on `flags`."""

    def __init__(self, flags: StopFlags) -> None:
        self.flags = flags
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlags:
        if threading.current_thread() is not threading.main_thread():
            return self.flags

        def stop(signum, _frame):
            self.flags.request_stop(signal.Signals(signum).name)

        def ckpt(_signum, _frame):
            self.flags.request_checkpoint()

        wanted = {signal.SIGINT: stop, signal.SIGTERM: stop}
        if hasattr(signal, "SIGUSR1"):
            wanted[signal.SIGUSR1] = ckpt
        for sig, fn in wanted.items():
            self._old[sig] = signal.signal(sig, fn)
        return self.flags

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
