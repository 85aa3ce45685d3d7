"""Progress for long stages: a one-line bar with rates on a terminal, plain log lines otherwise.

    with Progress("clean", total=n_files, unit="files") as p:
        p.update(1, docs=120, bytes=1_000_000)   # extra counters get their own rate

On a TTY the line is redrawn at most 5 times a second; when stderr is not a TTY (CI, a log file,
a TPU VM under nohup) one plain line is logged every `log_every` seconds and one at the end.

Logging: setup_logging() puts one handler on the terminal (codex's lines at INFO, other
libraries' at WARNING and above); log_to_file(RUN, command) adds RUN/logs/<command>.log, which gets
every line at INFO, the libraries' (rustbpe, fsspec, gcsfs, wandb, lm-eval, datasets,
transformers, ...) included, and the bar's line every `log_every` seconds. Code every command
shares (the backend, the bar) logs under the running command's name: command_log().
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import time

log = logging.getLogger("codex")


_bar: Progress | None = None  # the bar drawn on the terminal now, if any

# The command this process runs ("eval" for `codex eval`), in the environment so that the
# processes it starts (torch_xla's spawn, a data stage's pool) log under it too.
_COMMAND_ENV = "CODEX_COMMAND"


def set_command(name: str) -> str:
    """Name the command this process runs (the CLI does, for each command: `codex data clean` ->
    "clean"); "" = none. Returns the name it replaces, for putting it back."""
    old = os.environ.get(_COMMAND_ENV, "")
    if name:
        os.environ[_COMMAND_ENV] = name
    else:
        os.environ.pop(_COMMAND_ENV, None)
    return old


def command_log() -> logging.Logger:
    """The logger of the command this process runs, codex.<name> (codex.train, codex.eval,
    codex.sample, codex.clean, ...), for code every command shares: the lines of `codex sample`
    say codex.sample, never codex.train. "codex" when no command was named (a program calling a
    stage's function itself)."""
    name = os.environ.get(_COMMAND_ENV, "")
    return logging.getLogger(f"codex.{name}" if name else "codex")


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


# --- where log lines go: the terminal and RUN/logs/<command>.log --------------------------------
#
# The terminal shows codex's own lines (loggers "codex.*") at INFO and other libraries' at WARNING
# and above; RUN/logs/<command>.log gets every line at INFO, the libraries' included. The split is
# made by a filter on the terminal handler, never by a library logger's level (a level would hide
# its lines from the file too). CODEX_DEBUG=1 shows everything on the terminal as well.

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FILE_LOG_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"

# The lowest level at which another library's line reaches the terminal; WARNING for any not named.
# gcsfs logs the errors it handles itself (a 501 it retries, a copy fallback) with their tracebacks,
# on runs that then succeed; an error it does not handle reaches codex as an exception and is
# reported as one line. fsspec's read-ahead logs a failed read with its traceback, then raises it
# to the reader: the same. Ray's driver warnings (resources, deprecations) are not the user's
# concern (pipeline/executor/ray_cluster.py ran Ray's logger at ERROR before it went to the file).
TERMINAL_LEVELS = {
    "gcsfs": logging.CRITICAL,
    "fsspec.prefetcher": logging.CRITICAL,
    "ray": logging.ERROR,
}

# Libraries that print on a stderr handler of their own (and transformers and ray do not pass
# their lines on to the root logger): adopt_library_loggers() takes those handlers off, so their
# lines go through codex's handlers like any other library's. With the environment variable that
# sets a library's level, its level is left as the user set it; else it is lowered (never raised)
# to the root's, so INFO reaches the log file.
_OWN_HANDLERS = {
    "transformers": "TRANSFORMERS_VERBOSITY",
    "datasets": "DATASETS_VERBOSITY",
    "huggingface_hub": "HF_HUB_VERBOSITY",
    "evaluate": "EVALUATE_VERBOSITY",
    "lm_eval": "LMEVAL_LOG_LEVEL",  # only when lm-eval's own setup_logging ran
    "ray": "",
}
# Libraries whose logger never propagates (wandb: its lines go to its run's debug.log): the log file
# handler is added to them directly.
_NO_PROPAGATE = ("wandb",)

_terminal: logging.Handler | None = None  # the terminal handler setup_logging installed
_file: _LogFile | None = None  # the RUN/logs/<command>.log handler, if any
_LOG_FILE_ENV = "CODEX_LOG_FILE"  # "<pid>:<path>": the log file, for processes that pid starts


def _is_codex(name: str) -> bool:
    return name == "codex" or name.startswith("codex.")


def _terminal_level(name: str) -> int:
    while name:
        if name in TERMINAL_LEVELS:
            return TERMINAL_LEVELS[name]
        name = name.rpartition(".")[0]
    return logging.WARNING


def to_terminal(record: logging.LogRecord) -> bool:
    """The terminal handler's filter: codex's lines at any level, another library's at WARNING and
    above (TERMINAL_LEVELS), everything with CODEX_DEBUG=1; never a line marked file-only
    (extra={"file_only": True}: a progress bar's line, which the terminal shows as the bar)."""
    if getattr(record, "file_only", False):
        return False
    if os.environ.get("CODEX_DEBUG") or _is_codex(record.name):
        return True
    return record.levelno >= _terminal_level(record.name)


def terminal_handler(stream=None) -> logging.Handler:
    """The handler setup_logging puts on the root logger: `stream` (stderr) with the bar kept
    apart, codex's format and the to_terminal filter."""
    handler = BarAwareHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
    handler.addFilter(to_terminal)
    return handler


def setup_logging(level: int = logging.INFO) -> None:
    """The terminal handler on the root logger (unless the root has handlers already: a host
    program's, or pytest's), at `level`. In a process started by one that logs to a file (a TPU
    spawn worker), that file too."""
    global _terminal
    root = logging.getLogger()
    if not root.handlers:
        _terminal = terminal_handler()
        root.addHandler(_terminal)
        root.setLevel(level)
    inherited = os.environ.get(_LOG_FILE_ENV, "")
    pid, _, path = inherited.partition(":")
    if _file is None and path and pid == str(os.getppid()) and os.path.isdir(os.path.dirname(path)):
        _attach_file(path, os.path.dirname(os.path.dirname(path)))  # RUN/logs/NAME.log
    adopt_library_loggers()


def log_to_file(run: str, command: str) -> str | None:
    """Log every line at INFO, other libraries' included, to RUN/logs/<name>.log as well, where
    <name> is the command's last word (`codex data clean` -> clean.log); the terminal is
    unchanged. The file is appended to, each invocation starting with a header line (its command
    line, time, host, pid). Returns the path, or None for a remote RUN: objects on gs:// cannot be
    appended to, so there is no log file there (one debug line says so). One file at a time: a
    second call moves the log to its own file."""
    if "://" in str(run) and not str(run).startswith("file://"):
        log.debug("no log file for %s: a remote run directory cannot be appended to", run)
        close_log_file()
        return None
    run = str(run).removeprefix("file://")
    name = command.split()[-1] if command.split() else "codex"
    path = os.path.abspath(os.path.join(run, "logs", f"{name}.log"))
    if _file is None or _file.baseFilename != path:
        _attach_file(path, os.path.abspath(run))
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    argv = [prog if prog not in ("", "__main__.py") else "codex", *sys.argv[1:]]
    header = "=== {} {} host={} pid={}: {}\n".format(
        time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        command,
        socket.gethostname(),
        os.getpid(),
        shlex.join(argv),
    )
    assert _file is not None
    _file.acquire()
    try:
        _file.write_line(header)
    finally:
        _file.release()
    # processes this one starts (torch_xla's spawn) log to the same file
    os.environ[_LOG_FILE_ENV] = f"{os.getpid()}:{path}"
    return path


def log_file() -> str | None:
    """The log file this process writes, if any."""
    return _file.baseFilename if _file is not None else None


def close_log_file() -> None:
    """Stop logging to the file (log_to_file's), if any."""
    global _file
    if _file is None:
        return
    for name in ("", *_NO_PROPAGATE):
        logging.getLogger(name).removeHandler(_file)
    _file.close()
    _file = None
    if os.environ.get(_LOG_FILE_ENV, "").startswith(f"{os.getpid()}:"):
        del os.environ[_LOG_FILE_ENV]


class _LogFile(logging.FileHandler):
    """RUN/logs/<command>.log. Lines wait in memory until RUN exists: a command refused before it
    writes anything (a bad option, a second writer) leaves no folder behind, only its terminal
    line. A write that fails (a full disk) stops the file with one warning, instead of logging's
    traceback on the terminal for every line after it."""

    broken = False
    MAX_PENDING = 10_000

    def __init__(self, path: str, run: str):
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.run = run
        self.pending: list[str] = []

    def write_line(self, text: str) -> None:
        """A line that is not a record (the invocation's header)."""
        self.pending.append(text)
        self._flush_pending()

    def _flush_pending(self) -> bool:
        """Open the file once RUN exists and write what waited; False while RUN does not exist."""
        if self.stream is None:
            if not os.path.isdir(self.run):
                return False
            try:
                os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
                self.stream = self._open()
            except OSError:
                self.handleError(logging.makeLogRecord({}))
                return False
        if self.pending:
            try:
                self.stream.write("".join(self.pending))
                self.flush()
            except OSError:
                self.handleError(logging.makeLogRecord({}))
            self.pending.clear()
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if self.broken:
            return
        if not self._flush_pending():
            if len(self.pending) < self.MAX_PENDING:
                self.pending.append(self.format(record) + self.terminator)
            return
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.broken:
            self.broken = True
            log.warning("log file %s: no more lines (%s)", self.baseFilename, sys.exc_info()[1])


def _attach_file(path: str, run: str) -> None:
    global _file
    close_log_file()
    handler = _LogFile(path, run)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FILE_LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    _file = handler
    adopt_library_loggers()


def adopt_library_loggers() -> None:
    """Route the libraries that print on their own stderr handler (transformers, datasets,
    huggingface_hub, evaluate, ray) through codex's handlers, and add the log file to those
    whose lines never reach the root logger (wandb). A library configures its logger when it is
    imported, so this runs again after such an import (eval/tasks.py, train/metrics.py,
    pipeline/executor/ray_cluster.py): it does nothing twice. Nothing happens unless codex
    installed a handler (a program that imports codex keeps its own logging)."""
    if _terminal is None and _file is None:
        return
    for name, env in _OWN_HANDLERS.items():
        logger = logging.Logger.manager.loggerDict.get(name)
        if not isinstance(logger, logging.Logger):
            continue  # not imported yet
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        logger.propagate = True
        if not (env and os.environ.get(env)) and logger.level > logging.INFO:
            logger.setLevel(logging.NOTSET)
    if _file is not None:
        for name in _NO_PROPAGATE:
            logger = logging.Logger.manager.loggerDict.get(name)
            if isinstance(logger, logging.Logger) and _file not in logger.handlers:
                logger.addHandler(_file)


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
        # when the bar was last drawn, and (on a TTY) when the log file last got its line; None =
        # never, so the first update does both. Not 0.0: perf_counter's zero is the machine's boot,
        # and a machine up for less than log_every seconds would never file the first line.
        self._last: float | None = None
        self._filed: float | None = None
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
        if self._last is None or now - self._last >= (0.2 if self.tty else self.log_every):
            self._last = now
            self._emit(final=False)
        if (
            self.tty
            and _file is not None
            and (self._filed is None or now - self._filed >= self.log_every)
        ):
            self._filed = now
            self._to_file()

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
            if final:
                self._to_file()
            return
        state = (self.n, tuple(self.counters.items()))
        if final and state == self._logged:
            return  # the last line already said this (e.g. 100% logged by the final update)
        self._logged = state
        command_log().info(self.line())

    def _to_file(self) -> None:
        """On a TTY, the bar's line for the log file only (the terminal has the bar)."""
        if self.enabled and _file is not None:
            command_log().info(self.line(), extra={"file_only": True})

    def close(self) -> None:
        global _bar
        self._emit(final=True)
        self.enabled = False
        if _bar is self:
            _bar = None
