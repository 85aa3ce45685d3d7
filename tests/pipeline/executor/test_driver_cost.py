"""The clean driver's cost per unit stays flat from 1,000 to 100,000 units (issue 48).

The driver's real code runs (input listing, planning, the bookkeeping of finished units, the
marker reads of a rerun, the sweep and stats.json) on an in-memory object store that counts every
request, as gcsfs would make them. Only the units' work is replaced: a unit task's part and marker
(a real marker's keys) appear under their names, written straight into the store (a task's
requests are not the driver's). Each run is measured in a forked child: its CPU time, requests,
listings, entries listed, and its resident memory's growth to the peak. The corpus-wide dedup is
off here: its driver and reduce side are tests/pipeline/clean/test_dedup.py's.

Run with -s for the per-unit numbers and the driver's CPU time and memory at 125,000 units
(1 TB at the default chunk_bytes), extrapolated from the 100,000-unit run.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import io
import json
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable

import fsspec
import pytest
from fsspec.spec import AbstractFileSystem

from codex.core.config import build_config
from codex.pipeline.clean import clean as C
from codex.pipeline.clean import pack, plan
from codex.pipeline.clean.unit import UnitJob, remove_unit_outputs

PROTOCOL = "drivercost"
CHUNK = 8_000_000  # data.clean.chunk_bytes's default: one input file a unit
UNITS_PER_TB = 125_000
LISTING = ("ls", "find", "glob")


class CountingFS(AbstractFileSystem):
    """A flat in-memory object store (like GCS: no real folders, a listing names what is under a
    prefix) that counts requests by kind and the entries its listings return. An input file is
    its size only: the driver never opens one. fsspec makes an instance per thread (the driver's
    metadata threads get their own, as with gcsfs): they share one store, the class's."""

    protocol = PROTOCOL
    root_marker = ""
    data: dict[str, bytes | int] = {}
    children: dict[str, set[str]] = collections.defaultdict(set)
    calls: collections.Counter = collections.Counter()
    lock = threading.Lock()
    read_s = 0.0  # how long a read takes (a round trip to an object store)
    reading = 0  # reads in flight now
    most_reading = 0  # ... and at most so far

    @classmethod
    def reset(cls) -> None:
        cls.data.clear()
        cls.children.clear()
        cls.calls.clear()
        cls.read_s, cls.reading, cls.most_reading = 0.0, 0, 0

    def _count(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.calls[kind] += n

    # -- bookkeeping

    @classmethod
    def add(cls, path: str, value: bytes | int) -> None:
        """Put an object in the store without counting a request."""
        cls.data[path] = value
        child = path
        while "/" in child:
            parent = child.rsplit("/", 1)[0]
            if child in cls.children[parent]:
                break
            cls.children[parent].add(child)
            child = parent

    def _info(self, path: str) -> dict:
        if path in self.data:
            v = self.data[path]
            return {"name": path, "size": v if isinstance(v, int) else len(v), "type": "file"}
        if self.children.get(path):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    # -- the requests

    def info(self, path, **kwargs):
        self._count("info")
        return self._info(self._strip_protocol(path))

    def exists(self, path, **kwargs):
        self._count("info")
        p = self._strip_protocol(path)
        return p in self.data or bool(self.children.get(p))

    def isdir(self, path):
        self._count("info")
        return bool(self.children.get(self._strip_protocol(path)))

    def ls(self, path, detail=True, **kwargs):
        self._count("ls")
        p = self._strip_protocol(path)
        names = sorted(self.children.get(p, ())) or ([p] if p in self.data else [])
        if not names and p not in self.children:
            raise FileNotFoundError(p)
        self._count("listed", len(names))
        return [self._info(n) for n in names] if detail else names

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        self._count("find")
        todo, found = [self._strip_protocol(path)], {}
        while todo:
            for child in self.children.get(todo.pop(), ()):
                if child in self.data:
                    found[child] = self._info(child)
                else:
                    todo.append(child)
        self._count("listed", len(found))
        names = sorted(found)
        return {n: found[n] for n in names} if detail else names

    def rm(self, path, recursive=False, **kwargs):
        self._count("rm")
        p = self._strip_protocol(path)
        self.data.pop(p, None)
        self.children[p.rsplit("/", 1)[0]].discard(p)

    def _open(self, path, mode="rb", **kwargs):
        self._count("open")
        p = self._strip_protocol(path)
        if "r" in mode:
            if self.read_s:
                with self.lock:
                    CountingFS.reading += 1
                    CountingFS.most_reading = max(self.most_reading, self.reading)
                time.sleep(self.read_s)
                with self.lock:
                    CountingFS.reading -= 1
            v = self.data.get(p)
            if not isinstance(v, bytes):
                raise FileNotFoundError(p)
            return io.BytesIO(v)
        return _Upload(self, p)


class _Upload(io.BytesIO):
    """An object upload: it appears, whole, when closed (discard(): never)."""

    def __init__(self, fs: CountingFS, path: str):
        super().__init__()
        self.fs, self.path, self.discarded = fs, path, False

    def discard(self) -> None:
        self.discarded = True

    def close(self) -> None:
        if not self.closed and not self.discarded:
            self.fs.add(self.path, self.getvalue())
        super().close()


PART = b"PAR1" + bytes(2000) + b"PAR1"  # a part's bytes: the driver never reads them
# a unit's marker, with every key of a real one
MARKER = {
    "unit": "@NAME@",
    "fingerprint": "@FINGERPRINT@",
    "pieces": [["@PATH@", 0, -1]],
    "shards": ["part-@NAME@-000.parquet"],
    "part_bytes": 1_000_000,  # 8 MB of input, a third kept, zstd
    "failed": [],
    "bad_files": [],
    "per_file": {"@PATH@": [2000, CHUNK, 600, CHUNK // 3]},
    "per_source": {
        "@SOURCE@": {
            "docs_in": 2000,
            "bytes_in": CHUNK,
            "docs_kept": 600,
            "bytes_kept": CHUNK // 3,
            "drops": {
                "gopher_quality:short_doc": [900, CHUNK // 2],
                "fineweb:line_punct_ratio": [500, 9],
            },
        }
    },
    "worker": "host:1",
    "started": 0.0,
    "finished": 1.0,
    "docs_in": 2000,
    "bytes_in": CHUNK,
    "docs_kept": 600,
    "bytes_kept": CHUNK // 3,
    "drops": {"gopher_quality:short_doc": 900, "fineweb:line_punct_ratio": 500},
    "drop_bytes": {"gopher_quality:short_doc": CHUNK // 2, "fineweb:line_punct_ratio": 9},
    "drop_kinds": {
        "gopher_quality:short_doc": {"text": CHUNK // 2},
        "fineweb:line_punct_ratio": {"text": 9},
    },
}


def done_unit(job: UnitJob) -> dict:
    """A unit task whose work was done before: its part and marker appear under their names
    (written into the store directly: a task's requests are not the driver's), and it returns
    the marker, as a real unit does."""
    fs = CountingFS
    name = job.unit.name
    out = job.out.split("://", 1)[1]
    text = MARKER_JSON.replace("@NAME@", name).replace("@FINGERPRINT@", job.fingerprint)
    text = text.replace("@PATH@", job.unit.pieces[0].path)
    text = text.replace("@SOURCE@", job.unit.pieces[0].file.source)
    fs.add(f"{out}/part-{name}-000.parquet", PART)
    fs.add(f"{out}/markers/{name}.json", text.encode())
    return json.loads(text)


MARKER_JSON = json.dumps(MARKER, indent=2, sort_keys=True) + "\n"


def done_pack(job: pack.PackJob) -> str:
    """A packing task whose work was done before: its part appears under its name."""
    CountingFS.add(f"{job.out.split('://', 1)[1]}/{job.name}", PART)
    return job.name


M_ARENA_MAX = -8  # glibc's mallopt parameter


def _status(key: str) -> int:
    """A memory figure of this process from /proc (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+) kB", f.read())[1]) * 1024


def _measure(run: Callable[[], dict]) -> dict:
    """run() (a run_clean): its requests by kind, CPU seconds, and the growth of this process's
    resident memory to its peak (the kernel's high-water mark, reset first)."""
    libc = ctypes.CDLL(None)
    # one malloc arena for every thread: the driver's reader threads would otherwise each touch
    # an arena of their own, megabytes that do not grow with the units and swamp the 1k run
    libc.mallopt(M_ARENA_MAX, 1)
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident memory now
    base = _status("VmRSS")
    CountingFS.calls.clear()
    t0 = time.process_time()
    stats = run()
    cpu = time.process_time() - t0
    calls = dict(CountingFS.calls)
    return {
        "units": stats["units"],
        "units_run": stats["units_run"],
        "parts": len(stats["shards"]),
        "listings": sum(calls.get(k, 0) for k in LISTING),
        "listed": calls.get("listed", 0),
        "requests": sum(v for k, v in calls.items() if k != "listed"),
        "cpu_s": cpu,
        "peak_bytes": _status("VmHWM") - base,
    }


def _in_child(files: int, phase: str) -> dict:
    """_run_in_child(files, phase) in a fresh interpreter (multiprocessing's spawn), its result
    back. Fresh, not forked: a forked child reuses the free memory the test process's earlier
    tests left in Python's allocator, which hides a small run's growth."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_run_in_child, (files, phase))


def _run_in_child(files: int, phase: str) -> dict:
    """In the measuring child: the store, the stand-ins for the tasks, a warm-up run (imports and
    caches), then the measured run_clean of `files` inputs, fresh or a rerun of finished units."""
    fsspec.register_implementation(PROTOCOL, CountingFS, clobber=True)
    C.clean_unit = done_unit
    pack.pack_group = done_pack
    where_for = C.where_for
    # and no log file a unit: the process that runs a unit writes it (a Ray worker), here this
    # one (workers=1)
    C.where_for = lambda *a, **k: dataclasses.replace(where_for(*a, **k), logs="")
    _store(100)
    C.run_clean(_cfg_for("warm"))
    CountingFS.reset()
    _store(files)
    if phase == "rerun":  # every unit done, as its task left it
        c = _cfg_for(phase).data.clean
        inputs, _, filters = plan.inputs_and_filters(c)
        out, fingerprint = f"{PROTOCOL}://{phase}/clean", plan.plan_fingerprint(c, inputs)
        for unit in plan.plan_units(inputs, c):
            done_unit(UnitJob(unit, c, out, filters, fingerprint))
    return _measure(lambda: C.run_clean(_cfg_for(phase)))


def _store(files: int) -> None:
    for i in range(files):
        CountingFS.add(f"in/doc-{i:07d}.jsonl", CHUNK)


def _cfg_for(run: str):
    overrides = ["data.clean.workers=1", "data.clean.dedup.enabled=false"]
    cfg = build_config(overrides=overrides, run=f"{PROTOCOL}://{run}")
    cfg.data.clean.inputs = [f"{PROTOCOL}://in"]
    return cfg


@pytest.fixture
def counting_fs():
    fsspec.register_implementation(PROTOCOL, CountingFS, clobber=True)
    CountingFS.reset()
    yield fsspec.filesystem(PROTOCOL)
    CountingFS.reset()


def _cost(files: int) -> dict[str, dict]:
    """The driver's cost per unit, over `files` inputs of one unit each: a fresh run (every unit
    to do), and a rerun after every unit finished (every marker read)."""
    got = {phase: _in_child(files, phase) for phase in ("fresh", "rerun")}
    c = _cfg_for("any").data.clean
    units = got["fresh"]["units"]
    assert got["fresh"]["units_run"] == units >= files and got["rerun"]["units"] == units
    assert got["rerun"]["units_run"] == 0
    # about 135 units a part (100 units are less than one part: a part each)
    packs = len(pack.pack_groups([MARKER] * units, c.part_bytes))
    assert got["fresh"]["parts"] == got["rerun"]["parts"] == packs
    assert packs < units or units * MARKER["part_bytes"] < c.part_bytes
    return {
        phase: {"units": units, **{k: v / units for k, v in g.items() if k != "units"}}
        for phase, g in got.items()
    }


@pytest.mark.heavy  # a minute of CPU on 2 cores
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's /proc only")
def test_the_clean_drivers_cost_per_unit_is_flat_from_1k_to_100k_units():
    sizes = (1_000, 10_000, 100_000)
    got = {n: _cost(n) for n in sizes}
    for phase in ("fresh", "rerun"):
        print(f"\nclean driver, {phase} run, per unit:")
        for n in sizes:
            g = got[n][phase]
            print(
                f"  {g['units']:>7} units: {g['listings']:.5f} listings, {g['listed']:.3f} "
                f"entries listed, {g['requests']:.2f} requests, {1e6 * g['cpu_s']:.0f} us CPU, "
                f"{g['peak_bytes'] / 1e3:.2f} KB peak memory"
            )
        big = got[sizes[-1]][phase]
        print(
            f"  at {UNITS_PER_TB:,} units (1 TB), extrapolated: "
            f"{big['cpu_s'] * UNITS_PER_TB:.0f} s of driver CPU, "
            f"{big['peak_bytes'] * UNITS_PER_TB / 1e6:.0f} MB peak memory, "
            f"{big['requests'] * UNITS_PER_TB:,.0f} requests"
        )
        small = got[sizes[0]][phase]
        for n in sizes[1:]:
            g = got[n][phase]
            for key in ("listings", "listed", "requests", "cpu_s", "peak_bytes"):
                assert g[key] <= 1.5 * small[key], (phase, n, key, g[key], small[key])
        # no unit lists a folder: a run's listings are a handful, whatever its size
        assert big["listings"] * big["units"] <= 20, (phase, big)
        # a unit costs the driver a few requests: its marker (read on a rerun), and the
        # deletion of its part once packed (two: gcsfs asks first whether it exists)
        assert big["requests"] <= 4, (phase, big)


def test_removing_a_units_old_outputs_lists_nothing(counting_fs):
    """A unit's retry deletes its earlier attempt's files by exact name: no listing, and the same
    requests beside 10 other units' files as beside 2,000 (the old code listed clean/, rejected/
    and hashes/ 12 times a unit: quadratic in the units)."""
    costs = []
    for others in (10, 2_000):
        CountingFS.reset()
        out = f"{PROTOCOL}://run{others}/clean"
        for i in range(others):
            for path in (f"part-{i:06d}-000.parquet", f"rejected/part-{i:06d}-000.parquet"):
                CountingFS.add(f"run{others}/clean/{path}", PART)
            CountingFS.add(f"run{others}/clean/hashes/{i:06d}.npy", PART)
            CountingFS.add(f"run{others}/clean/markers/{i:06d}.json", b"{}")
        CountingFS.add(f"run{others}/clean/part-000003-001.parquet", PART)
        CountingFS.add(f"run{others}/clean/rejected/part-000003-000-dedup.parquet", PART)
        CountingFS.calls.clear()
        remove_unit_outputs(out, "000003")
        costs.append(dict(CountingFS.calls))
        left = {p.rsplit("/", 1)[-1] for p in CountingFS.data if "000003" in p}
        assert not left, left
        assert sum(1 for p in CountingFS.data if "part-" in p) == 2 * (others - 1)
    assert costs[0] == costs[1] and not any(k in costs[0] for k in LISTING), costs


def test_a_reruns_marker_reads_overlap(counting_fs, monkeypatch):
    """On a rerun the driver reads every unit's marker: side by side (an object store answers each
    after tens of ms; 125,000 in a row would take an hour), not one after another."""
    monkeypatch.setattr(pack, "pack_group", done_pack)
    inputs = [f"in/doc-{i:07d}.jsonl" for i in range(200)]
    for path in inputs:
        CountingFS.add(path, CHUNK)
    cfg = build_config(overrides=["data.clean.workers=1", "data.clean.dedup.enabled=false"])
    cfg.run = f"{PROTOCOL}://run"
    cfg.data.clean.inputs = [f"{PROTOCOL}://in"]
    c = cfg.data.clean
    files, _, filters = plan.inputs_and_filters(c)
    for unit in plan.plan_units(files, c):
        done_unit(
            UnitJob(unit, c, f"{PROTOCOL}://run/clean", filters, plan.plan_fingerprint(c, files))
        )
    CountingFS.read_s = 0.005
    stats = C.run_clean(cfg)
    assert stats["units_run"] == 0 and stats["units"] >= 200
    assert CountingFS.most_reading >= 16, CountingFS.most_reading
