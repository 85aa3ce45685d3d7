"""Progress lines: rates for every counter, a plain log line when not a TTY."""

import io
import logging

from codex.progress import Progress


def test_line_has_counts_and_rates():
    p = Progress("shard", total=10, unit="docs", stream=io.StringIO())
    p.update(5, tokens=5000, bytes=2_000_000)
    line = p.line()
    assert line.startswith("shard:  50.0% 5/10 docs")
    assert "docs/s" in line and "tokens/s" in line and "MB/s" in line


def test_not_a_tty_logs_plain_lines(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="codex"):
        with Progress("clean", unit="files", stream=stream, log_every=0) as p:
            p.update(1)
            p.update(1)
    assert stream.getvalue() == ""  # no carriage-return bar written into a log file
    assert any("clean: 2 files" in r.getMessage() for r in caplog.records)


def test_slow_rates_are_not_rounded_to_zero():
    p = Progress("train", unit="steps", stream=io.StringIO())
    p.t0 -= 10.0
    p.update(3)
    assert "0.30 steps/s" in p.line()


def test_the_final_line_is_not_repeated(caplog):
    with caplog.at_level(logging.INFO, logger="codex"):
        with Progress("shard", total=2, unit="files", stream=io.StringIO(), log_every=0) as p:
            p.update(1)
            p.update(1)  # logs 100% here; close() must not log it again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shard:")]
    assert sum("100.0%" in line for line in lines) == 1, lines


def test_fsspec_file_open_chatter_is_silenced():
    from codex.progress import setup_logging

    setup_logging()
    assert not logging.getLogger("fsspec.caching").isEnabledFor(logging.INFO)


def test_eta_from_the_rate_so_far():
    p = Progress("clean", total=40, unit="units", stream=io.StringIO())
    p.t0 -= 10.0
    p.update(10)  # 10 units in 10 s: 30 left take 30 s
    assert p.line().endswith("| ETA 30s")
    p.update(30)
    assert "ETA" not in p.line()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_never_run_into_the_bar():
    from codex.progress import BarAwareHandler

    term = _Terminal()
    handler = BarAwareHandler(term)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("codex.test_bar")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with Progress("shard", total=10, unit="docs", stream=term) as p:
            p.update(3)
            logger.warning("a warning mid-stage")
            p.update(7)
    finally:
        logger.removeHandler(handler)
    out = term.getvalue()
    # the bar's line is cleared before the log line, which starts a line of its own
    assert "\r\x1b[2Ka warning mid-stage\n" in out
    # and the bar comes back right under it
    after = out.split("a warning mid-stage\n", 1)[1]
    assert after.startswith("shard:  30.0% 3/10 docs")
