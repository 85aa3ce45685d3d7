"""`data.clean.near_dedup`: MinHash near-dedup as datatrove computes it, URL dedup, metadata
columns, on a corpus generated here (no ../shared), locally and on a two-node Ray cluster."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.core.config import ConfigError
from codex.core.config.data import NearDedupConfig
from codex.pipeline.clean import minhash as M
from codex.pipeline.clean.clean import run_clean
from tests.fixtures import ROOT
from tests.fixtures.clean import cfg_for

_spec = importlib.util.spec_from_file_location(
    "bench_datatrove_parity",
    Path(__file__).resolve().parents[3] / "bench" / "bench_datatrove_parity.py",
)
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)

# the filters stay out of the way: only length, exact dedup and the near-dedup drop documents
ONLY_DEDUP = ("data.clean.preset=code", "data.clean.code.enabled=false")
NEAR = (*ONLY_DEDUP, "data.clean.near_dedup.enabled=true")


def generated_corpus(originals: int = 600, every: int = 5, seed: int = 7):
    """Distinct documents of 150-400 words, a third of them opening with one of 4 shared
    boilerplate paragraphs (a site's header), then a near copy (5% of the words changed, in runs)
    of every `every`-th one. Returns (documents, positions of the copies)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    vocab += ["the", "of", "and", "to", "in", "is", "that", "with"] * 50

    def sentences(n: int) -> str:
        out = []
        while n > 0:
            k = min(n, rng.randint(6, 18))
            out.append(" ".join(rng.choice(vocab) for _ in range(k)).capitalize() + ".")
            n -= k
        return " ".join(out)

    headers = [sentences(60) for _ in range(4)]
    docs = []
    for i in range(originals):
        body = sentences(rng.randint(150, 400))
        docs.append(f"{headers[i % 4]}\n\n{body}" if i % 3 == 0 else body)
    return parity.with_near_copies(docs, every, seed=seed)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def parts_of(run: Path) -> pa.Table:
    tables = [pq.read_table(p) for p in sorted((run / "clean").glob("part-*.parquet"))]
    return pa.concat_tables(tables)


def dropped_of(docs: list[str], run: Path) -> list[bool]:
    kept = set(parts_of(run).column("text").to_pylist())
    return [d not in kept for d in docs]


# --- the signature is datatrove's --------------------------------------------------------------


def test_simplify_words_and_signature_are_datatroves():
    text = "Ça va? Le 3,5% des 12 chats—OK! Don't panic: it's 10km away, cannot say (really)."
    # datatrove 0.10.1: simplify_text(text), SpaCyTokenizer("en").word_tokenize of it
    assert (
        M.simplify(text) == "ca va le 0 des 0 chats ok don t panic it s 0km away cannot say really"
    )
    assert M.words_of(M.simplify(text)) == [
        "ca", "va", "le", "0", "des", "0", "chats", "ok", "don", "t", "panic", "it", "s", "0",
        "km", "away", "can", "not", "say", "really",
    ]  # fmt: skip
    # MinhashDedupSignature(config=MinhashConfig(hash_config=HashConfig(64, "sha1")))
    # .get_signature(.get_shingles(text)): bucket 0's first three, bucket 13's last
    sig = M.signature(text, NearDedupConfig())
    assert sig.shape == (14, 8)
    assert sig[0][:3].tolist() == [26447346721551284, 11198510496980306, 11180274216619721]
    assert int(sig[13][-1]) == 10231016744752703
    assert M.signature("only four words here", NearDedupConfig()) is None  # < 5 words


def test_urls_are_compared_normalised():
    same = [
        "https://Example.COM/a/b/",
        "https://example.com/a/b",
        "https://example.com:443/a/b#section",
        " https://example.com/a/b ",
    ]
    assert {M.normalize_url(u) for u in same} == {"https://example.com/a/b"}
    assert M.normalize_url("http://example.com") == "http://example.com/"
    assert M.normalize_url("http://example.com:8080/x?q=1") == "http://example.com:8080/x?q=1"
    differ = ["http://example.com/a/b", "https://example.com/A/b", "https://example.com/a/b?x=1"]
    assert len({M.normalize_url(u) for u in [same[0], *differ]}) == 4


# --- the must-show: recall on injected near copies, precision on distinct documents ------------


def test_near_copies_are_removed_and_distinct_documents_kept(tmp_path):
    docs, copies = generated_corpus()
    write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    cfg = cfg_for(
        tmp_path,
        [tmp_path / "in.jsonl"],
        *NEAR,
        "data.clean.chunk_bytes=150000",
        "data.clean.workers=1",
    )
    stats = run_clean(cfg)
    assert stats["units"] >= 8  # the copies sit in other units than their originals
    dropped = dropped_of(docs, tmp_path / "run")
    originals = [i for i in range(len(docs)) if i not in set(copies)]
    removed = sum(dropped[i] for i in copies) / len(copies)
    lost = sum(dropped[i] for i in originals) / len(originals)
    assert removed >= 0.95, removed
    assert lost <= 0.01, lost
    # of each pair, the first in input order is the one kept
    for k, c in enumerate(copies):
        if dropped[c]:
            assert not dropped[5 * k], k
    assert stats["drops"]["near_dedup"]["minhash"] == sum(dropped)
    assert stats["docs_out"] == len(docs) - sum(dropped)


def test_an_exact_copy_is_counted_once_and_the_first_copy_kept(tmp_path):
    docs, _ = generated_corpus(originals=12, every=100)
    near = parity.near_copy(docs[0], random.Random(1), docs[1].split())
    # docs[0] again (an exact copy, dropped by the exact dedup) and a near copy, in other units
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs[:12]])
    write_jsonl(tmp_path / "b.jsonl", [{"text": docs[0]}, {"text": near}])
    cfg = cfg_for(
        tmp_path,
        [tmp_path / "a.jsonl", tmp_path / "b.jsonl"],
        *NEAR,
        "data.clean.chunk_bytes=20000",
    )
    stats = run_clean(cfg)
    texts = parts_of(tmp_path / "run").column("text").to_pylist()
    assert texts.count(docs[0]) == 1 and near not in texts and len(texts) == 12
    assert stats["drops"]["dedup"]["duplicate"] == 1
    assert stats["drops"]["near_dedup"] == {"minhash": 1}
    assert stats["docs_out"] == 12


