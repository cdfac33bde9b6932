"""A progress line on stderr: a bar redrawn in place on a terminal, plain lines elsewhere
(logs, CI), so a run is readable in both."""

from __future__ import annotations

import sys
import time


class Progress:
    """``stream=None``: silent (the processes of a run other than process 0)."""

    def __init__(self, total: int | None, *, every: int, stream=sys.stderr):
        self.total, self.every, self.stream = total, every, stream
        self.tty = stream is not None and stream.isatty()
        self.start = time.perf_counter()
        self.last: tuple | None = None

    def update(self, step: int, fields: dict[str, str], *, force: bool = False) -> None:
        if self.stream is None:
            return
        if not (self.tty or force or step % self.every == 0) or self.last == (step, fields):
            return
        self.last = (step, dict(fields))
        text = "  ".join(f"{k} {v}" for k, v in fields.items())
        if self.total:
            done = min(step / self.total, 1.0)
            bar = "=" * int(28 * done) + ">" + " " * (28 - int(28 * done))
            head = f"[{bar[:29]}] {step}/{self.total}"
        else:
            head = f"step {step}"
        line = f"{head}  {text}  {time.perf_counter() - self.start:.0f}s"
        if self.tty:
            self.stream.write("\r" + line.ljust(110)[:160])
            if force:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
