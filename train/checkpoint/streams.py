"""A rank's checkpoint share written as several files at once, one thread (and on gs:// one
upload) each: DCP's FileSystemWriter with its thread count set from the share's bytes, and a
failed stream raised in the caller's thread.

    writer = StreamsWriter(folder, sync_files=...)   # dcp.py: _writer swaps in its file system
"""

from __future__ import annotations

import contextlib
import queue
from threading import Thread

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _item_size, _write_files_from_queue
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.futures import Future

# A rank writes its share as up to STREAMS files at once, one thread each (on gs:// each file its
# own upload): one stream is bound by one connection's rate or one writer's serialisation, which
# leaves a large checkpoint far short of a host's bandwidth (bench/bench_checkpoint_streams.py,
# docs/checkpoints.md "Streams"). A stream per STREAM_BYTES at least: a small share stays one file.
STREAMS = 16
STREAM_BYTES = 256 << 20


def streams_for(nbytes: int, items: int) -> int:
    """The files (and threads) a rank writes `items` tensors of `nbytes` in all with."""
    return max(1, min(STREAMS, nbytes // STREAM_BYTES, items))


class StreamsWriter(FileSystemWriter):
    """DCP's FileSystemWriter writing a rank's share as streams_for(its bytes) files at once. A
    stream that fails fails this rank's write_data, so DCP fails the save on every rank and no
    .metadata is written: DCP's own threads would die silently and leave an index without their
    tensors."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list]:
        nbytes = sum(_tensor_bytes(item) for item in plan.items)
        self.thread_count = streams_for(nbytes, len(plan.items))
        return super().write_data(plan, planner)

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list]:
        results: queue.Queue = queue.Queue()
        failed: list[BaseException] = []

        def stream() -> None:
            try:
                _write_files_from_queue(
                    self.fs.create_stream,
                    file_queue,
                    results,
                    planner,
                    self.transforms,
                    self.per_thread_copy_ahead,
                    self.sync_files,
                    self.thread_count,
                    self.serialization_format,
                )
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(e)
                with contextlib.suppress(queue.Empty):  # the other streams stop after their file
                    while True:
                        file_queue.get_nowait()

        threads = [Thread(target=stream, daemon=True) for _ in range(1, self.thread_count)]
        for t in threads:
            t.start()
        stream()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        done: list = []
        while not results.empty():
            done += results.get_nowait()
        future: Future[list] = Future()
        future.set_result(done)
        return future


def _tensor_bytes(item: WriteItem) -> int:
    return _item_size(item) if item.tensor_data is not None else 0
