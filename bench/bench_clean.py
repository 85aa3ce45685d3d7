"""Throughput (MB/s) and peak RSS of `codex data clean` vs datatrove on the same input.

    python bench/bench_clean.py                        # codex only (1 and 2 workers)
    python bench/bench_clean.py --datatrove BENCHVENV/bin/python --mb 100
    python bench/bench_clean.py --pin --repeats 3      # 1 worker on core 0 vs 2 on cores 0,1
    python bench/bench_clean.py --pin --repeats 5 --ceiling   # + what two cores give this machine
    python bench/bench_clean.py --against 'caf9f80^' --repeats 3   # per core vs issue 27's filing
    python bench/bench_clean.py --workers 1 --corpus prose --mb 20   # prose only
    python bench/bench_clean.py --workers 1 --corpus code --preset code --mb 20   # code only

Input: the Python stdlib's .py files plus ../shared/data/*.txt when present (paragraphs), written
as JSONL files (one document per record) and repeated until --mb MB; each repeat gets a distinct
marker line so repeats are not exact duplicates. Both tools run the equivalent Gopher quality +
Gopher repetition + C4 filters (datatrove: GopherRepetitionFilter, GopherQualityFilter,
C4QualityFilter; codex: preset web with fineweb off). datatrove lives in a bench-only venv
(BENCHVENV: see bench/bench_datatrove_parity.py; pass its python with --datatrove). Peak RSS is
the largest summed RSS of the process tree, sampled every 50 ms; drv/wkr the driver's own peak
and the largest worker's.

Measured here (2 CPU cores, 102 MB = stdlib .py x3 + tinyshakespeare, 16 files), 2026-11-27
10:20-10:30 UTC, with the compiled word counter (pipeline/clean/_wordcount.c), which finds an
ASCII piece's words itself (ascii_words), bytecode compiled first:

                        seconds    MB/s  cpu s  peak RSS MB   drv/wkr  docs kept
codex workers=1         5.0-5.1  19.9-20.3    5.0-5.1    108      108/0     146
codex workers=2         3.0-3.2  32.2-33.8    5.6-5.7    217-223  108/99-102 146

--pin --repeats 5 --ceiling: 1.62-1.70x (median 1.65x) against a ceiling of 1.80-1.85x (median
1.81x): 89-93% of it; --mb 300 --repeats 3 --ceiling: median 1.86x against 1.94x. --against
'caf9f80^' (the code at issue 27's filing): 3.40x per core (5.8 against 19.9 MB/s, medians).
Earlier figures (datatrove 0.10 at 0.48 / 0.84 MB/s, the Python counter) are in README's stage
table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DATATROVE = """
import sys, glob
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.filters import GopherRepetitionFilter, GopherQualityFilter, C4QualityFilter
from datatrove.pipeline.writers import ParquetWriter
inp, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = len(glob.glob(inp + "/*.jsonl"))
LocalPipelineExecutor(pipeline=[JsonlReader(inp), GopherRepetitionFilter(), GopherQualityFilter(),
                                C4QualityFilter(), ParquetWriter(out)],
                      tasks=n, workers=workers, logging_dir=out + "/logs").run()
"""


def build_input(folder: Path, mb: int, files: int = 16, corpus: str = "mixed") -> int:
    """corpus: mixed (the stdlib's .py files, then the shared .txt paragraphs), code (the .py
    files only) or prose (the .txt files only, paragraphs joined into documents of ~3,000
    characters, as web pages are)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in sorted(stdlib.rglob("*.py")) if corpus != "prose" else []:
        if "site-packages" not in p.parts:
            docs.append(p.read_bytes().decode("utf-8", "replace"))
    shared = ROOT.parent / "shared" / "data"
    for p in sorted(shared.glob("*.txt")) if shared.exists() and corpus != "code" else []:
        paragraphs = [d for d in p.read_text(errors="replace").split("\n\n") if d.strip()]
        if corpus == "prose":
            doc: list[str] = []
            for para in paragraphs:
                doc.append(para)
                if sum(map(len, doc)) >= 3000:
                    docs.append("\n\n".join(doc))
                    doc = []
        else:
            docs += paragraphs
    folder.mkdir(parents=True, exist_ok=True)
    outs = [open(folder / f"part{i:02d}.jsonl", "w") for i in range(files)]
    total, k, rep = 0, 0, 0
    while total < mb * 1e6:
        for d in docs:
            line = json.dumps({"text": f"# copy {rep}\n{d}" if rep else d}) + "\n"
            outs[k % files].write(line)
            total += len(line.encode())
            k += 1
        rep += 1
    for f in outs:
        f.close()
    return total


