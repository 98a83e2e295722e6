"""Agents talking to a server at once, for the HTTP session tests: each runs in its own thread, and the first
error any of them raised is raised in the test's."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_agents(agent: Callable[[int], None], n: int) -> None:
    """agent(0) .. agent(n - 1), concurrently; returns when all are done."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            agent(k)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
