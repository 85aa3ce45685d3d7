"""Throughput (MB/s of input) of `codex data clean` and `codex data shard`: local vs Ray nodes.

    python bench/bench_data_scale.py --mb 200
    python bench/bench_data_scale.py --mb 5 --chunk-mb 1      # smoke run (seconds)

Configurations, each running the `codex` CLI in a fresh process:
  local 1 worker    --workers 1 under `taskset -c 0` (one core, comparable with 1 Ray CPU)
  ray 1 node        a Ray cluster of 1 node with --num-cpus 1 (`--executor ray --ray-address`)
  ray 2 nodes       the same plus a second node of 1 CPU joined to it
The Ray nodes are started here (`ray start`, RAY_AUTH_MODE=disabled), each in a session and
process group of its own, and ended between configurations by killing those processes (never
`ray stop`: it ends every Ray process on the machine, other people's included); node i is pinned
to core i (taskset, unless --no-pin-ray). The codex driver is not pinned and
also uses CPU (planning, progress, clean's final dedup, shard's scan and write phases): on a
machine with few cores it competes with the nodes.

Input: the Python stdlib's .py files plus ../shared/data/*.txt (tinyshakespeare) paragraphs as
JSONL in a fixed shuffled order, repeated with a distinct marker line per repeat until --mb MB
(the approach of bench/bench_clean.py): half of it in one big file (>= 50 MB at --mb 100 and over,
so clean splits it into byte ranges of --chunk-mb) and the rest in 8 smaller files.
  clean   --preset web, fineweb off (the filters of bench_clean.py); MB/s = input bytes / seconds
  shard   --shard-tokens 10M over the clean output of a local, untimed `--preset code` clean of
          the same input (web keeps well under 1% of this mostly-source-code input: too little
          to time) and a tokenizer trained on it once (vocab 8192); MB/s = cleaned bytes
          (stats.json bytes_out) / seconds
Every configuration's outputs (clean: part-*.parquet + stats.json; shard: *.npy + manifest.json)
must be byte-identical to the local run's. Seconds include process start and, for Ray, the
driver joining the cluster.
Rounds (--repeats) run the three configurations in turn; the table shows each one's median
seconds, so a slow spell of a shared machine does not land on one configuration only.

Measured here: see README.md's data stage table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CODEX = str(BIN / "codex")
RAY = str(BIN / "ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
ENV.pop("RAY_ADDRESS", None)
# --allow-low-yield: the web rules keep little of this mostly-code corpus; the work is what is timed
CLEAN_ARGS = ["--preset", "web", "--set", "data.clean.fineweb.enabled=false", "--allow-low-yield"]
CONFIGS = [("local 1 worker", 0), ("ray 1 node", 1), ("ray 2 nodes", 2)]  # (name, Ray nodes)


def load_docs() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [
        p.read_bytes().decode("utf-8", "replace")
        for p in sorted(stdlib.rglob("*.py"))
        if "site-packages" not in p.parts
    ]
    shared = ROOT.parent / "shared" / "data"
    for p in sorted(shared.glob("*.txt")) if shared.exists() else []:
        docs += [d for d in p.read_text(errors="replace").split("\n\n") if d.strip()]
    random.Random(0).shuffle(docs)  # prose and code mixed in any prefix (a small --mb)
    return docs


def build_input(folder: Path, mb: float, small_files: int = 8) -> list[int]:
    """JSONL files under folder: big.jsonl (half the bytes) + small_files others. Returns sizes."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = load_docs()
    big = open(folder / "big.jsonl", "w")
    smalls = [open(folder / f"small{i:02d}.jsonl", "w") for i in range(small_files)]
    sizes = [0] * (small_files + 1)
    target, k = mb * 1e6, 0
    while sum(sizes) < target:
        rep, d = divmod(k, len(docs))
        line = json.dumps({"text": f"copy {rep}\n{docs[d]}" if rep else docs[d]}) + "\n"
        i = 0 if sizes[0] < sum(sizes[1:]) else 1 + k % small_files
        (big if i == 0 else smalls[i - 1]).write(line)
        sizes[i] += len(line.encode())
        k += 1
    for f in [big, *smalls]:
        f.close()
    return sizes


def run(cmd: list[str], what: str, sessions: list[int] | None = None) -> float:
    """Run cmd; exit with its stderr tail if it fails. Returns wall seconds. With `sessions`: in
    a session of its own, whose id (its pid) is appended there (a `ray start`: its daemons stay
    in that session)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=sessions is not None,
    )
    if sessions is not None:
        sessions.append(proc.pid)
    _, stderr = proc.communicate()
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{stderr.decode()[-3000:]}")
    return dt


def first_core() -> int:
    return min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A Ray cluster started here: its address, temp dir and the sessions of its nodes."""

    def __init__(self, addr: str, tmp: str):
        self.addr, self.tmp = addr, tmp
        self.sessions: list[int] = []


