"""Decision parity of our prose filters with datatrove's own, filter by filter, on held-out prose;
with --near-dedup, of `data.clean.near_dedup` with datatrove's MinHash dedup.

    python bench/bench_datatrove_parity.py --datatrove BENCHVENV/bin/python [--near-dedup]

BENCHVENV is the bench venv bench/bench_clean.py uses, anywhere outside the repository (`python -m
venv BENCHVENV && BENCHVENV/bin/pip install datatrove orjson nltk spacy`; datatrove's English word
and sentence splitter is spaCy's blank "en" tokenizer + sentencizer, so spacy is required).

Corpus (text nobody here generated; `corpus()` below, in this order):
  1. the first --shared-mb MB (default 20) of ../shared/data/*.txt, files in sorted order;
  2. English man pages (/usr/share/man/man[1-8], sorted) rendered to text by groff (-man -Tutf8
     -P-cbou -rHY=0: no bold/underline; groff still breaks a few words at line ends), up to
     --man-mb MB (default 4);
  3. licence texts: /usr/share/common-licenses/*, sorted;
  4. the running Python's stdlib *.txt / *.rst files outside test directories (idlelib NEWS, ...);
  5. Debian package docs under /usr/share/doc: files named copyright, README*, *.txt (plain or
     .gz), sorted by path; with --changelogs also changelog* and NEWS* (release notes: mostly
     file names, e-mail addresses and bullet lists, not prose, so not in the default corpus).
  Every file of 2-5 gives at most its first --per-file-kb KB (default 100), so that one long file
  does not dominate; 3-5 together stop at --extra-mb MB (default 12). Python docstrings are left
  out: they sit in code.

Documents (`split_documents`, a fixed rule): each file is decoded as UTF-8 (errors="replace") and
split into paragraphs at runs of blank lines (a line holding only whitespace is blank); consecutive
paragraphs are joined with "\\n\\n" into one document until it holds at least --doc-chars
characters (default 3000), then a new document starts; the last group of a file is a document even
if shorter. Each document is normalised with pipeline.clean.filters.normalize (as `codex data
clean` does before its filters) and exact duplicates (after normalisation) are kept once, first
seen wins (Debian's copyright files repeat licence texts many times).

Each filter runs in isolation, on the same normalised text, on both sides: ours is the single
filter function with its default settings (codex/core/config/data.py), datatrove's is the filter's
`filter(Document)` with its default arguments. Agreement = both keep or both drop. Disagreeing
documents are counted by (our reason, datatrove's reason); --dump DIR writes them as JSONL.
datatrove's results are cached in --cache (keyed by the corpus hash) so reruns after changing our
filters only rerun ours.

Measured here (datatrove 0.10.1, spaCy blank "en"; 17.12 MB = tinyshakespeare 1.12 + man pages
4.00 + licences 0.30 + stdlib txt/rst 0.16 + /usr/share/doc 11.54; 4522 documents):

    filter             agree %   kept ours/datatrove   disagree (ours -> datatrove)
    gopher_quality       99.51            1301/1315    18 below_alpha_threshold -> kept,
                                                        4 kept -> gopher_below_alpha_threshold
    gopher_repetition    99.91            3528/3530    1 duplicated_5_grams -> kept, 1 top_3_gram
                                                        -> kept, 1 top_4_gram -> kept, 1 kept ->
                                                        duplicated_9_n_grams
    c4                  100.00            3370/3370    0
    fineweb             100.00            2651/2651    0

(Before spaCy's special cases, URL match and + rule, and with = + § % and currency split off a
word's end: gopher_quality 99.20%, 36 disagreeing; gopher_repetition 99.85%, 7.)

Every remaining difference is in man pages or package docs (option lists, paths, code): our
one-regex word splitter and spaCy's tokenizer split such text differently (spaCy's infix and
suffix rules in context: "--fields=.", "|--", "08[0m", "idlelib.idle_test.__init__.load_tests"),
and the document sits within about 0.01 of a threshold (gopher_quality: alpha-word ratio near
0.8).

--near-dedup: the same documents, then a near copy of every --every'th (default 5th) with --rate
(5%) of its words replaced by words of the corpus, in runs of 3-8 words (--spread: one word at a
time), appended in order (`with_near_copies`). codex: `codex data clean` with only the length
rule, the exact dedup and data.clean.near_dedup. datatrove: MinhashDedupSignature, -Buckets and
-Cluster with MinhashConfig's defaults but HashConfig(64, "sha1") (--hash xxhash: its default;
codex hashes shingles with SHA-1, so only the statistics then agree). Measured here (datatrove
0.10.1; the 4522 documents above + 905 near copies):

                 copies dropped %   originals dropped %   dropped
    codex                   92.49                 14.02      1471
    datatrove               92.38                 14.02      1470
    decision agreement 99.98% (1 of 5427 documents differs: a git release note whose words spaCy
    and pipeline/clean/words.py split differently).

codex keeps the document of a cluster datatrove keeps, its union-find's root (near_dedup.py says
how). Keeping each cluster's first document instead would agree on 98.43% (85 differ): the line
"dt, first" shows datatrove's clusters with that rule. The originals dropped are real
near-duplicates (licence texts and package READMEs repeated with small changes). The copies missed
are mostly short (median 68 words, against 373 for those caught; some under 5 words, which have
no shingle): one changed run of 3-8 words is a large share of their 5-word shingles, and their
similarity falls below the LSH threshold of 14 bands x 8 hashes (about 0.72).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codex.core.config.data import CleanConfig  # noqa: E402
from codex.pipeline.clean import filters as F  # noqa: E402

NAMES = ("gopher_quality", "gopher_repetition", "c4", "fineweb")

DATATROVE = r"""
import json, sys
from datatrove.data import Document
from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,
                                        GopherQualityFilter, GopherRepetitionFilter)
