"""Progress lines: rates for every counter, a plain log line when not a TTY; the terminal and
RUN/logs/<command>.log (third-party INFO lines in the file only)."""

import io
import logging
import os
import socket
from pathlib import Path

import pytest

from codex.core.progress import Progress


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


def test_the_bar_and_shared_code_log_under_the_running_commands_name(caplog, monkeypatch):
    from codex.core import progress

    monkeypatch.delenv("CODEX_COMMAND", raising=False)
    assert progress.command_log().name == "codex"  # no command named: a program calling a stage
    assert progress.set_command("sample") == ""
    try:
        assert progress.command_log().name == "codex.sample"
        with caplog.at_level(logging.INFO, logger="codex"):
            with Progress("sample", unit="tokens", stream=io.StringIO(), log_every=0) as p:
                p.update(1)
        assert {r.name for r in caplog.records} == {"codex.sample"}
    finally:
        assert progress.set_command("") == "sample"
    assert progress.command_log().name == "codex"


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


@pytest.fixture
def terminal(monkeypatch):
    """The terminal handler setup_logging installs, on a StringIO, with the root logger at INFO
    (as the codex CLI runs); removed afterwards with the log file."""
    from codex.core import progress

    monkeypatch.delenv("CODEX_DEBUG", raising=False)
    root = logging.getLogger()
    stream = _Terminal()
    handler = progress.terminal_handler(stream)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        progress.close_log_file()


def test_library_info_lines_go_to_the_log_file_not_the_terminal(terminal, tmp_path):
    """rustbpe, fsspec, gcsfs, lm-eval, ...: INFO in RUN/logs/<command>.log only; their warnings
    on the terminal too (gcsfs's handled errors never); codex's INFO lines in both."""
    from codex.core import progress

    path = progress.log_to_file(str(tmp_path / "run"), "codex data tokenize")
    assert path == str(tmp_path / "run" / "logs" / "tokenize.log")
    logging.getLogger("rustbpe").info("merges 10 percent done")
    # lines wait until the command makes RUN: one refused before that leaves no folder behind
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    logging.getLogger("fsspec.caching").info("readahead cache enabled")
    logging.getLogger("lm_eval.evaluator").info("building contexts")
    logging.getLogger("rustbpe").warning("a rustbpe warning")
    logging.getLogger("gcsfs").error("retrying a 501")
    logging.getLogger("codex.tokenize").info("tokenizer: 512 tokens")
    shown = terminal.getvalue()
    written = Path(path).read_text()
    for line in ("merges 10 percent done", "readahead cache enabled", "building contexts"):
        assert line in written and line not in shown
    assert "a rustbpe warning" in shown and "a rustbpe warning" in written
    assert "retrying a 501" in written and "retrying a 501" not in shown
    assert "INFO codex.tokenize: tokenizer: 512 tokens" in shown
    assert "INFO codex.tokenize: tokenizer: 512 tokens" in written
    # one header line per invocation: appended, never overwritten
    progress.log_to_file(str(tmp_path / "run"), "codex data tokenize")
    headers = [x for x in Path(path).read_text().splitlines() if x.startswith("=== ")]
    assert len(headers) == 2 and f"pid={os.getpid()}" in headers[0]
    assert "codex data tokenize" in headers[0] and socket.gethostname() in headers[0]


def test_codex_debug_shows_library_lines_on_the_terminal(terminal, monkeypatch):
    monkeypatch.setenv("CODEX_DEBUG", "1")
    logging.getLogger("rustbpe").info("merges 10 percent done")
    assert "merges 10 percent done" in terminal.getvalue()


def test_libraries_with_their_own_stderr_handler_are_routed_through_codex(terminal, tmp_path):
    """transformers, datasets, huggingface_hub print on a stderr handler of their own (and
    transformers does not propagate): after adoption their INFO goes to the file only."""
    from codex.core import progress

    own = logging.getLogger("transformers")
    saved = own.handlers[:], own.propagate, own.level
    stray = io.StringIO()
    own.handlers[:] = [logging.StreamHandler(stray)]
    own.propagate, own.level = False, logging.WARNING
    try:
        (tmp_path / "run").mkdir()
        path = progress.log_to_file(str(tmp_path / "run"), "codex eval")
        logging.getLogger("transformers.modeling_utils").info("loading weights")
        logging.getLogger("transformers.modeling_utils").warning("a transformers warning")
    finally:
        own.handlers[:], own.propagate, own.level = saved
    assert stray.getvalue() == ""
    assert "loading weights" in Path(path).read_text()
    assert "loading weights" not in terminal.getvalue()
    assert terminal.getvalue().count("a transformers warning") == 1


def test_the_bar_goes_to_the_log_file_as_lines(terminal, tmp_path):
    """On a terminal the bar is drawn, not logged; the log file still gets its line."""
    from codex.core import progress

    (tmp_path / "run").mkdir()
    path = progress.log_to_file(str(tmp_path / "run"), "codex data shard")
    with Progress("shard", total=4, unit="files", stream=terminal, log_every=3600) as p:
        p.update(1)
        p.update(3)
    written = Path(path).read_text()
    assert "shard:  25.0% 1/4 files" in written and "shard: 100.0% 4/4 files" in written
    assert "INFO codex: shard" not in terminal.getvalue()  # the bar only, no log line


def test_a_remote_run_has_no_log_file(terminal):
    from codex.core import progress

    assert progress.log_to_file("gs://bucket/run", "codex train") is None
    assert progress.log_file() is None


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
    from codex.core.progress import BarAwareHandler

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


FRESH_BOOT = """
import time
_pc, _mono = time.perf_counter, time.monotonic
_pc0, _mono0 = _pc(), _mono()
time.perf_counter = lambda: _pc() - _pc0 + 5.0
time.monotonic = lambda: _mono() - _mono0 + 5.0
"""


@pytest.mark.slow
def test_the_timer_tests_pass_on_a_machine_booted_5_s_ago(tmp_path):
    """The progress and metrics tests, in a Python whose perf_counter and monotonic read as on a
    machine booted 5 s ago (a sitecustomize), as on a fresh CI machine."""
    import os
    import subprocess
    import sys

    from tests.fixtures.import_graph import ROOT

    (tmp_path / "sitecustomize.py").write_text(FRESH_BOOT)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    probe = [sys.executable, "-c", "import time; print(time.perf_counter() < 60)"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() == "True"
    tests = [
        "tests/core/test_progress.py",
        "tests/train/test_metrics.py",
        "-k",
        "not booted_5_s_ago",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:]
