"""`codex data verify`: check every shard of a run against its manifest.json.

Per shard: sha256 of the file, dtype and header, token count, ids < vocab_size, <|bos|> count
(documents); per split: the first shard starts with <|bos|> and the entries add up to the
manifest's totals; and shard-named files the manifest does not list are reported. Each file is
read once, streaming, whatever its size.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from codex.core import fsio
from codex.pipeline.shard.manifest import FORMAT_VERSION, MANIFEST, SHARD_NAME, SPLITS


def _check_npy(
    path: str, entry: dict, dtype: str, vocab: int, bos: int
) -> tuple[list[str], int | None]:
    """Stream one .npy shard: sha256, header, token count, ids < vocab, <|bos|> count.
    (problems, first token)."""
    problems, first = [], None
    with fsio.open(path, "rb") as f:
        r = fsio.HashingReader(f)
        try:
            version = np.lib.format.read_magic(r)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dt = read_header(r)
        except Exception as e:
            if fsio.is_store_failure(e):  # the storage failed, not the shard
                raise
            return [f"{path}: not a valid .npy file ({e})"], None
        if str(dt) != dtype or len(shape) != 1:
            problems.append(
                f"{path}: holds {dt} {shape}, manifest says {dtype} [{entry['tokens']}]"
            )
        n = bos_count = 0
        top = -1
        step = (8 << 20) // dt.itemsize * dt.itemsize
        while chunk := r.read(step):
            a = np.frombuffer(chunk[: len(chunk) // dt.itemsize * dt.itemsize], dt)
            if first is None and len(a):
                first = int(a[0])
            n += len(a)
            bos_count += int(np.count_nonzero(a == bos))
            top = max(top, int(a.max()) if len(a) else -1)
    if r.sha.hexdigest() != entry["sha256"]:
        problems.append(
            f"{path}: sha256 {r.sha.hexdigest()[:12]} != manifest {entry['sha256'][:12]} "
            "(corrupt or changed)"
        )
    if shape and n != shape[0]:
        problems.append(f"{path}: {n} tokens on disk, header says {shape[0]} (truncated)")
    if n != entry["tokens"]:
        problems.append(f"{path}: {n} tokens, manifest says {entry['tokens']}")
    if bos_count != entry["documents"]:
        problems.append(
            f"{path}: {bos_count} documents (<|bos|>), manifest says {entry['documents']}"
        )
    if top >= vocab:
        problems.append(f"{path}: token id {top} >= vocab_size {vocab}")
    return problems, first


def _check_parquet(path: str, entry: dict, vocab: int, bos: int) -> tuple[list[str], int | None]:
    sha = fsio.file_sha256(path)
    problems = (
        []
        if sha == entry["sha256"]
        else [f"{path}: sha256 {sha[:12]} != manifest {entry['sha256'][:12]} (corrupt or changed)"]
    )
    if problems:
        return problems, None
    with fsio.open(path, "rb") as f:
        a = pq.ParquetFile(f).read(columns=["tokens"]).column(0).to_numpy()  # no pandas import
    if len(a) != entry["tokens"]:
        problems.append(f"{path}: {len(a)} tokens, manifest says {entry['tokens']}")
    if int(np.count_nonzero(a == bos)) != entry["documents"]:
        problems.append(
            f"{path}: {int(np.count_nonzero(a == bos))} documents, "
            f"manifest says {entry['documents']}"
        )
    if len(a) and int(a.max()) >= vocab:
        problems.append(f"{path}: token id {int(a.max())} >= vocab_size {vocab}")
    return problems, int(a[0]) if len(a) else None


def _entry_path(shards_dir: str, manifest_path: str, i: int, e) -> tuple[str, str | None]:
    """(the shard's path, None), or ("", a problem) when manifest entry i lacks a key or its path
    leaves the shards folder."""
    missing = [
        k
        for k in ("split", "path", "format", "tokens", "documents", "sha256")
        if not isinstance(e, dict) or k not in e
    ]
    if missing:
        return "", f"{manifest_path}: shards[{i}] has no {', '.join(repr(k) for k in missing)}"
    try:
        return fsio.join_inside(shards_dir, e["path"], f"{manifest_path}: shards[{i}].path"), None
    except ValueError as err:
        return "", str(err)


def verify_shards(shards_dir: str, tokenizer_dir: str | None = None) -> list[str]:
    """Check every shard against manifest.json (sha256, dtype, tokens, documents, ids < vocab,
    totals); with tokenizer_dir, also that it is the tokenizer the manifest names. [] when all is
    well."""
    manifest_path = fsio.join(shards_dir, MANIFEST)
    if not fsio.exists(manifest_path):
        if not fsio.isdir(shards_dir) or not fsio.listdir(shards_dir):
            return [
                f"{shards_dir}: no shards here "
                "(run `codex data shard` first, or check the run directory)"
            ]
        return [
            f"{manifest_path} not found: the shard run never finished (rerun `codex data shard`)"
        ]
    try:
        m = fsio.read_json(manifest_path)
        dtype, vocab, bos = m["dtype"], m["tokenizer"]["vocab_size"], m["special_ids"]["bos"]
        shards, totals = m["shards"], m["totals"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{manifest_path}: unreadable manifest ({err})"]
    problems = []
    if m.get("format_version") != FORMAT_VERSION:
        problems.append(
            f"{manifest_path}: format_version {m.get('format_version')}, "
            f"this codex reads {FORMAT_VERSION}"
        )
    if tokenizer_dir and fsio.exists(fsio.join(tokenizer_dir, "tokenizer.json")):
        sha = fsio.file_sha256(fsio.join(tokenizer_dir, "tokenizer.json"))
        if sha != m["tokenizer"]["sha256"]:
            problems.append(
                f"{tokenizer_dir}/tokenizer.json has sha256 {sha[:12]}, the shards were made with "
                f"{m['tokenizer']['sha256'][:12]}"
            )
    seen: dict[str, dict[str, dict[str, int]]] = {sp: {} for sp in SPLITS}
    for i, e in enumerate(shards):
        path, problem = _entry_path(shards_dir, manifest_path, i, e)
        if problem:
            problems.append(problem)
            continue
        if not fsio.exists(path):
            problems.append(f"{path}: missing")
            continue
        if e["format"] == "npy":
            found, first = _check_npy(path, e, dtype, vocab, bos)
        else:
            found, first = _check_parquet(path, e, vocab, bos)
        problems += found
        split_seen = seen.setdefault(e["split"], {})
        if e["format"] not in split_seen:
            split_seen[e["format"]] = {"tokens": 0, "documents": 0, "shards": 0}
            if not found and first != bos:
                problems.append(
                    f"{path}: the first shard of {e['split']} does not start with <|bos|>"
                )
        t = split_seen[e["format"]]
        t["tokens"] += e["tokens"]
        t["documents"] += e["documents"]
        t["shards"] += 1
    for sp, by_format in seen.items():
        for fmt, t in by_format.items():
            if t != totals.get(sp):
                problems.append(
                    f"{manifest_path}: {sp} {fmt} shards add up to {t}, totals say {totals.get(sp)}"
                )
    # Shard-named files the manifest does not list: the loader ignores them, but a copy of this
    # folder would carry them and a reader could take them for data, so say so.
    listed = {e["path"] for e in shards}
    for path in fsio.listdir(shards_dir):
        name = fsio.basename(path)
        if SHARD_NAME.fullmatch(name) and name not in listed:
            problems.append(
                f"{path}: a shard file that {MANIFEST} does not list (left from another run?); "
                f"delete it"
            )
    return problems