def start_ray(nodes: int, pin: bool) -> Cluster:
    """A Ray cluster of `nodes` nodes of 1 CPU on this machine, each `ray start` in a session of
    its own."""
    port, tmp = free_port(), tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: socket paths
    addr = f"127.0.0.1:{port}"
    cluster = Cluster(addr, tmp)
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    pin = pin and len(cores) >= nodes
    for i in range(nodes):
        where = ["--head", "--port", str(port), "--temp-dir", tmp, "--include-dashboard=false"]
        cmd = [RAY, "start", *(where if i == 0 else ["--address", addr]), *common]
        if pin:
            cmd = ["taskset", "-c", str(sorted(cores)[i]), *cmd]
        try:
            run(cmd, f"ray start (node {i})", cluster.sessions)
        except SystemExit:
            stop_ray(cluster)
            raise
    # wait until every node has joined (outside the timings)
    probe = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
    probe += "print(int(ray.cluster_resources().get('CPU', 0)))"
    for _ in range(60):
        out = subprocess.run(
            [sys.executable, "-c", probe, addr], env=ENV, capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(nodes)]:
            return cluster
        time.sleep(1)
    stop_ray(cluster)
    raise SystemExit(f"the Ray cluster at {addr} did not reach {nodes} CPUs")


def session_groups(sessions: list[int]) -> set[int]:
    """The process groups of the live processes in these sessions: a node's daemons (its own
    group) and its workers (a group each, in the node's session)."""
    groups = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) in sessions:
                groups.add(int(fields[2]))
    return groups


def stop_ray(cluster: Cluster) -> None:
    """Kill the cluster's processes, by the sessions its nodes were started in; wait until they
    are gone (30 s at most)."""
    deadline = time.monotonic() + 30
    while (groups := session_groups(cluster.sessions)) and time.monotonic() < deadline:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    shutil.rmtree(cluster.tmp, ignore_errors=True)


def digests(folder: Path, patterns: list[str]) -> dict[str, str]:
    files = sorted({p for pat in patterns for p in folder.glob(pat)})
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def prepare(work: Path, args) -> tuple[int, int]:
    """The input JSONL and, untimed, the cleaned corpus + tokenizer that shard reads (work/prep).
    Returns (input bytes, cleaned bytes)."""
    sizes = build_input(work / "in", args.mb)
    print(
        f"input: {sum(sizes) / 1e6:.1f} MB in {len(sizes)} JSONL files (largest "
        f"{max(sizes) / 1e6:.1f} MB, clean units of {args.chunk_mb:g} MB) under {work / 'in'}"
    )
    prep = work / "prep"
    run(
        [CODEX, "data", "clean", "--run", str(prep), "--input", str(work / "in")]
        + ["--preset", "code", "--workers", "2"],
        "prep clean (code preset)",
    )
    tok = ["--vocab-size", "8192", "--max-chars", str(args.tok_chars)]
    run([CODEX, "data", "tokenize", "--run", str(prep), *tok], "tokenize")
    shard_bytes = json.loads((prep / "clean" / "stats.json").read_text())["bytes_out"]
    print(f"shard input: {shard_bytes / 1e6:.1f} MB cleaned (local --preset code, untimed)")
    return sum(sizes), shard_bytes


def run_config(work: Path, name: str, nodes: int, args) -> dict:
    """One configuration: clean, then shard, each from scratch. {clean_s, shard_s, digests}."""
    tag = name.replace(" ", "_")
    crun, srun = work / f"clean_{tag}", work / f"shard_{tag}"
    for folder in (crun, srun):
        shutil.rmtree(folder, ignore_errors=True)
    clean_args = [*CLEAN_ARGS, "--set", f"data.clean.chunk_bytes={int(args.chunk_mb * 1e6)}"]
    if nodes:
        cluster = start_ray(nodes, not args.no_pin_ray)
        flags = ["--executor", "ray", "--ray-address", cluster.addr]
        pre: list[str] = []
    else:
        flags, pre = ["--workers", "1"], ["taskset", "-c", str(first_core())]
    try:
        cmd = [CODEX, "data", "clean", "--run", str(crun), "--input", str(work / "in")]
        clean_s = run(pre + cmd + clean_args + flags, f"{name}: clean")
        for sub in ("clean", "tokenizer"):
            shutil.copytree(work / "prep" / sub, srun / sub)
        cmd = [CODEX, "data", "shard", "--run", str(srun), "--shard-tokens", str(args.shard_tokens)]
        shard_s = run(pre + cmd + flags, f"{name}: shard")
    except SystemExit:
        if nodes:  # what Ray's own processes said before they are stopped
            for log in sorted(Path(cluster.tmp).glob("session_latest/logs/*.out")):
                tail = log.read_text(errors="replace")[-1500:].strip()
                print(f"--- {log.name}:\n{tail}" if tail else "", file=sys.stderr)
        raise
    finally:
        if nodes:
            stop_ray(cluster)
    out = digests(crun / "clean", ["part-*.parquet", "stats.json"])
    out |= digests(srun / "shards", ["*.npy", "manifest.json"])
    return {"clean_s": clean_s, "shard_s": shard_s, "digests": out}


