"""The turn protocol of ``benchmarks/peers.py --interleave``, spoken by both of its
workers (recscale's, and TorchRec's in the peer venv: this file imports neither).

A worker builds its model, runs its warm-up, then prints ``{"ready": true}`` and reads
stdin a line at a time::

    N  (N > 0)   run N steps, print {"step_s": [seconds of each step]}
    0 or EOF     stop timing: print the run's final JSON object and exit

Every message is one JSON line on stdout; anything else a worker prints goes to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator


def stdin_turns() -> Iterator[int]:
    """The step counts the driver asks for, one per turn; ``ready`` is announced when
    the first is wanted (after the warm-up)."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        n = int(line)
        if n <= 0:
            return
        yield n


def report_turn(seconds: list[float]) -> None:
    print(json.dumps({"step_s": seconds}), flush=True)
