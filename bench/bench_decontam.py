"""Throughput (MB/s, one worker = one core) of `codex data clean` with data.clean.decontam on and
off, side by side in one run, and of the n-gram lookup alone (decontam.Matcher.match).

    python bench/bench_decontam.py                  # 8 MB corpus, 1 MB eval set, 3 repeats
    python bench/bench_decontam.py --mb 20 --eval-mb 4 --repeats 5

Input: the Python stdlib's .py files as JSONL (one file a record) until --mb MB; the eval set is
--eval-mb MB of other stdlib files (its test suite) as JSONL records. Both cleans run preset
trusted (length + exact dedup), so the difference is decontam's own cost. Figures: docs/stages.md
("Decontamination").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codex.core.config import build_config  # noqa: E402
from codex.pipeline.clean import decontam  # noqa: E402
from codex.pipeline.clean.clean import run_clean  # noqa: E402


def _texts(paths, mb: float) -> list[str]:
    out, size = [], 0
    for p in paths:
        try:
            t = p.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        out.append(t)
        size += len(t.encode())
        if size >= mb * 1e6:
            break
    return out


def _write(path: Path, texts: list[str]) -> None:
    with open(path, "w") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=8)
    ap.add_argument("--eval-mb", type=float, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = sorted(p for p in stdlib.glob("*.py"))
    corpus += sorted(p for p in stdlib.glob("[a-s]*/**/*.py") if "test" not in p.parts)
    evals = sorted((stdlib / "test").glob("test_*.py"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-decontam-"))
    docs = _texts(corpus, args.mb)
    (tmp / "in").mkdir()
    _write(tmp / "in" / "corpus.jsonl", docs)
    _write(tmp / "eval.jsonl", _texts(evals, args.eval_mb))
    mb = (tmp / "in" / "corpus.jsonl").stat().st_size / 1e6
    eval_mb = (tmp / "eval.jsonl").stat().st_size / 1e6
    print(f"corpus {mb:.1f} MB ({len(docs)} docs), eval set {eval_mb:.1f} MB")
    common = [
        "data.clean.preset=trusted",
        "data.clean.workers=1",
        "data.clean.allow_low_yield=true",
    ]
    on = [
        "data.clean.decontam.enabled=true",
        f"data.clean.decontam.eval_sets=[{tmp / 'eval.jsonl'}]",
    ]
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.repeats):
        for name, extra in (("off", []), ("on", on)):
            cfg = build_config(overrides=common + extra, run=str(tmp / f"run-{name}-{r}"))
            cfg.data.clean.inputs = [str(tmp / "in")]
            t0 = time.perf_counter()
            stats = run_clean(cfg)
            times[name].append(time.perf_counter() - t0)
            if name == "on" and r == 0:
                print("matched per eval set:", stats["decontam"])
    for name, ts in times.items():
        s = statistics.median(ts)
        print(
            f"clean decontam {name:3s}: {s:.2f} s median of {len(ts)}, {mb / s:.1f} MB/s per core"
        )
    # the lookup alone: every document through Matcher.match
    dc = build_config(overrides=on).data.clean.decontam
    t0 = time.perf_counter()
    sets = decontam.read_eval_sets(dc)
    table = decontam.write_table(sets, dc.n, str(tmp / "table"))
    built = time.perf_counter() - t0
    m = decontam.Matcher(table, sets.names, dc.n)
    t0 = time.perf_counter()
    for d in docs:
        m.match(d)
    alone = time.perf_counter() - t0
    print(f"eval set table: {len(m.hashes)} n-grams, built in {built:.2f} s")
    print(f"lookup alone: {mb / alone:.1f} MB/s per core ({alone:.2f} s)")


if __name__ == "__main__":
    main()