# --- which document of a cluster is kept: datatrove's union-find root ---------------------------


def datatrove_roots(edges: list[tuple[int, int]]) -> dict[int, int]:
    """datatrove 0.10.1 MinhashDedupCluster.run's parent/union, transcribed: union by size, the
    pair's first document's set winning a tie."""
    union_set: dict[int, int] = {}
    set_size: dict[int, int] = {}

    def parent(x):
        if x not in union_set or union_set[x] == x:
            union_set[x] = x
            return x
        union_set[x] = parent(union_set[x])
        return union_set[x]

    for v_a, v_b in edges:
        root_a, root_b = parent(v_a), parent(v_b)
        if root_a != root_b:
            size_a, size_b = set_size.get(root_a, 1), set_size.get(root_b, 1)
            if size_a < size_b:
                root_a, root_b = root_b, root_a
            union_set[root_b] = root_a
            set_size[root_a] = size_a + size_b
            set_size.pop(root_b, None)
    return {x: parent(x) for x in union_set}


def test_roots_are_datatroves_union_find_roots():
    import numpy as np

    from codex.pipeline.clean.near_cluster import roots

    rng = random.Random(3)
    for trial in range(30):
        n = rng.randint(2, 60)
        edges = []
        for _ in range(rng.randint(1, 80)):
            a, b = sorted(rng.sample(range(n), 2))
            edges.append((a, b))
        edges += edges[: rng.randint(0, 5)]  # a pair found again in a later band
        want = datatrove_roots(edges)
        a, b = (np.array(x, dtype=np.int64) for x in zip(*edges, strict=True))
        got = roots(a, b, n)
        assert {x: int(got[x]) for x in want} == want, trial


