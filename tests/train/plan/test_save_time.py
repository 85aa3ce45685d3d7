"""A checkpoint save's time per host (train/plan/save_time.py) and the decision to warn at start
when it cannot end within a spot VM's notice (train.preempt_notice_s)."""

from __future__ import annotations

import pytest

from codex.train.plan.memory import Setting, plan
from codex.train.plan.presets import get_preset, preset_model
from codex.train.plan.save_time import hosts_of, preempt_warning, save_time


def _save(preset: str, layout: str = "fsdp", optimizer: str = "adamw"):
    p = get_preset(preset)
    setting = Setting(dtype="bf16", optimizer=optimizer, layout=layout)  # type: ignore[arg-type]
    memory = plan(preset_model("7b"), p, 1, 1024, setting)
    return memory, save_time(memory, p.hosts, remote=True)


def test_a_host_writes_its_share_of_one_copy_of_the_state():
    memory, one_host = _save("v6e-8")
    # fp32 weights and AdamW's two fp32 moments: 12 bytes a parameter, all on v6e-8's one host
    assert one_host.hosts == 1
    assert one_host.bytes_per_host == pytest.approx(12 * memory.params, rel=1e-3)
    _, hosts = _save("v6e-32")
    assert hosts.hosts == get_preset("v6e-32").hosts > 1
    assert hosts.bytes_per_host * hosts.hosts == pytest.approx(one_host.bytes_per_host, rel=1e-3)
    assert hosts.seconds < one_host.seconds
    # replicated or sharded, DCP writes each tensor once
    _, replicated = _save("v6e-32", layout="replicate")
    assert replicated.bytes_per_host == pytest.approx(hosts.bytes_per_host, rel=1e-3)
    _, muon = _save("v6e-8", optimizer="muon")
    assert muon.bytes_per_host < one_host.bytes_per_host


def test_a_save_longer_than_the_notice_is_warned_with_its_numbers_and_the_fixes():
    _, t = _save("v6e-8")
    line = preempt_warning(t, 30)
    assert line is not None and "\n" not in line
    assert "train.preempt_notice_s=30 s" in line
    assert f"{t.bytes_per_host / 1e9:.2f} GB" in line and f"{t.rate / 1e9:.2f} GB/s" in line
    assert f"about {t.seconds:.0f} s" in line and "1 host(s)" in line
    for fix in ("fewer bytes per host", "more hosts", "raise train.preempt_notice_s"):
        assert fix in line
    assert preempt_warning(t, t.seconds + 1) is None  # the save ends within the notice
    assert preempt_warning(t, 0) is None  # 0: no check


def test_the_hosts_a_run_writes_from():
    assert hosts_of(get_preset("v6e-32"), 32) == get_preset("v6e-32").hosts
    assert hosts_of(get_preset("h100-8"), 16) == 2  # torchrun over two 8-GPU hosts
    assert hosts_of(get_preset("cpu"), 4) == 1
