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

import array
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

from codex.core import fsio
from codex.core.config import build_config
from codex.pipeline.clean import clean as C
from codex.pipeline.clean import pack, plan
from codex.pipeline.clean.unit import UnitJob, marker_files, remove_unit_outputs

PROTOCOL = "drivercost"
CHUNK = 8_000_000  # data.clean.chunk_bytes's default: one input file a unit
UNITS_PER_TB = 125_000
LISTING = ("ls", "find", "glob")
PAGE = 1000  # entries a listing request answers (GCS's JSON API)
BATCH = 100  # paths a batch deletion sends in one request (gcsfs, on GCS)
# a unit's virtual objects (CountingFS.done): its part, its marker
UNIT_PART = re.compile(r"(.+)/part-(\d{6,})-000\.parquet")
UNIT_MARKER = re.compile(r"(.+)/markers/(\d{6,})\.json")


def gcs_entry(path: str, size: int) -> dict:
    """An object's listing entry as gcsfs makes and caches it (its JSON metadata as parsed, each
    string its own object, and gcsfs' own keys): about 3 KB."""
    bucket, _, key = path.partition("/")
    gen = f"{1764300000000000 + len(path) * 7919 + size}"
    link = f"https://storage.googleapis.com/storage/v1/b/{bucket}/o/{key.replace('/', '%2F')}"
    return {
        "kind": f"storage#{'object'}",
        "id": f"{path}/{gen}",
        "selfLink": link,
        "mediaLink": f"{link}?generation={gen}&alt=media",
        "name": path,
        "bucket": f"{bucket}",
        "generation": gen,
        "metageneration": f"{1}",
        "contentType": f"application/{'octet-stream'}",
        "storageClass": f"{'STANDARD'}",
        "size": size,
        "md5Hash": f"{gen[-8:]}Hb0A4jIZ5xUPeWLdv0dnw==",
        "crc32c": f"{gen[-4:]}Ag==",
        "etag": f"CP{gen[-10:]}EAE=",
        "timeCreated": f"2026-11-28T{gen[-6:-4]}:00:00.000Z",
        "updated": f"2026-11-28T{gen[-6:-4]}:00:00.000Z",
        "timeStorageClassUpdated": f"2026-11-28T{gen[-6:-4]}:00:00.000Z",
        "timeFinalized": f"2026-11-28T{gen[-6:-4]}:00:00.000Z",
        "type": "file",
        "mtime": time.time() + len(gen),
        "ctime": time.time() + len(key),
    }