def test_a_cluster_keeps_the_document_datatrove_keeps(tmp_path, monkeypatch):
    """Six documents A-F whose signatures are set here. Band 0: A=B and C=D=E; band 1: B=C
    (first hash 1) and A=F (first hash 9); every other band differs. datatrove sorts band 1 by
    its hashes, so unions B-C before A-F: {A,B} (size 2) joins {C,D,E} (size 3), root C; F joins
    it. datatrove 0.10.1's MinhashDedupBuckets + -Cluster on these signatures removes A, B, D, E,
    F. The first in input order would be A; so would pairs taken in order of their first document
    (A-F first: {A,B,F} and {C,D,E} tie at 3 and A's side wins)."""
    import numpy as np

    docs = generated_corpus(originals=6, every=100)[0][:6]
    sigs = np.arange(14 * 8, dtype=np.uint64).reshape(1, 14, 8) + 1000 * np.arange(
        1, 7, dtype=np.uint64
    ).reshape(6, 1, 1)
    A, B, C, D, E, F = range(6)
    for group, band, first, step in (
        ((A, B), 0, 50, 7),
        ((C, D, E), 0, 60, 7),
        ((A, F), 1, 9, 3),
        ((B, C), 1, 1, 5),
    ):
        for i in group:
            sigs[i, band] = first + step * np.arange(8, dtype=np.uint64)
    by_text = {d: sigs[i] for i, d in enumerate(docs)}
    monkeypatch.setattr(M, "signature", lambda text, c: by_text[text])
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    # one unit a document or two: the pairs cross units
    cfg = cfg_for(
        tmp_path,
        [tmp_path / "a.jsonl"],
        *NEAR,
        "data.clean.chunk_bytes=3000",
        "data.clean.workers=1",
    )
    stats = run_clean(cfg)
    assert stats["units"] >= 3
    assert parts_of(tmp_path / "run").column("text").to_pylist() == [docs[C]]
    assert stats["drops"]["near_dedup"] == {"minhash": 5}


# --- URL dedup and metadata --------------------------------------------------------------------


def test_url_dedup_keeps_the_longest_and_metadata_becomes_columns(tmp_path):
    docs, _ = generated_corpus(originals=8, every=100)
    longest = max(docs[0], docs[1], key=len) + " More words at the end."
    rows = [
        {"text": docs[0], "url": "https://a.org/x/", "dump": "CC-1"},
        {"text": docs[1], "url": "https://A.org/x#top", "dump": "CC-2", "extra": 1},
        {"text": docs[2], "url": "https://a.org/y", "dump": "CC-1"},
        {"text": docs[3], "dump": "CC-3"},  # no URL: never a URL duplicate
        {"text": docs[4], "url": "https://a.org/z", "dump": {"id": 5}},
    ]
    write_jsonl(tmp_path / "a.jsonl", rows)
    # a parquet input: the longest document of https://a.org/x, and one for https://a.org/y
    pq.write_table(
        pa.table(
            {
                "text": [longest, docs[5], docs[6]],
                "url": ["https://a.org/x", "https://a.org/t", "https://a.org/y"],
                "dump": ["CC-4", "CC-5", "CC-6"],
            }
        ),
        tmp_path / "b.parquet",
    )
    cfg = cfg_for(
        tmp_path,
        [tmp_path / "a.jsonl", tmp_path / "b.parquet"],
        *NEAR,
        "data.clean.metadata=[url,dump]",
    )
    stats = run_clean(cfg)
    table = parts_of(tmp_path / "run")
    assert table.column_names == ["text", "id", "source", "url", "dump"]
    got = {r["text"]: r for r in table.to_pylist()}
    # https://a.org/x: 3 documents, the parquet one longest; /y: the longer of docs[2], docs[6]
    assert longest in got and docs[0] not in got and docs[1] not in got
    longer_y = max((docs[2], docs[6]), key=lambda t: len(t.encode()))
    assert longer_y in got and ({docs[2], docs[6]} - {longer_y}).isdisjoint(got)
    assert got[docs[3]]["url"] is None and got[docs[3]]["dump"] == "CC-3"
    assert got[docs[4]]["dump"] == '{"id": 5}'
    assert got[docs[5]]["url"] == "https://a.org/t" and got[docs[5]]["dump"] == "CC-5"
    assert stats["drops"]["near_dedup"] == {"url": 3}


def test_near_dedup_off_writes_what_it_wrote_before(tmp_path):
    docs, _ = generated_corpus(originals=20, every=2)
    write_jsonl(tmp_path / "a.jsonl", [{"text": d, "url": "https://a.org/"} for d in docs])
    stats = run_clean(cfg_for(tmp_path, [tmp_path / "a.jsonl"], *ONLY_DEDUP))
    assert parts_of(tmp_path / "run").column_names == ["text", "id", "source"]
    assert not (tmp_path / "run" / "clean" / "minhash").exists()
    assert "near_dedup" not in stats["drops"] and stats["docs_out"] == len(docs)


