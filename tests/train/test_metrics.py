"""train/metrics.py: metrics.jsonl on gs:// appended in bounded chunks, wandb offline holds the
metrics, a wandb failure never stops training."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from tests.fixtures.runs import make_run, one_thread, run_train  # noqa: F401  (one_thread: autouse, one torch thread)


def read_wandb_history(path: Path) -> list[dict]:
    """Decode a .wandb file (LevelDB-style log of protobuf Records) into its history rows."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, rows, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf = payload if kind in (1, 2) else buf + payload
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                        for i in rec.history.item
                    }
                )
    return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = make_run(tmp_path / "run")
    run_train(run, max_steps=3, wandb="auto")
    files = list((Path(run) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # wandb-core (a separate service process) may still be writing after finish() returns.
    deadline = time.time() + 30
    while time.time() < deadline:
        rows = [r for r in read_wandb_history(files[0]) if "train/loss" in r]
        if len(rows) == 3:
            break
        time.sleep(0.2)
    logged = [json.loads(line) for line in open(Path(run) / "metrics.jsonl")]
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert [r["train/loss"] for r in rows] == pytest.approx([rec["loss"] for rec in logged])
    assert [r["tokens"] for r in rows] == [64, 128, 192]


@pytest.mark.slow
def test_wandb_prints_nothing_on_the_terminal(tmp_path, monkeypatch, capfd, caplog):
    """wandb's own `wandb: ...` lines (~25 of them) stay off the terminal, without WANDB_SILENT:
    one codex line says where the offline run is."""
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("CODEX_DEBUG", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # tests/conftest.py sets it
    wandb.teardown()  # a wandb set up by an earlier test read WANDB_SILENT
    try:
        run = make_run(tmp_path / "run")
        with caplog.at_level("INFO", logger="codex.metrics"):
            run_train(run, max_steps=2, wandb="auto")
        wandb.teardown()  # its service process says goodbye, if at all, before we read stderr
    finally:
        monkeypatch.setenv("WANDB_SILENT", "true")
        wandb.teardown()
    err = capfd.readouterr().err
    assert not [line for line in err.splitlines() if "wandb:" in line], err
    (line,) = [r.getMessage() for r in caplog.records if r.name == "codex.metrics"]
    assert line.startswith(f"wandb offline run: {Path(run) / 'wandb'}")


@pytest.mark.slow
def test_wandb_failure_never_stops_training(tmp_path, monkeypatch):
    import wandb

    def broken_init(*a, **k):
        raise RuntimeError("wandb service unreachable")

    monkeypatch.setattr(wandb, "init", broken_init)
    run = make_run(tmp_path / "run")
    out = run_train(run, max_steps=2, wandb="online")
    assert out["step"] == 2 and len(open(Path(run) / "metrics.jsonl").readlines()) == 2


@pytest.mark.gcs
def test_metrics_on_gcs_are_appended_in_bounded_chunks(gcs_bucket, monkeypatch):
    """gs:// metrics.jsonl grows by composed chunks of at most FLUSH_LINES lines: no whole-file
    rewrite per line; a resume still cuts the lines after its checkpoint."""
    import gcsfs

    from codex.train import metrics as M

    monkeypatch.setattr(M, "FLUSH_LINES", 10)
    written, merges = [], []
    real_merge, real_write = gcsfs.GCSFileSystem.merge, M.fsio.write_text

    def merge(self, path, paths, **kw):
        merges.append(paths)
        return real_merge(self, path, paths, **kw)

    def write_text(path, text):
        written.append(text.count("\n"))
        return real_write(path, text)

    monkeypatch.setattr(gcsfs.GCSFileSystem, "merge", merge)
    monkeypatch.setattr(M.fsio, "write_text", write_text)
    run = f"{gcs_bucket}/run"
    logger = M.MetricsLogger(run)
    for step in range(1, 36):
        logger.log("train", step, step * 10, loss=1.0 / step)
    logger.close()
    assert written == [10] and len(merges) == 3  # one first chunk, then 3 appends (10, 10, 5 lines)
    steps = [
        json.loads(line)["step"]
        for line in M.fsio.read_text(M.rundir.metrics_path(run)).splitlines()
    ]
    assert steps == list(range(1, 36))
    assert not [p for p in M.fsio.listdir(run) if ".chunk-" in p]  # chunk objects are deleted
    resumed = M.MetricsLogger(run, resume_step=20)
    resumed.log("train", 21, 210, loss=0.5)
    resumed.flush()
    steps = [
        json.loads(line)["step"]
        for line in M.fsio.read_text(M.rundir.metrics_path(run)).splitlines()
    ]
    assert steps == list(range(1, 22))