class CountingFS(AbstractFileSystem):
    """A flat in-memory object store that behaves as gcsfs on GCS does, counting its requests by
    kind and the entries its listings return: no real folders (a listing names what is under a
    prefix), a page of PAGE entries a listing request, every listing kept in the instance's
    listing cache (fsspec's DirCache, without expiry unless told) with gcsfs-sized entries and
    answering info from it, an open for reading two requests (metadata, then bytes), cat_file
    one, a deletion of a list of paths a request per BATCH. fsspec makes an instance per
    thread (the driver's metadata threads get their own, as with gcsfs): they share one store,
    the class's. An input file is its size only: the driver never opens one. A unit's part and
    marker are virtual (`done`: a byte a unit, 1 its part, 2 its marker; the marker's text made
    when read): a million units' objects cost the store a megabyte, not the driver's memory."""

    protocol = PROTOCOL
    root_marker = ""
    data: dict[str, bytes | int] = {}
    children: dict[str, set[str]] = collections.defaultdict(set)
    # a clean folder -> a byte a unit; its units' input files and one's index a unit
    done: dict[str, bytearray] = {}
    files: dict[str, list[str]] = {}
    file_of: dict[str, array.array] = {}
    meta: dict[str, tuple[str, str]] = {}  # a clean folder -> its units' fingerprint and source
    calls: collections.Counter = collections.Counter()
    lock = threading.Lock()
    read_s = 0.0  # how long a read takes (a round trip to an object store)
    reading = 0  # reads in flight now
    most_reading = 0  # ... and at most so far

    @classmethod
    def reset(cls) -> None:
        stores = (cls.data, cls.children, cls.done, cls.files, cls.file_of, cls.meta, cls.calls)
        for store in stores:
            store.clear()
        cls.read_s, cls.reading, cls.most_reading = 0.0, 0, 0
        cls.clear_instance_cache()

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

    @classmethod
    def add_unit(cls, out: str, index: int, path: str, what: int = 3) -> None:
        """A unit's part and marker (what: 1 | 2) appear, virtual, without a request."""
        done = cls.done.setdefault(out, bytearray())
        if len(done) <= index:
            done.extend(bytes(index + 1 - len(done)))
            of = cls.file_of.setdefault(out, array.array("I"))
            of.extend(array.array("I", bytes(4 * (index + 1 - len(of)))))
            cls.add(f"{out}/markers/.folder", 0)  # the folders exist
        files = cls.files.setdefault(out, [])
        if not files or files[-1] != path:
            files.append(path)
        cls.file_of[out][index] = len(files) - 1
        done[index] |= what

    def _unit(self, path: str) -> tuple[str, int, int] | None:
        """(clean folder, unit, 1 | 2) of a unit's virtual part or marker; None for another."""
        for what, pattern in ((1, UNIT_PART), (2, UNIT_MARKER)):
            m = pattern.fullmatch(path)
            if m and m[1] in self.done:
                return m[1], int(m[2]), what
        return None

    def _virtual(self, path: str) -> bytes | None:
        got = self._unit(path)
        if got is None:
            return None
        out, i, what = got
        if i >= len(self.done[out]) or not self.done[out][i] & what:
            return None
        if what == 1:
            return PART
        fingerprint, source = self.meta[out]
        return marker_text(f"{i:06d}", fingerprint, self.files[out][self.file_of[out][i]], source)

    def _names(self, path: str) -> list[str]:
        """The paths directly under `path` (objects, and prefixes as their path)."""
        names = set(self.children.get(path, ()))
        names.discard(f"{path}/.folder")
        if path in self.done:
            done = enumerate(self.done[path])
            names.update(f"{path}/part-{i:06d}-000.parquet" for i, d in done if d & 1)
        out = path.rsplit("/", 1)[0]
        if path.endswith("/markers") and out in self.done:
            names.update(f"{path}/{i:06d}.json" for i, d in enumerate(self.done[out]) if d & 2)
        return sorted(names)

    def _size(self, path: str) -> int | None:
        v = self.data.get(path)
        if v is None:
            v = self._virtual(path)
        if v is None:
            return None
        return v if isinstance(v, int) else len(v)

    def _entry(self, path: str) -> dict:
        size = self._size(path)
        if size is None:
            return {"name": path, "size": 0, "type": "directory"}
        return gcs_entry(path, size)

    def _cached_info(self, path: str) -> dict | None:
        """gcsfs answers info from its parent's listing, when that is cached."""
        try:
            listing = self.dircache[path.rsplit("/", 1)[0]]
        except KeyError:
            return None
        return next((e for e in listing if e["name"] == path), None)

    # -- the requests

    def info(self, path, **kwargs):
        p = self._strip_protocol(path)
        cached = self._cached_info(p)
        if cached is not None:
            return cached
        self._count("info")
        if self._size(p) is not None:
            return self._entry(p)
        if self._names(p):
            return {"name": p, "size": 0, "type": "directory"}
        raise FileNotFoundError(p)

    def exists(self, path, **kwargs):
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def isdir(self, path):
        try:
            return self.info(path)["type"] == "directory"
        except FileNotFoundError:
            return False

    def ls(self, path, detail=True, **kwargs):
        p = self._strip_protocol(path)
        listing = self.dircache.get(p)
        if listing is None:
            names = self._names(p)
            if not names and self._size(p) is None:
                self._count("ls")
                raise FileNotFoundError(p)
            listing = [self._entry(n) for n in names] or [self._entry(p)]
            self._count("ls", max(1, -(-len(listing) // PAGE)))
            self._count("listed", len(listing))
            self.dircache[p] = listing
        return listing if detail else [e["name"] for e in listing]

    def names_under(self, path):
        """codex's names-only listing (codex/core/gcs.py): a page of names a request."""
        p = self._strip_protocol(path)
        names = [n.rsplit("/", 1)[-1] for n in self._names(p)]
        self._count("ls", max(1, -(-len(names) // PAGE)))
        self._count("listed", len(names))
        return iter(names)

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        todo, found = [self._strip_protocol(path)], {}
        while todo:
            for child in self._names(todo.pop()):
                if self._size(child) is not None:
                    found[child] = self._entry(child)
                else:
                    todo.append(child)
        self._count("find", max(1, -(-len(found) // PAGE)))
        self._count("listed", len(found))
        names = sorted(found)
        folders = collections.defaultdict(list)  # gcsfs caches each folder's entries it found
        for n in names:
            folders[n.rsplit("/", 1)[0]].append(found[n])
        for folder, entries in folders.items():
            self.dircache[folder] = entries
        return {n: found[n] for n in names} if detail else names

    def _rm_one(self, p: str) -> bool:
        got = self._unit(p)
        if got is not None:
            out, i, what = got
            if i < len(self.done[out]) and self.done[out][i] & what:
                self.done[out][i] &= ~what
                return True
            return False
        if p not in self.data:
            return False
        del self.data[p]
        self.children[p.rsplit("/", 1)[0]].discard(p)
        return True

    def rm(self, path, recursive=False, **kwargs):
        paths = [path] if isinstance(path, str) else list(path)
        self._count("rm", -(-len(paths) // BATCH))
        gone = [self._rm_one(self._strip_protocol(p)) for p in paths]
        if not any(gone):
            raise FileNotFoundError(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._count("read")
        return self._read(self._strip_protocol(path))

    def _read(self, p: str) -> bytes:
        if self.read_s:
            with self.lock:
                CountingFS.reading += 1
                CountingFS.most_reading = max(self.most_reading, self.reading)
            time.sleep(self.read_s)
            with self.lock:
                CountingFS.reading -= 1
        v = self.data.get(p)
        if v is None:
            v = self._virtual(p)
        if not isinstance(v, bytes):
            raise FileNotFoundError(p)
        return v

    def _open(self, path, mode="rb", **kwargs):
        p = self._strip_protocol(path)
        if "r" in mode:
            self._count("open", 2)  # the object's metadata, then its bytes
            return io.BytesIO(self._read(p))
        self._count("open")
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


MARKER_JSON = json.dumps(MARKER, indent=2, sort_keys=True) + "\n"


def marker_text(name: str, fingerprint: str, path: str, source: str) -> bytes:
    """A unit's marker as its task writes it."""
    text = MARKER_JSON.replace("@NAME@", name).replace("@FINGERPRINT@", fingerprint)
    return text.replace("@PATH@", path).replace("@SOURCE@", source).encode()


def done_unit(job: UnitJob) -> dict:
    """A unit task whose work was done before: its part and marker appear under their names
    (virtual, CountingFS.add_unit: a task's requests are not the driver's), and it returns the
    marker, as a real unit does."""
    out = job.out.split("://", 1)[1]
    piece = job.unit.pieces[0]
    CountingFS.meta[out] = (job.fingerprint, piece.file.source)
    CountingFS.add_unit(out, job.unit.index, piece.path)
    return json.loads(marker_text(job.unit.name, job.fingerprint, piece.path, piece.file.source))


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
        "peak_rss": _status("VmHWM"),  # the driver's whole process at its peak
        # listing entries the filesystem instances keep once the run is over
        "cached": sum(
            len(v) for fs in CountingFS._cache.values() for v in fs.dircache._cache.values()
        ),
    }


def _in_child(files: int, phase: str, units_per_file: int = 1) -> dict:
    """_run_in_child(files, phase) in a fresh interpreter (multiprocessing's spawn), its result
    back. Fresh, not forked: a forked child reuses the free memory the test process's earlier
    tests left in Python's allocator, which hides a small run's growth."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_run_in_child, (files, phase, units_per_file))


def _run_in_child(files: int, phase: str, units_per_file: int = 1) -> dict:
    """In the measuring child: the store, the stand-ins for the tasks, a warm-up run (imports and
    caches), then the measured run_clean of `files` inputs of `units_per_file` units each, fresh
    or a rerun of finished units."""
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
    _store(files, units_per_file)
    if phase == "rerun":  # every unit done, as its task left it
        c = _cfg_for(phase).data.clean
        inputs, _, filters = plan.inputs_and_filters(c)
        out, fingerprint = f"{PROTOCOL}://{phase}/clean", plan.plan_fingerprint(c, inputs)
        for unit in plan.plan_units(inputs, c):
            done_unit(UnitJob(unit, c, out, filters, fingerprint))
    return _measure(lambda: C.run_clean(_cfg_for(phase)))


def _store(files: int, units_per_file: int = 1) -> None:
    for i in range(files):
        CountingFS.add(f"in/doc-{i:07d}.jsonl", CHUNK * units_per_file)


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
        # no unit lists a folder: a run lists a handful of folders, a page of PAGE entries a
        # request, whatever its size
        assert big["listings"] * big["units"] <= 20 + 6 * big["units"] / PAGE, (phase, big)
        # a unit costs the driver at most its marker's read (a rerun) and a hundredth of a
        # request to delete its part once packed (a batch deletion)
        assert big["requests"] <= 1.1, (phase, big)


def test_removing_a_units_old_outputs_lists_and_probes_nothing(counting_fs):
    """A unit done again deletes the files its earlier marker lists (marker_files, from the
    marker the driver read), by exact name: no listing, no existence check, a request a file,
    the same beside 10 other units' files as beside 2,000 (the old code listed clean/, rejected/
    and hashes/ 12 times a unit: quadratic in the units; then probed each name)."""
    costs = []
    for others in (10, 2_000):
        CountingFS.reset()
        out = f"{PROTOCOL}://run{others}/clean"
        for i in range(others):
            for path in (f"part-{i:06d}-000.parquet", f"rejected/part-{i:06d}-000.parquet"):
                CountingFS.add(f"run{others}/clean/{path}", PART)
            name = fsio.spread(out, f"{i:06d}")  # as on an object store
            CountingFS.add(f"run{others}/clean/hashes/{name}.npy", PART)
            CountingFS.add(f"run{others}/clean/markers/{name}.json", b"{}")
        CountingFS.add(f"run{others}/clean/part-000003-001.parquet", PART)
        CountingFS.add(f"run{others}/clean/rejected/part-000003-000-dedup.parquet", PART)
        marker = {
            "unit": "000003",
            "shards": ["part-000003-000.parquet", "part-000003-001.parquet"],
            "rejected": ["part-000003-000.parquet"],
        }
        CountingFS.calls.clear()
        files = marker_files(out, marker)
        remove_unit_outputs(files)
        costs.append(dict(CountingFS.calls))
        left = {p.rsplit("/", 1)[-1] for p in CountingFS.data if "000003" in p}
        assert not left, left
        assert sum(1 for p in CountingFS.data if "part-" in p) == 2 * (others - 1)
    assert costs[0] == costs[1] == {"rm": len(files)}, costs


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


@pytest.mark.heavy  # several minutes of CPU on 2 cores, each
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's /proc only")
@pytest.mark.parametrize("phase", ["fresh", "rerun"])
def test_a_million_units_cost_the_driver_under_2_gb_and_3_requests_a_unit(phase):
    """1,000,006 units (1,000 input files of 1,000 units each, 8 TB at the default chunk_bytes,
    and the tail's smaller units), fresh or rerun, on a store whose listings behave as gcsfs'
    (a page of 1,000 entries a request, every listing kept in its cache with ~3 KB entries
    unless codex turns that off): the driver's process peaks under 2 GB, makes at most 3
    requests a unit, and keeps no listing once the run is over."""
    g = _in_child(1_000, phase, 1_000)
    units = g["units"]
    print(
        f"\n{phase}: {units:,} units, {g['requests'] / units:.3f} requests a unit "
        f"({g['listings']:,} listing requests, {g['listed'] / units:.2f} entries listed a "
        f"unit), {g['cpu_s']:.0f} s of CPU, peak {g['peak_rss'] / 1e9:.2f} GB "
        f"(+{g['peak_bytes'] / 1e9:.2f} GB over the run)"
    )
    assert units >= 1_000_000 and g["units_run"] == (units if phase == "fresh" else 0)
    assert g["peak_rss"] <= 2e9, (phase, g)
    assert g["requests"] <= 3 * units, (phase, g)
    assert g["cached"] == 0, (phase, g)


def test_codex_keeps_no_listing_where_gcsfs_would_keep_every_one(counting_fs, monkeypatch):
    """The store's listing cache is gcsfs' (fsspec's DirCache: every listing kept, with its
    entries, without expiry): a clean with it on keeps a listing entry for each of its inputs
    and parts; codex's filesystems have it off (fsio.LISTING_OPTIONS) and keep none."""
    monkeypatch.setattr(pack, "pack_group", done_pack)
    monkeypatch.setattr(C, "clean_unit", done_unit)
    kept = {}
    for how, options in (("gcsfs' default", {}), ("codex", fsio.LISTING_OPTIONS)):
        CountingFS.reset()
        monkeypatch.setattr(fsio, "LISTING_OPTIONS", options)
        _store(50)
        C.run_clean(_cfg_for("run"))
        instances = list(CountingFS._cache.values())
        kept[how] = sum(len(v) for fs in instances for v in fs.dircache._cache.values())
    assert kept["gcsfs' default"] >= 50 and kept["codex"] == 0, kept
