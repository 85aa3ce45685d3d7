"""A damaged or forged checkpoint met by eval, sample, export and a resumed train, through the real
CLI: exit 1 and one line, nothing a forged pickle carries is run, nothing is overwritten.
Policy: docs/bad-input.md."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from tests.fixtures.bad_input import TRAIN, files_under, invoke


class _Payload:
    """What a forged pickle carries: a call to run on load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_calling(module: str, name: str, args: tuple) -> bytes:
    """A protocol-4 pickle that calls module's attribute `name` (a dotted path) with `args`: what
    pickle.dumps would write for a class reached through other modules' attributes."""

    def text(s: str) -> bytes:
        b = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b

    call_args = pickle.dumps(args, protocol=2)[2:-1]  # without PROTO and STOP
    return (
        pickle.PROTO
        + bytes([4])
        + text(module)
        + text(name)
        + pickle.STACK_GLOBAL
        + call_args
        + pickle.REDUCE
        + pickle.STOP
    )


def test_a_damaged_only_checkpoint_is_bad_data_for_eval_sample_and_export(run, tmp_path):
    """Exit 1 (bad data), as README promises, not 2 (a usage mistake)."""
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    for f in step.rglob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    for cmd in (
        ["eval"],
        ["sample", "--prompt", "def"],
        ["export", "--format", "torch", "--out", str(tmp_path / "m.pt")],
    ):
        invoke([*cmd, "--run", str(run)], 1, "no intact checkpoint", "damaged")


@pytest.mark.parametrize("damage", ["sha256", "not-json", "a-list"])
def test_a_checkpoint_whose_done_does_not_vouch_for_it(run, tmp_path, damage):
    """Eval, export and train all refuse it (exit 1); train does not start over from step 0."""
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    done_path = step / "DONE"
    if damage == "sha256":
        done = json.loads(done_path.read_text())
        name = sorted(n for n in done["files"] if n.endswith(".distcp"))[0]
        done["files"][name]["sha256"] = "0" * 64
        done_path.write_text(json.dumps(done))
    elif damage == "not-json":
        done_path.write_text(done_path.read_text()[:20])
    else:
        done_path.write_text("[]")
    before = files_under(run / "checkpoints")
    out = tmp_path / "m.pt"
    for cmd in (
        ["eval"],
        ["export", "--format", "torch", "--out", str(out)],
        ["train", *TRAIN, "--max-steps", "5"],
    ):
        invoke([*cmd, "--run", str(run)], 1, "no intact checkpoint", str(step))
    assert files_under(run / "checkpoints") == before
    assert not out.exists()


def test_a_forged_checkpoint_index_runs_nothing(run, tmp_path):
    """A .metadata whose pickle calls os.system (DONE's checksums forged to match): eval, sample
    and a resumed train refuse it with one line, exit 1, and the call never happens."""
    import hashlib
    import pickle

    marker = tmp_path / "pwned"
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    data = pickle.dumps(_Payload(marker))
    (step / ".metadata").write_bytes(data)
    done = json.loads((step / "DONE").read_text())
    done["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "DONE").write_text(json.dumps(done))
    for cmd in (["eval"], ["sample", "--prompt", "def"], ["train", *TRAIN, "--max-steps", "5"]):
        invoke([*cmd, "--run", str(run)], 1, ".metadata", "posix.system", "refusing to load")
    assert not marker.exists()


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.filesystem", "io.FileIO"),  # creates or truncates a file
        (
            "torch.distributed.checkpoint.metadata",
            "torch._strobelight.cli_function_profiler.subprocess.Popen",  # runs a command
        ),
    ],
)
def test_a_forged_index_reaching_a_class_through_a_module_attribute_runs_nothing(
    run, tmp_path, module, name
):
    """DCP's own modules are allowed, but a dotted name walks from them to any class they can
    reach (io.FileIO, subprocess.Popen): the index must be refused before the call."""
    import functools
    import hashlib
    import importlib
    import time

    def payload(marker: Path) -> bytes:
        args = (str(marker), "w") if name.endswith("FileIO") else (["touch", str(marker)],)
        return _pickle_calling(module, name, args)

    # the forgery is live: plain pickle runs it
    target = functools.reduce(getattr, name.split("."), importlib.import_module(module))
    assert isinstance(target, type)
    probe = tmp_path / "probe"
    obj = pickle.loads(payload(probe))
    (obj.wait if hasattr(obj, "wait") else obj.close)()  # the process ended, or the file closed
    assert probe.exists()

    marker = tmp_path / "pwned"
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    data = payload(marker)
    (step / ".metadata").write_bytes(data)
    done = json.loads((step / "DONE").read_text())
    done["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "DONE").write_text(json.dumps(done))
    for cmd in (
        ["eval"],
        ["sample", "--prompt", "def"],
        ["export", "--format", "torch", "--out", str(tmp_path / "m.pt")],
        ["train", *TRAIN, "--max-steps", "5"],
    ):
        invoke([*cmd, "--run", str(run)], 1, ".metadata", "refusing to load")
    time.sleep(0.5)  # a started process would have touched it by now
    assert not marker.exists()
