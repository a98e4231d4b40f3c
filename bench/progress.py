"""A one-line progress bar on stderr, shown only on a terminal (and by rank 0 alone)."""

import sys
import time


class Progress:
    def __init__(self, total, label, enabled=True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.monotonic()

    def step(self, what=""):
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{what:<12} {elapsed:5.1f}s eta {eta:5.1f}s")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
