"""An object store that fails under codex (codex/core/store.py, codex/core/gcs.py, fsio's uploads),
on a real GCS emulator killed and started again on its port, on a port where nothing listens, on one
that accepts a connection and never answers, and on one that opens an upload and stops reading
its body."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import urllib.request

import pytest

from codex.core import fsio, store
from tests.fixtures.clean import make_corpus
from tests.fixtures.outage import clean_through_outages, codex, one_error_line
from tests.fixtures.procs import free_port

pytestmark = pytest.mark.gcs


def test_which_store_errors_are_retried():
    lost, gone = store.UploadLost("gs://b/x: lost"), store.StoreUnreachable("gs://b: gone")
    gone.__cause__ = ConnectionRefusedError()  # raised from a transient error: still final
    assert fsio.is_transient(lost) and not fsio.is_transient(gone)
    assert fsio.is_store_failure(gone) and not fsio.is_store_failure(FileNotFoundError("x"))
    target = store.Target.of("http://h:1/upload/storage/v1/b/bk/o?uploadType=resumable&name=a%2Fb")
    assert (target.bucket, target.name, target.session) == ("bk", "a/b", False)
    assert store.Target.of("http://h:1/storage/v1/b/bk/o/a%2Fb").name == "a/b"
    assert store.Target.of("http://h:1/u/b/bk/o?name=a&upload_id=7").session


def test_a_lost_upload_session_is_an_io_failure_naming_the_object(own_gcs_emulator):
    """The store forgets an upload's session (as a restart can): the next chunk's 404 is
    UploadLost, retried, naming the object; not a FileNotFoundError whose message is a URL."""
    bucket = own_gcs_emulator.new_bucket()
    fs, p = fsio.filesystem(f"gs://{bucket}/dir/big.bin")
    f = fs.open(p, "wb", block_size=1 << 18)  # gcsfs's smallest block: 256 KiB
    f.write(os.urandom(300 << 10))  # past one block: the session is open, its first chunk sent
    assert f.location
    # the emulator forgets every session and object, keeping the buckets
    urllib.request.urlopen(f"{own_gcs_emulator.url}/wipe?keep-buckets=1").read()
    with pytest.raises(store.UploadLost) as e:
        f.write(os.urandom(300 << 10))  # a block more: its chunk goes to the lost session
    f.closed = True  # abandoned, as fsio.put_object leaves a failed upload
    assert fsio.is_transient(e.value)
    assert str(e.value).startswith(f"gs://{bucket}/dir/big.bin: ")
    assert "upload_id" not in str(e.value)


def upload_through(emulator, fault: str) -> None:
    """fsio.write_bytes of 40 MiB (8 chunks of one session) while the store, once the session
    holds bytes, is restarted or loses its sessions: the object ends whole."""
    bucket = emulator.new_bucket()
    data = os.urandom(40 << 20)
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            fsio.write_bytes(f"gs://{bucket}/big.bin", data)
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    writer = threading.Thread(target=upload)
    writer.start()
    getattr(emulator, fault)(writer)
    writer.join(60)
    assert not failed, failed
    assert fsio.read_bytes(f"gs://{bucket}/big.bin") == data


@pytest.mark.slow
def test_an_upload_goes_on_through_a_restart_of_its_store(own_gcs_emulator):
    upload_through(own_gcs_emulator, "restart_mid_upload")


@pytest.mark.slow
def test_an_upload_whose_session_the_store_loses_starts_over(own_gcs_emulator, caplog):
    upload_through(own_gcs_emulator, "lose_sessions_mid_upload")
    assert "UploadLost" in caplog.text  # fsio.put_object started it over


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers (a hung store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


@pytest.mark.parametrize("how", ["refused", "silent"])
def test_a_store_that_stays_down_is_named_within_the_bound(how, silent_port, monkeypatch):
    port = free_port() if how == "refused" else silent_port
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with store.configured(1.0, 4), pytest.raises(store.StoreUnreachable) as e:
        fsio.write_bytes("gs://gone-bucket/r/x.json", b"{}")
    took = time.monotonic() - started
    assert took < 3.0, took
    assert str(e.value).startswith("gs://gone-bucket did not answer for 1 s (store_timeout_s)")
    assert "r/x.json" in str(e.value) and "rerun" in str(e.value)


@pytest.fixture
def stalling_port():
    """A store that opens a resumable upload, then takes a request's headers and never reads its
    body nor answers (its receive buffers fill; the client's write waits)."""
    ready: list[int] = []

    async def handle(reader, writer) -> None:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            if not (head.startswith("POST") and "uploadType=resumable" in head.split("\r\n")[0]):
                await asyncio.sleep(3600)
            session = f"http://127.0.0.1:{ready[0]}/upload/storage/v1/b/stall/o?upload_id=1"
            writer.write(
                f"HTTP/1.1 200 OK\r\nLocation: {session}\r\nContent-Length: 0\r\n\r\n".encode()
            )
            await writer.drain()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    ready.append(server.sockets[0].getsockname()[1])
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield ready[0]

    def stop() -> None:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.call_soon(loop.stop)

    loop.call_soon_threadsafe(stop)


@pytest.mark.slow
def test_an_upload_whose_body_the_store_stops_reading_is_named_within_the_bound(
    stalling_port, monkeypatch
):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{stalling_port}")
    started = time.monotonic()
    with store.configured(1.0, 4), pytest.raises(store.StoreUnreachable) as e:
        fsio.write_bytes("gs://stall/r/big.bin", os.urandom(30_000_000))  # past any socket buffer
    took = time.monotonic() - started
    assert took < 5.0, took
    assert str(e.value).startswith("gs://stall did not answer for 1 s (store_timeout_s)"), e.value


# --- the CLI: `codex data clean` onto a store that goes away -------------------------------------


@pytest.mark.slow
def test_a_clean_whose_store_restarts_mid_upload_ends_as_the_local_run(tmp_path, own_gcs_emulator):
    ends = clean_through_outages(tmp_path, own_gcs_emulator, [1, 3, 6, 9, 12])
    print("\n".join(ends))


@pytest.mark.slow
def test_a_clean_whose_store_is_down_past_the_bound_ends_in_one_line_and_a_rerun_resumes(
    tmp_path, own_gcs_emulator
):
    """store_timeout_s=1 and 4 s down: exit 1 with one line naming the bucket; the rerun, with
    the store back, ends byte-identical to the local run."""
    ends = clean_through_outages(tmp_path, own_gcs_emulator, [4], down_s=4, bound_s=1)
    assert "exit 1" in ends[0] and "did not answer for 1 s (store_timeout_s)" in ends[0], ends
    print("\n".join(ends))


@pytest.mark.slow
def test_a_clean_onto_a_store_that_stays_down_is_named_within_the_bound(tmp_path, monkeypatch):
    make_corpus(tmp_path / "in", 2, 5)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    res = codex(
        "data",
        "clean",
        "--run",
        "gs://gone-bucket/r",
        "--input",
        str(tmp_path / "in"),
        "--set",
        "store_timeout_s=2",
    )
    took = time.monotonic() - started
    line = one_error_line(res)
    assert line.startswith("Error: gs://gone-bucket did not answer for 2 s (store_timeout_s)")
    assert took < 15, took
