"""What the host does per XLA step: a step that only logs never waits for the device.

XLABackend.synchronize (torch_xla.sync + wait_device_ops: a drain of the device pipeline) is
counted per step of the real training loop on 4 XLA CPU devices (v6e-4's mesh). With
lagged_logs a log step writes the previous log step's line, whose values are already computed,
so drains happen only at start-up and at the sync points that need one (validation, a save, the
end), whatever the number of log steps.

Run in the XLA venv:  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla
tests/train/xla/test_xla_host.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.procs import run_xla
from tests.fixtures.xla import PRELUDE, overrides, results

pytestmark = pytest.mark.xla

CHILD = """
from codex.train.xla.backend import XLABackend
drains = []
plain = XLABackend.synchronize
def counted(self):
    drains.append(1)
    plain(self)
XLABackend.synchronize = counted
for name, steps in (("short", 4), ("long", 12)):
    run = {root!r} + "/" + name
    summary = train(cfg(run, overrides_for(steps)), evaluate)
    emit(name, {{"drains": len(drains), "loss": summary["loss"]}})
    drains.clear()
"""


def test_log_steps_never_drain_the_device(tmp_path: Path):
    ov = overrides("v6e-4", 2, 0, eval_every=0, save_every=0, log_every=1)
    script = PRELUDE + (
        "def overrides_for(steps):\n"
        f"    return [o for o in {ov!r} if not o.startswith('train.max_steps=')]"
        " + [f'train.max_steps={steps}']\n"
    )
    out = results(run_xla(script + CHILD.format(root=str(tmp_path)), devices=4))
    # every step logs; 8 more log steps add no drain
    assert out["short"]["drains"] == out["long"]["drains"], out
    for name, steps in (("short", 4), ("long", 12)):
        rows = [
            json.loads(line)
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if '"train"' in line
        ]
        # each step's line is written, once, in order (the last one at the final save)
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
        assert rows[-1]["loss"] == pytest.approx(out[name]["loss"])
        # the compile count is fixed after the first steps: no program per log step
        assert rows[-1]["compiles"] == rows[2]["compiles"], rows