def clean_code(inp: Path, run: Path, workers: int, preset: str = "web") -> str:
    """The Python that runs `codex data clean` (preset web unless told, fineweb off) on inp into
    run."""
    return (
        "from codex.core.config import build_config\n"
        "from codex.pipeline.clean.clean import run_clean\n"
        f"cfg = build_config(overrides=['data.clean.preset={preset}', "
        "'data.clean.fineweb.enabled=false', "
        # the corpus is mostly source code, which the prose rules drop: well under min_yield
        "'data.clean.allow_low_yield=true', "
        f"'data.clean.workers={workers}'], run={str(run)!r})\n"
        f"cfg.data.clean.inputs = [{str(inp)!r}]\nrun_clean(cfg)"
    )


def compile_bytecode(root: Path) -> None:
    """Write the .pyc of codex's packages under root, as pip does when it installs a wheel: every
    process of a run then loads them instead of compiling each module from source, which it does
    where they are missing and cannot be written (PYTHONDONTWRITEBYTECODE; ~50 ms a process here,
    the pool's processes included)."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(root / "codex"), str(root / "pipeline")],
        check=True,
    )


def split_input(inp: Path, tmp: Path) -> list[Path]:
    """The input's files in two folders (hard links), alternate files each."""
    halves = [tmp / "in-half0", tmp / "in-half1"]
    for k, p in enumerate(sorted(inp.glob("*.jsonl"))):
        halves[k % 2].mkdir(exist_ok=True)
        os.link(p, halves[k % 2] / p.name)
    return halves


def independent_halves(halves: list[Path], run: Path) -> float:
    """Seconds until both of two 1-worker cleans are done, one per half of the files, pinned to
    cores 0 and 1 and started together: no coordination at all, so what two cores give here."""
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", clean_code(half, run / f"h{k}", 1)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda k=k: os.sched_setaffinity(0, {k}),
        )
        for k, half in enumerate(halves)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("an independent half failed")
    return time.perf_counter() - t0


