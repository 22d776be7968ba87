"""Progress for long work: a tqdm bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """Counts ``unit``s towards ``total``; shows rate and ETA. Use as a context manager."""

    def __init__(
        self,
        total: int,
        *,
        desc: str,
        unit: str = "img",
        logger: logging.Logger | None = None,
        interval: float = 10.0,
        enabled: bool = True,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.logger = logger or logging.getLogger("facepipe")
        self.interval = interval
        self.enabled = enabled
        self.count = 0
        self.start = time.perf_counter()
        self._last_log = self.start
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, smoothing=0.1)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if self.enabled and now - self._last_log >= self.interval:
            self._last_log = now
            rate = self.count / max(now - self.start, 1e-9)
            eta = (self.total - self.count) / rate if rate > 0 else float("inf")
            pct = 100.0 * self.count / max(self.total, 1)
            self.logger.info(
                "%s: %d/%d %s (%.1f%%), %.1f %s/s, ETA %s",
                self.desc, self.count, self.total, self.unit, pct, rate, self.unit, _duration(eta),
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