def test_near_dedup_needs_the_exact_dedup(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    cfg = cfg_for(tmp_path, [tmp_path / "a.txt"], *NEAR, "data.clean.dedup.enabled=false")
    with pytest.raises(ConfigError, match="near_dedup.enabled needs data.clean.dedup.enabled"):
        run_clean(cfg)
    cfg = cfg_for(tmp_path, [tmp_path / "a.txt"], "data.clean.metadata=[text]")
    with pytest.raises(ConfigError, match="data.clean.metadata names text"):
        run_clean(cfg)


def test_a_rerun_of_the_near_dedup_gives_the_same_bytes(tmp_path):
    docs, _ = generated_corpus(originals=60, every=3)
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    cfg = cfg_for(tmp_path, [tmp_path / "a.jsonl"], *NEAR, "data.clean.chunk_bytes=30000")
    run_clean(cfg)
    clean = tmp_path / "run" / "clean"
    first = {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")}
    (clean / "stats.json").unlink()  # lost: the units and both dedups run again
    run_clean(cfg)
    assert {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")} == first


# --- the same bytes on a two-node Ray cluster --------------------------------------------------


@pytest.mark.slow
def test_ray_gives_the_same_bytes_as_local(tmp_path, ray_cluster):
    docs, _ = generated_corpus(originals=80, every=4)
    urls = [{"text": d, "url": f"https://a.org/{i % 70}"} for i, d in enumerate(docs)]
    write_jsonl(tmp_path / "a.jsonl", urls)
    # partition_bytes: the cluster step in partitions and rounds, each task on any node
    common = (
        *NEAR,
        "data.clean.chunk_bytes=40000",
        "data.clean.metadata=[url]",
        "data.clean.near_dedup.partition_bytes=3000",
    )
    local = cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common, "data.clean.workers=1", run="local")
    on_ray = cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common, run="ray")
    on_ray.data.executor, on_ray.data.ray_address = "ray", ray_cluster
    a, b = run_clean(local), run_clean(on_ray)
    assert a["drops"]["near_dedup"]["url"] > 0 and a["drops"]["near_dedup"]["minhash"] > 0
    assert a["drops"] == b["drops"]
    files = sorted(p.name for p in (tmp_path / "local" / "clean").glob("part-*.parquet"))
    assert a["units"] >= 4 and files
    for name in files:
        assert (tmp_path / "local" / "clean" / name).read_bytes() == (
            tmp_path / "ray" / "clean" / name
        ).read_bytes(), name
    workers = {
        json.loads(p.read_text())["worker"].split(":")[0]
        for p in (tmp_path / "ray" / "clean" / "markers").glob("*.json")
    }
    assert len(workers) == 2, workers


def test_a_reduce_reads_a_bounded_number_of_files_at_100000_units():
    from codex.pipeline.clean.near_dedup import plan_groups

    markers = [{"near_dedup": {"signed": 2000, "urls": 2000}} for _ in range(100_000)]
    groups = plan_groups(markers, 256 << 20)
    # a band's reduce task reads an index row and a range of each group's file: 2 x 317 reads
    assert len(groups) <= 317 and max(b - a for a, b in groups) <= 317
    assert [a for a, _ in groups[1:]] == [b for _, b in groups[:-1]] and groups[-1][1] == 100_000
    # where a group's block would pass partition_bytes (48 bytes a row), it is cut sooner
    small = plan_groups(markers, 2000 * 48 * 10)
    assert max(b - a for a, b in small) == 10


@pytest.mark.slow
def test_partitions_and_groups_do_not_change_the_output(tmp_path):
    docs, _ = generated_corpus(originals=80, every=4)
    rows = [{"text": d, "url": f"https://a.org/{i % 70}"} for i, d in enumerate(docs)]
    write_jsonl(tmp_path / "a.jsonl", rows)
    common = (*NEAR, "data.clean.chunk_bytes=30000", "data.clean.workers=1")
    one = run_clean(cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common, run="one"))
    # 48-byte rows: 1 kB a partition and a group's band makes several of each
    many = run_clean(
        cfg_for(
            tmp_path,
            [tmp_path / "a.jsonl"],
            *common,
            "data.clean.near_dedup.partition_bytes=1000",
            run="many",
        )
    )
    near = tmp_path / "many" / "clean" / "near"
    assert len(list(near.glob("pairs-00-*.npy"))) >= 4 and len(list(near.glob("url-*.npy"))) >= 2
    assert len(list(near.glob("group-*-index.npy"))) > len(
        list((tmp_path / "one" / "clean" / "near").glob("group-*-index.npy"))
    )
    assert one["drops"] == many["drops"] and one["drops"]["near_dedup"]["minhash"] > 0
    for p in sorted((tmp_path / "one" / "clean").glob("part-*.parquet")):
        assert p.read_bytes() == (tmp_path / "many" / "clean" / p.name).read_bytes(), p.name