def measure(
    cmd: list[str], env=None, cores=None, cwd: Path = ROOT
) -> tuple[float, float, float, float, float]:
    """(seconds, peak RSS MB of the process tree, the driver's own peak, the largest worker's,
    CPU seconds of the tree); cores: pin the process (and so its workers) to these; cwd: the
    checkout whose codex `python -c` imports (the first entry of its sys.path)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    peak, each = 0, {}
    while True:
        # wait4: the child's CPU time, with that of the workers it waited for
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = tree_rss(proc.pid)
        peak = max(peak, sum(now.values()))
        for p, b in now.items():
            each[p] = max(each.get(p, 0), b)
        time.sleep(0.05)
    dt = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stderr.read().decode()[-3000:]}")
    worker = max([b for p, b in each.items() if p != proc.pid] + [0])
    cpu = usage.ru_utime + usage.ru_stime
    return dt, peak / 1e6, each.get(proc.pid, 0) / 1e6, worker / 1e6, cpu


def tree_rss(pid: int) -> dict[int, int]:
    """RSS bytes of pid and each of its descendants, found through /proc/PID/task/*/children: a
    few small reads, not a scan of every process on the machine (this polls every 50 ms beside the
    workers; a /proc scan cost ~1 ms a poll, CPU taken from 2 pinned workers but not from 1)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                out[p] = int(f.read().split()[1]) * PAGE
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):  # it exited meanwhile
            pass
    return out


PAGE = os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--datatrove", default="", help="python of a venv with datatrove installed")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="run N workers on cores 0..N-1 only (the issue's scaling: 1 worker on 1 core)",
    )
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="with --pin: also time two independent 1-worker runs on half the files each",
    )
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every run, in turn")
    ap.add_argument("--corpus", choices=["mixed", "code", "prose"], default="mixed")
    ap.add_argument("--preset", default="web", help="codex's filter preset (web, code, trusted)")
    ap.add_argument(
        "--against",
        default="",
        metavar="REV",
        help="only 1 worker on core 0: this checkout's clean against git revision REV's, in turn "
        "(per-core speed-up on this machine; e.g. caf9f80^, the code when issue 27 was filed)",
    )
    args = ap.parse_args()
    compile_bytecode(ROOT)
    tmp = Path(tempfile.mkdtemp(prefix="bench_clean_"))
    size = build_input(tmp / "in", args.mb, corpus=args.corpus)
    print(f"input: {size / 1e6:.0f} MB in 16 JSONL files ({tmp / 'in'})")
    if args.against:
        against(args.against, tmp, size, args.repeats)
        return
    if args.ceiling:
        halves = split_input(tmp / "in", tmp)
    rows, ceiling = [], []
    for i, w in enumerate([int(x) for x in args.workers.split(",")] * args.repeats):
        code = clean_code(tmp / "in", tmp / f"codex{i}", w, args.preset)
        pin = set(range(w)) if args.pin else None
        if args.ceiling and w == 2:  # the machine's own ceiling, in the same round
            ceiling.append(independent_halves(halves, tmp / f"half{i}"))
        dt, rss, driver, worker, cpu = measure([sys.executable, "-c", code], cores=pin)
        stats = json.loads((tmp / f"codex{i}" / "clean" / "stats.json").read_text())
        rows.append((f"codex workers={w}", dt, rss, stats["docs_out"], driver, worker, cpu))
        if args.datatrove:  # needs: pip install datatrove orjson spacy nltk (in the bench venv)
            try:
                dt, rss, driver, worker, cpu = measure(
                    [args.datatrove, "-c", DATATROVE, str(tmp / "in"), str(tmp / f"dt{i}"), str(w)]
                )
            except SystemExit as e:
                print(f"datatrove workers={w} failed: {str(e)[-400:]}")
                continue

            rows.append((f"datatrove workers={w}", dt, rss, None, driver, worker, cpu))
    print_table(rows, size)
    runs = {w: [r for r in rows if r[0] == f"codex workers={w}"] for w in (1, 2)}
    if args.repeats > 1 and all(runs.values()):
        print_speed_ups(runs[1], runs[2], ceiling, args.pin)


def against(rev: str, tmp: Path, size: int, repeats: int) -> None:
    """1 worker pinned to core 0, this checkout's clean and REV's (a git worktree of it) in turn,
    on the same input: MB/s is a property of the day's VM (the same code's rate moved by a third
    between sessions here), a ratio measured in one run is not."""
    other = tmp / "against"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(other), rev], check=True
    )
    compile_bytecode(other)
    try:
        rows = []
        for i in range(repeats):
            for name, cwd in ((f"codex at {rev}", other), ("codex here", ROOT)):
                run = tmp / f"against{i}-{len(rows)}"
                dt, rss, driver, _, cpu = measure(
                    [sys.executable, "-c", clean_code(tmp / "in", run, 1)], cores={0}, cwd=cwd
                )
                kept = json.loads((run / "clean" / "stats.json").read_text())["docs_out"]
                rows.append((f"{name} workers=1", dt, rss, kept, driver, 0.0, cpu))
        print_table(rows, size)
        ratios = [a[1] / b[1] for a, b in zip(rows[::2], rows[1::2], strict=True)]
        print(
            f"per core (core 0), this checkout over {rev}: rounds "
            f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x"
        )
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)])


def print_table(rows: list[tuple], size: int) -> None:
    print(
        f"\n{'':28} {'seconds':>8} {'MB/s':>7} {'cpu s':>6} {'peak RSS MB':>12} {'drv/wkr':>9} "
        f"{'docs kept':>10}"
    )
    for name, dt, rss, kept, driver, worker, cpu in rows:
        print(
            f"{name:28} {dt:8.1f} {size / 1e6 / dt:7.2f} {cpu:6.1f} {rss:12.0f} "
            f"{driver:4.0f}/{worker:<4.0f} {kept if kept is not None else '':>10}"
        )


def print_speed_ups(one: list[tuple], two: list[tuple], ceiling: list[float], pin: bool) -> None:
    """Per round (run in turn), and best of each: on a shared VM noise only adds time; the CPU
    seconds of 2 workers over 1's show how much the two cores slowed each other; and, with
    --ceiling, what two independent processes got in the same round."""
    rounds = [(a[1] / b[1], b[6] / a[6]) for a, b in zip(one, two, strict=False)]
    best = min(r[1] for r in one) / min(r[1] for r in two)
    print(
        f"speed-up of 2 workers over 1{' (pinned: 1 core vs 2)' if pin else ''}: rounds "
        f"{', '.join(f'{r:.2f}x (cpu s x{c:.2f})' for r, c in rounds)}; median "
        f"{statistics.median(r for r, _ in rounds):.2f}x, best of each {best:.2f}x"
    )
    if ceiling:
        ceil = [a[1] / c for a, c in zip(one, ceiling, strict=False)]
        of_it = [r / c for (r, _), c in zip(rounds, ceil, strict=False)]
        print(
            "ceiling (1 worker's seconds over two independent 1-worker runs on half the files "
            f"each, cores 0 and 1 at once): rounds {', '.join(f'{c:.2f}x' for c in ceil)}; "
            f"median {statistics.median(ceil):.2f}x; 2 workers reached "
            f"{', '.join(f'{x:.0%}' for x in of_it)} of it"
        )


if __name__ == "__main__":
    main()