flts = {"gopher_quality": GopherQualityFilter(), "gopher_repetition": GopherRepetitionFilter(),
        "c4": C4QualityFilter(), "fineweb": FineWebQualityFilter()}
with open(sys.argv[1]) as fin, open(sys.argv[2], "w") as fout:
    for i, line in enumerate(fin):
        text = json.loads(line)
        row = {}
        for name, f in flts.items():
            r = f.filter(Document(text=text, id=str(i)))  # a fresh Document: C4 rewrites text
            if isinstance(r, tuple):
                r = r[1] if not r[0] else None
            else:
                r = None if r else "dropped"
            row[name] = r
        fout.write(json.dumps(row) + "\n")
"""

_BLANK = re.compile(r"\n(?:[ \t\f\v]*\n)+")  # one or more blank lines


def split_documents(text: str, doc_chars: int = 3000) -> list[str]:
    """Paragraphs (split at blank lines) grouped in order into documents of >= doc_chars
    characters; the last group of the text may be shorter. Empty paragraphs are skipped."""
    docs: list[str] = []
    cur: list[str] = []
    n = 0
    for para in _BLANK.split(text.replace("\r\n", "\n")):
        if not para.strip():
            continue
        cur.append(para)
        n += len(para) + 2
        if n >= doc_chars:
            docs.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        docs.append("\n\n".join(cur))
    return docs


def _man_pages() -> list[Path]:
    man = Path("/usr/share/man")
    return sorted(p for d in sorted(man.glob("man[1-8]")) for p in d.iterdir() if p.is_file())


def _render_man(p: Path) -> str:
    """A man page as the terminal shows it: groff -man -Tutf8, no bold/underline, no hyphenation."""
    src = _read(p)
    out = subprocess.run(
        ["groff", "-man", "-Tutf8", "-P-cbou", "-rHY=0"],
        input=src.encode(),
        capture_output=True,
        timeout=60,
    )
    return out.stdout.decode("utf-8", "replace")


def _read(p: Path) -> str:
    data = p.read_bytes()
    if p.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", "replace")


def _doc_files(changelogs: bool = False) -> list[Path]:
    files = []
    lic = Path("/usr/share/common-licenses")
    if lic.is_dir():
        files += sorted(p for p in lic.iterdir() if p.is_file())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files += sorted(
        p
        for ext in ("*.txt", "*.rst")
        for p in stdlib.rglob(ext)
        if not {"test", "tests", "site-packages"} & set(p.parts)
    )
    kinds = r"copyright|README.*|.*\.txt" + (r"|NEWS.*|changelog.*" if changelogs else "")
    want = re.compile(rf"^({kinds})(\.gz)?$", re.I)
    doc = Path("/usr/share/doc")
    if doc.is_dir():
        files += sorted(p for p in doc.rglob("*") if p.is_file() and want.match(p.name))
    return files


def corpus(
    shared_mb: float,
    extra_mb: float,
    per_file_kb: float = 100,
    man_mb: float = 0,
    changelogs: bool = False,
) -> tuple[list[tuple[str, str]], dict]:
    """[(source, raw text)] in order, and {source: bytes}."""
    out, sizes = [], Counter()
    budget = int(shared_mb * 1e6)
    shared = ROOT.parent / "shared" / "data"
    for p in sorted(shared.glob("*.txt")) if shared.is_dir() else []:
        if budget <= 0:
            break
        data = p.read_bytes()[:budget]
        budget -= len(data)
        out.append(("shared/data", data.decode("utf-8", "replace")))
        sizes["shared/data"] += len(data)
    budget = int(man_mb * 1e6)
    for p in _man_pages() if man_mb and shutil.which("groff") else []:
        if budget <= 0:
            break
        try:
            text = _render_man(p)[: min(budget, int(per_file_kb * 1000))]
        except (OSError, EOFError, gzip.BadGzipFile, subprocess.SubprocessError):
            continue
        n = len(text.encode())
        budget -= n
        sizes["man pages (groff)"] += n
        out.append(("man pages (groff)", text))
    budget = int(extra_mb * 1e6)
    for p in _doc_files(changelogs):
        if budget <= 0:
            break
        try:
            text = _read(p)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        if "\x00" in text:  # binary
            continue
        text = text[: min(budget, int(per_file_kb * 1000))]
        src = (
            "python stdlib txt/rst"
            if str(p).startswith(sysconfig.get_paths()["stdlib"])
            else "/usr/share/common-licenses"
            if "common-licenses" in p.parts
            else "/usr/share/doc"
        )
        n = len(text.encode())
        budget -= n
        sizes[src] += n
        out.append((src, text))
    return out, dict(sizes)


def ours(text: str, cfg: CleanConfig) -> dict:
    return {name: getattr(F, f"{name}_filter")(F.Doc(text), getattr(cfg, name)) for name in NAMES}


# --- near-dedup (--near-dedup) ------------------------------------------------------------------

DATATROVE_MINHASH = r"""
import json, os, struct, sys, tempfile
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets,
                                              MinhashDedupCluster, MinhashDedupSignature)
