"""A progress bar in configurations/second: tqdm when installed, else a plain line printer."""

from __future__ import annotations

import sys
import time


class _Plain:
    """Prints ``done/total configurations (rate/s)`` at most every ``interval`` seconds."""

    def __init__(self, total: int, desc: str, interval: float = 2.0, stream=None):
        self.total, self.desc, self.interval = total, desc, interval
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._print(now)

    def _print(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        print(
            f"{self.desc}: {self.done}/{self.total} configurations ({rate:.1f} configurations/s)",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        self._print(time.perf_counter())


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool = True, desc: str = "sweep"):
    """An object with ``update(n)`` and ``close()``."""
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Plain(total, desc)
    return tqdm(total=total, desc=desc, unit="config", unit_scale=False, dynamic_ncols=True, file=sys.stderr)
