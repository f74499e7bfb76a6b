"""The progress line: step, loss, samples/s and ETA (tqdm), or nothing when disabled."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total_steps: int, batch_size: int, enabled: bool, initial: int = 0) -> None:
        self.batch_size = batch_size
        self._bar = (
            tqdm(
                total=total_steps,
                initial=initial,
                unit="step",
                dynamic_ncols=True,
                # Off a terminal (CI logs, files) a line every few seconds is enough.
                mininterval=0.2 if sys.stderr.isatty() else 10.0,
                file=sys.stderr,
            )
            if enabled
            else None
        )

    def update(self, steps: int, loss: float, samples_per_s: float, extra: str = "") -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(
            f"loss {loss:.4f}, {samples_per_s:,.0f} samples/s{extra}", refresh=False
        )
        self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