def report(rows: list[dict], in_bytes: int, shard_bytes: int) -> dict:
    """Print the table (median seconds over the rounds), the targets and the CPU-hours per TB."""
    print(f"\n{'config':16} {'clean s':>8} {'MB/s':>7} {'shard s':>8} {'MB/s':>7}  identical")
    for r in rows:
        r["clean_mb_s"] = in_bytes / 1e6 / r["clean_s"]
        r["shard_mb_s"] = shard_bytes / 1e6 / r["shard_s"]
        print(
            f"{r['config']:16} {r['clean_s']:8.1f} {r['clean_mb_s']:7.2f} {r['shard_s']:8.1f} "
            f"{r['shard_mb_s']:7.2f}  {'yes' if r['identical'] else 'no'}"
        )
    local, ray1, ray2 = rows
    ratios = {}
    print()
    for stage in ("clean", "shard"):
        a = ray1[f"{stage}_mb_s"] / local[f"{stage}_mb_s"]
        b = ray2[f"{stage}_mb_s"] / ray1[f"{stage}_mb_s"]
        ratios[stage] = {"ray1_vs_local": a, "ray2_vs_ray1": b}
        print(
            f"{stage}: ray 1 CPU / local 1 worker = {a:.2f}x (target >= 0.90: "
            f"{'met' if a >= 0.9 else 'MISSED'}); 2 nodes / 1 node = {b:.2f}x (target >= 1.70: "
            f"{'met' if b >= 1.7 else 'MISSED'})"
        )
    print("\nCPU-hours per 1 TB of stage input, from the per-CPU rate (MB/s / CPUs):")
    for r in rows:
        r["cpu_hours_per_tb"] = {
            stage: 1e12 / (r[f"{stage}_mb_s"] / r["cpus"] * 1e6) / 3600
            for stage in ("clean", "shard")
        }
        h = r["cpu_hours_per_tb"]
        print(f"  {r['config']:16} clean {h['clean']:8.1f}   shard {h['shard']:8.1f}")
    print(
        "\ncaveat: the codex driver runs outside the Ray nodes' CPUs (unpinned) and also uses CPU;"
        f" this machine has {os.cpu_count()} cores."
    )
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=200, help="input size in MB")
    ap.add_argument("--chunk-mb", type=float, default=8, help="clean's unit size (chunk_bytes)")
    ap.add_argument("--shard-tokens", type=int, default=10_000_000)
    ap.add_argument("--tok-chars", type=int, default=20_000_000, help="tokenizer --max-chars")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of all configs; medians")
    ap.add_argument("--workdir", default="", help="default: a new temp dir")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--no-pin-ray", action="store_true", help="do not pin Ray node i to core i")
    ap.add_argument("--json", default="", help="also write the results to this file")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_scale_"))
    if work.exists() and any(work.iterdir()):  # the stages would resume from what is there
        raise SystemExit(f"--workdir {work} is not empty")
    work.mkdir(parents=True, exist_ok=True)
    try:
        in_bytes, shard_bytes = prepare(work, args)
        # rounds interleave the configurations, so a slow spell of a shared machine hits all
        runs: dict[str, list[dict]] = {name: [] for name, _ in CONFIGS}
        for i in range(args.repeats):
            for name, nodes in CONFIGS:
                r = run_config(work, name, nodes, args)
                runs[name].append(r)
                print(
                    f"round {i + 1}: {name:16} clean {r['clean_s']:6.1f} s  shard "
                    f"{r['shard_s']:6.1f} s",
                    flush=True,
                )
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ref = runs[CONFIGS[0][0]][0]["digests"]
    rows = [
        {
            "config": name,
            "cpus": max(nodes, 1),
            "clean_s": statistics.median(r["clean_s"] for r in runs[name]),
            "shard_s": statistics.median(r["shard_s"] for r in runs[name]),
            "clean_s_all": [r["clean_s"] for r in runs[name]],
            "shard_s_all": [r["shard_s"] for r in runs[name]],
            "identical": all(r["digests"] == ref for r in runs[name]),
        }
        for name, nodes in CONFIGS
    ]
    ratios = report(rows, in_bytes, shard_bytes)
    if args.json:
        result = {
            "input_bytes": in_bytes,
            "shard_input_bytes": shard_bytes,
            "chunk_mb": args.chunk_mb,
            "shard_tokens": args.shard_tokens,
            "repeats": args.repeats,
            "cores": os.cpu_count(),
            "pin_ray": not args.no_pin_ray,
            "rows": rows,
            "ratios": ratios,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
