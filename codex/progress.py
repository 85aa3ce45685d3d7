"""Progress for long stages: a one-line bar with rates on a terminal, plain log lines otherwise.

    with Progress("clean", total=n_files, unit="files") as p:
        p.update(1, docs=120, bytes=1_000_000)   # extra counters get their own rate

On a TTY the line is redrawn at most 5 times a second; when stderr is not a TTY (CI, a log file,
a TPU VM under nohup) one plain line is logged every `log_every` seconds and one at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("codex")


_bar: Progress | None = None  # the bar drawn on the terminal now, if any


class BarAwareHandler(logging.StreamHandler):
    """Log lines on a terminal that holds a progress bar: the bar's line is cleared first and
    drawn again under the log line, so the two never run into each other."""

    def emit(self, record: logging.LogRecord) -> None:
        bar = _bar if _bar is not None and _bar.stream is self.stream else None
        if bar is not None:
            self.stream.write("\r\x1b[2K")
        super().emit(record)
        if bar is not None:
            self.stream.write(bar.line())
            self.stream.flush()


def setup_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger()
    if not root.handlers:
        handler = BarAwareHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(level)
    # fsspec logs every remote file it opens at INFO ("... AdaptiveReadaheadCache enabled"): about
    # 60 lines a stage on gs://, none of them news to the user.
    logging.getLogger("fsspec").setLevel(max(level, logging.WARNING))
    # rustbpe logs each tenth of its merge loop at INFO; the tokenize stage reports the result.
    logging.getLogger("rustbpe").setLevel(max(level, logging.WARNING))
    # gcsfs logs the errors it handles itself (a 501 it retries, a copy fallback) with their
    # tracebacks, on runs that then succeed; an error it does not handle reaches codex as an
    # exception and is reported as one line. CODEX_DEBUG=1 shows them.
    if not os.environ.get("CODEX_DEBUG"):
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


def _human(x: float) -> str:
    if abs(x) < 10:
        return f"{x:.2f}"
    for unit in ("", "K", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.1f}{unit}" if unit else f"{x:.0f}"
        x /= 1000
    return f"{x:.1f}P"


def _human_bytes(x: float) -> str:
    return f"{x / 1e6:.1f}MB"


class Progress:
    def __init__(
        self,
        name: str,
        total: int | None = None,
        unit: str = "it",
        log_every: float = 10.0,
        stream=None,
        enabled: bool = True,
    ):
        self.name, self.total, self.unit = name, total, unit
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every = log_every
        self.enabled = enabled
        self.n = 0
        self.counters: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._last = 0.0
        # the state of the last plain log line (no repeat at close)
        self._logged: tuple | None = None

    def __enter__(self):
        global _bar
        if self.tty and self.enabled:
            _bar = self
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1, **counters: float) -> None:
        self.n += n
        for k, v in counters.items():
            self.counters[k] = self.counters.get(k, 0) + v
        now = time.perf_counter()
        if now - self._last >= (0.2 if self.tty else self.log_every):
            self._last = now
            self._emit(final=False)

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        head = f"{self.name}: {self.n}" + (f"/{self.total}" if self.total else "") + f" {self.unit}"
        if self.total:
            head = f"{self.name}: {100 * self.n / self.total:5.1f}% " + head[len(self.name) + 2 :]
        parts = [head, f"{_human(self.n / dt)} {self.unit}/s"]
        for k, v in self.counters.items():
            if k == "bytes":
                parts.append(f"{_human_bytes(v)} ({v / dt / 1e6:.1f} MB/s)")
            else:
                parts.append(f"{_human(v)} {k} ({_human(v / dt)} {k}/s)")
        parts.append(f"{dt:.0f}s")
        if self.total and 0 < self.n < self.total:
            parts.append(f"ETA {dt * (self.total - self.n) / self.n:.0f}s")
        return " | ".join(parts)

    def _emit(self, final: bool) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
            self.stream.flush()
            return
        state = (self.n, tuple(self.counters.items()))
        if final and state == self._logged:
            return  # the last line already said this (e.g. 100% logged by the final update)
        self._logged = state
        log.info(self.line())

    def close(self) -> None:
        global _bar
        self._emit(final=True)
        self.enabled = False
        if _bar is self:
            _bar = None