def test_a_unit_whose_signatures_are_gone_is_cleaned_again(tmp_path, monkeypatch):
    from codex.pipeline.clean import near_dedup

    docs, _ = generated_corpus(originals=40, every=4)
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    common = (*NEAR, "data.clean.chunk_bytes=30000")
    run_clean(cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common, run="whole"))
    cfg = cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # every unit done, killed in the near-dedup
        m.setattr(near_dedup, "near_dedup_corpus", killed)
        with pytest.raises(KeyboardInterrupt):
            run_clean(cfg)
    clean = tmp_path / "run" / "clean"
    (clean / "minhash" / "000001.npy").unlink()  # lost after its marker was written
    stats = run_clean(cfg)
    assert stats["units_run"] == 1
    whole = tmp_path / "whole" / "clean"
    assert {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")} == {
        p.name: p.read_bytes() for p in whole.glob("part-*.parquet")
    }


KILLED_IN_A_TASK = """
import os, signal
from pathlib import Path
from codex.pipeline.clean import near_cluster
from codex.pipeline.clean.clean import run_clean
from tests.fixtures.clean import cfg_for
star = near_cluster.star
def killed(job):
    if job.name == "large-000-000001":
        os.killpg(0, signal.SIGKILL)
    return star(job)
near_cluster.star = killed
run_clean(cfg_for(Path({tmp!r}), [Path({tmp!r}) / "a.jsonl"], *{common!r}))
"""


@pytest.mark.slow
def test_a_rerun_after_a_task_is_killed_redoes_only_it(tmp_path, monkeypatch):
    from codex.pipeline.clean import near_cluster, near_dedup

    docs, _ = generated_corpus(originals=60, every=3)
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    common = (*NEAR, "data.clean.chunk_bytes=30000", "data.clean.near_dedup.partition_bytes=3000")
    run_clean(cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common, run="whole"))
    cfg = cfg_for(tmp_path, [tmp_path / "a.jsonl"], *common)
    ran: list[str] = []
    # the whole clean SIGKILLed (its process group: a machine lost) inside one star task
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_A_TASK.format(tmp=str(tmp_path), common=common)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = {p.stem for p in (tmp_path / "run" / "clean" / "near" / "done").iterdir()}
    assert done and "large-000-000001" not in done

    def counted(fn):
        def run(job):
            ran.append(job.name)
            return fn(job)

        return run

    for module, name in ((near_cluster, "star"), (near_cluster, "scatter")) + tuple(
        (near_dedup, n) for n in ("combine_group", "reduce_block")
    ):
        monkeypatch.setattr(module, name, counted(getattr(module, name)))
    reserved = set()
    run_units = near_cluster.run_units

    def reserving(fn, units, where):
        reserved.add(where.task.memory_bytes)
        return run_units(fn, units, where)

    monkeypatch.setattr(near_cluster, "run_units", reserving)
    run_clean(cfg)
    # every task reserves what its partition_bytes needs (data.task.memory_gb is 0 here)
    assert reserved == {near_dedup.task_memory(3000)} == {3 * 3000 + (200 << 20)}
    # the tasks finished before the kill have their markers: the rerun starts at the killed one
    # and runs only what had not finished (no combine, reduce or scatter task again)
    assert ran[0] == "large-000-000001" and not set(ran) & done, (ran, sorted(done))
    assert all(n.startswith(("small-", "large-")) for n in ran), ran
    clean, whole = tmp_path / "run" / "clean", tmp_path / "whole" / "clean"
    assert {p.name: p.read_bytes() for p in clean.glob("part-*.parquet")} == {
        p.name: p.read_bytes() for p in whole.glob("part-*.parquet")
    }
