"""Following a remote run (a Vertex AI pipeline run or custom job, a Kubeflow run) until it ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection


def wait_for_state(
    read: Callable[[], str], final: Collection[str], on_change: Callable[[str], None], poll_s: float,
    transient: tuple[type[BaseException], ...] = (), retries: int = 8,
) -> str:
    """Poll `read()` until it gives a final state, calling `on_change` with each new one; returns the last.

    Errors of the `transient` types are retried, `retries` in a row at most, with exponential backoff.
    """
    last, failures = None, 0
    while True:
        try:
            state = read()
        except transient:
            failures += 1
            if failures > retries:
                raise
            time.sleep(poll_s * 2 ** min(failures, 5))
            continue
        failures = 0
        if state != last:
            on_change(state)
            last = state
        if state in final:
            return state
        time.sleep(poll_s)