from datatrove.utils.hashing import HashConfig
cfg = MinhashConfig(hash_config=HashConfig(precision=64, hash_fc=sys.argv[3]))
work = tempfile.mkdtemp()
with open(sys.argv[1]) as f:
    docs = [Document(text=json.loads(line), id=str(i)) for i, line in enumerate(f)]
MinhashDedupSignature(output_folder=f"{work}/sigs", config=cfg).run(iter(docs), 0, 1)
for b in range(cfg.num_buckets):
    MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets",
                        config=cfg).run(None, b, cfg.num_buckets)
MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove",
                    config=cfg, save_cluster_id=True).run()
got = {}
for name in ("remove", "clusters"):
    path, got[name] = f"{work}/remove/000000.{name}", []
    if os.path.exists(path):
        data = open(path, "rb").read()
        got[name] = list(struct.unpack(f"<{len(data) // 4}I", data))
with open(sys.argv[2], "w") as f:
    json.dump(got, f)
"""

_TOKEN = re.compile(r"(\s+)")


def near_copy(text: str, rng, vocab: list[str], rate: float = 0.05, spread: bool = False) -> str:
    """`text` with `rate` of its words (white-space separated) replaced by words of `vocab`: in
    runs of 3-8 words, as a page's edits come (a changed date, name or sentence), or one word at
    a time at random places with spread=True. The white space between words is kept."""
    tokens = _TOKEN.split(text)
    words = [i for i, t in enumerate(tokens) if t and not t.isspace()]
    todo = max(1, round(rate * len(words)))
    changed: set[int] = set()
    while len(changed) < min(todo, len(words)):
        run = 1 if spread else min(rng.randint(3, 8), todo - len(changed))
        at = rng.randrange(len(words))
        changed.update(range(at, min(at + run, len(words))))
    for k in changed:
        tokens[words[k]] = rng.choice(vocab)
    return "".join(tokens)


def with_near_copies(
    docs: list[str], every: int, seed: int = 0, rate: float = 0.05, spread: bool = False
) -> tuple[list[str], list[int]]:
    """docs followed by a near copy (near_copy) of every `every`-th one, in order; and the
    copies' positions in the result."""
    import random

    rng = random.Random(seed)
    vocab = sorted({w for d in docs[:: max(1, len(docs) // 200)] for w in d.split()})
    copies = [near_copy(docs[i], rng, vocab, rate, spread) for i in range(0, len(docs), every)]
    return docs + copies, list(range(len(docs), len(docs) + len(copies)))


def ours_near_dedup(docs: list[str], work: Path) -> list[bool]:
    """Which documents `codex data clean` with data.clean.near_dedup drops (no other filter
    drops any of these: preset code with its filter off, exact copies none)."""
    from codex.core.config import build_config
    from codex.pipeline.clean.clean import run_clean

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with open(work / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    overrides = [
        "data.clean.preset=code",
        "data.clean.code.enabled=false",
        "data.clean.length.max_chars=100000000",
        "data.clean.near_dedup.enabled=true",
        "data.clean.chunk_bytes=2000000",
        "data.clean.workers=1",
    ]
    cfg = build_config(overrides=overrides, run=str(work / "run"))
    cfg.data.clean.inputs = [str(work / "docs.jsonl")]
    run_clean(cfg)
    import pyarrow.parquet as pq

    kept: Counter = Counter()
    for p in sorted((work / "run" / "clean").glob("part-*.parquet")):
        kept.update(pq.read_table(p).column("text").to_pylist())
    dropped = []
    for d in docs:  # a text kept k times covers its first k occurrences
        dropped.append(kept[d] <= 0)
        kept[d] -= 1
    return dropped


def near_dedup_parity(args, docs: list[str]) -> None:
    corpus_docs, copies = with_near_copies(docs, args.every, rate=args.rate, spread=args.spread)
    corpus_docs = [F.normalize(d)[0] for d in corpus_docs]
    work = Path(args.cache) / "near"
    work.mkdir(parents=True, exist_ok=True)
    inp, res = work / "docs.jsonl", work / f"datatrove-{args.hash}-clusters.json"
    with open(inp, "w") as f:
        for d in corpus_docs:
            f.write(json.dumps(d) + "\n")
    subprocess.run(
        [args.datatrove, "-c", DATATROVE_MINHASH, str(inp), str(res), args.hash], check=True
    )
    got = json.loads(res.read_text())
    removed = set(got["remove"])
    theirs = [i in removed for i in range(len(corpus_docs))]
    # datatrove's clusters, keeping each one's first document in input order instead of the
    # union-find's root (as codex and datatrove do): how much the choice of the kept one weighs
    first: dict[int, int] = {}
    pairs = got["clusters"]
    for doc, cid in zip(pairs[::2], pairs[1::2], strict=True):
        first[cid] = min(first.get(cid, doc), doc)
    members = dict(zip(pairs[::2], pairs[1::2], strict=True))
    theirs_first = [i in members and first[members[i]] != i for i in range(len(corpus_docs))]
    mine = ours_near_dedup(corpus_docs, work / "ours")
    n = len(corpus_docs)
    agree = sum(a == b for a, b in zip(mine, theirs, strict=True))
    agree_first = sum(a == b for a, b in zip(mine, theirs_first, strict=True))
    injected = set(copies)
    originals = [i for i in range(n) if i not in injected]
    print(
        f"near-dedup: {len(originals)} documents + {len(copies)} near copies "
        f"({100 * args.rate:g}% of words changed, {'one by one' if args.spread else 'in runs'}); "
        f"datatrove hashes: {args.hash}"
    )
    print(f"{'':12} {'copies dropped %':>17} {'originals dropped %':>20} {'dropped':>8}")
    for name, dec in (("codex", mine), ("datatrove", theirs), ("dt, first", theirs_first)):
        print(
            f"{name:12} {100 * sum(dec[i] for i in copies) / len(copies):17.2f} "
            f"{100 * sum(dec[i] for i in originals) / len(originals):20.2f} {sum(dec):8d}"
        )
    print(f"decision agreement: {100 * agree / n:.2f}% ({n - agree} of {n} documents differ)")
    print(
        "codex against datatrove's clusters keeping each one's first document: "
        f"{100 * agree_first / n:.2f}% ({n - agree_first} differ)"
    )
    if args.dump:
        dump = Path(args.dump)
        dump.mkdir(parents=True, exist_ok=True)
        with open(dump / "near_dedup.jsonl", "w") as f:
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if a != b:
                    row = {"i": i, "ours": a, "datatrove": b, "cluster": members.get(i)}
                    f.write(json.dumps({**row, "text": corpus_docs[i][:300]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datatrove", required=True, help="python of the bench venv with datatrove")
    ap.add_argument("--shared-mb", type=float, default=20)
    ap.add_argument("--extra-mb", type=float, default=12)
    ap.add_argument("--per-file-kb", type=float, default=100)
    ap.add_argument("--man-mb", type=float, default=4)
    ap.add_argument("--changelogs", action="store_true", help="also Debian changelog*/NEWS*")
    ap.add_argument("--doc-chars", type=int, default=3000)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "bench_datatrove_parity"))
    ap.add_argument("--dump", default="", help="write disagreeing documents here (JSONL)")
    ap.add_argument("--near-dedup", action="store_true", help="MinHash near-dedup parity instead")
    ap.add_argument("--every", type=int, default=5, help="--near-dedup: a near copy of every Nth")
    ap.add_argument("--rate", type=float, default=0.05, help="--near-dedup: words changed")
    ap.add_argument("--spread", action="store_true", help="--near-dedup: change single words")
    ap.add_argument("--hash", default="sha1", choices=("sha1", "xxhash"), help="datatrove's")
    args = ap.parse_args()
    files, sizes = corpus(
        args.shared_mb, args.extra_mb, args.per_file_kb, args.man_mb, args.changelogs
    )
    docs, seen, per_src = [], set(), Counter()
    for src, raw in files:
        for d in split_documents(raw, args.doc_chars):
            text, _ = F.normalize(d)
            if text and text not in seen:
                seen.add(text)
                docs.append(text)
                per_src[src] += 1
    if args.near_dedup:
        near_dedup_parity(args, docs)
        return
    key = hashlib.sha256("\0".join(docs).encode()).hexdigest()[:16]
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    inp, res = cache / f"{key}.docs.jsonl", cache / f"{key}.datatrove.jsonl"
    if not res.exists():
        with open(inp, "w") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
        subprocess.run([args.datatrove, "-c", DATATROVE, str(inp), str(res) + ".tmp"], check=True)
        Path(str(res) + ".tmp").rename(res)
    theirs = [json.loads(x) for x in res.read_text().splitlines()]
    assert len(theirs) == len(docs)

    print("corpus:")
    for src in sizes:
        print(f"  {src:28} {sizes[src] / 1e6:7.2f} MB  {per_src[src]:6d} documents")
    print(f"  {'total':28} {sum(sizes.values()) / 1e6:7.2f} MB  {len(docs):6d} documents")

    cfg = CleanConfig()
    mine = [ours(d, cfg) for d in docs]
    dump = Path(args.dump) if args.dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    print(f"\n{'filter':18} {'docs':>6} {'agree %':>8} {'kept us/dt':>12} {'disagree':>9}")
    pairs = {}
    for name in NAMES:
        diff = Counter()
        kept_us = kept_dt = 0
        rows = []
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            ra, rb = a[name], b[name]
            kept_us += ra is None
            kept_dt += rb is None
            if (ra is None) != (rb is None):
                diff[(ra or "kept", rb or "kept")] += 1
                rows.append({"i": i, "ours": ra, "datatrove": rb, "text": docs[i]})
        n = len(docs)
        agree = 100 * (n - sum(diff.values())) / n
        print(f"{name:18} {n:6d} {agree:8.2f} {f'{kept_us}/{kept_dt}':>12} {sum(diff.values()):9d}")
        pairs[name] = diff
        if dump:
            with open(dump / f"{name}.jsonl", "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    print("\ndisagreements by reason (ours -> datatrove):")
    for name, diff in pairs.items():
        for (ra, rb), c in diff.most_common():
            print(f"  {name:18} {c:5d}  {ra:24} {rb}")


if __name__ == "__main__":
    main()
