"""train.threads (train/plan/threads.py): the default divides the physical cores this process may
use (SMT siblings once, within a container's CPU quota) by the training processes on the machine;
train.threads, then OMP_NUM_THREADS, win over it; torch, OpenMP and tokenizers get the number."""

from __future__ import annotations

import os

import pytest
import torch

from codex.train.plan import threads as th


def fake_topology(root, cores_of_cpu: dict[int, tuple[int, int]]):
    for cpu, (package, core) in cores_of_cpu.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_smt_siblings_count_as_one_core(tmp_path):
    # 8 logical CPUs: 2 packages x 2 cores x 2 SMT siblings
    cpus = {c: (c // 4, (c // 2) % 2) for c in range(8)}
    root = fake_topology(tmp_path, cpus)
    assert th.physical_cores(list(range(8)), root) == 4
    assert th.physical_cores([0, 1], root) == 1  # two siblings of one core
    assert th.physical_cores([0, 2, 4], root) == 3
    assert th.physical_cores([0, 9], root) == 2  # cpu9 has no topology: count the CPUs


@pytest.mark.parametrize(
    "text, cpus", [("max 100000\n", None), ("150000 100000\n", 1.5), ("garbage", None)]
)
def test_cgroup_quota(tmp_path, text, cpus):
    f = tmp_path / "cpu.max"
    f.write_text(text)
    assert th.cgroup_cpu_limit(f) == cpus
    assert th.cgroup_cpu_limit(tmp_path / "missing") is None


def test_busy_cores_from_proc_stat(tmp_path, monkeypatch):
    """Per-CPU jiffies (user nice system idle iowait irq softirq steal) between two samples:
    cpu0 busy throughout, cpu1 idle, cpu2 half busy; cpu3 is not ours."""
    assert th.busy_cores([0], stat=tmp_path / "missing") is None
    stat = tmp_path / "stat"
    zero = "0 0 0 0 0 0 0 0"
    samples = iter(
        [
            f"cpu  {zero}\ncpu0 {zero}\ncpu1 {zero}\ncpu2 {zero}\ncpu3 {zero}\n",
            "cpu  1 2 3 4 5 6 7 8\ncpu0 100 0 0 0 0 0 0 0\ncpu1 0 0 0 90 10 0 0 0\n"
            "cpu2 20 0 20 50 0 5 5 0\ncpu3 100 0 0 0 0 0 0 0\n",
        ]
    )
    monkeypatch.setattr(type(stat), "read_text", lambda self: next(samples))
    assert th.busy_cores([0, 1, 2], sample_s=0, stat=stat) == pytest.approx(1.5)


def test_default_divides_the_cores_by_the_local_processes(monkeypatch):
    monkeypatch.setattr(th, "busy_cores", lambda cpus: 0.0)
    monkeypatch.setattr(th, "usable_cpus", lambda: list(range(16)))
    monkeypatch.setattr(th, "physical_cores", lambda cpus: len(cpus) // 2)
    monkeypatch.setattr(th, "cgroup_cpu_limit", lambda: None)
    assert th.default_threads(1).n == 8
    t = th.default_threads(3)
    assert t.n == 2 and "8 physical cores / 3 processes" in t.why
    assert th.default_threads(16).n == 1  # never 0
    # one process: the cores other processes keep busy are left out; several: never sampled
    monkeypatch.setattr(th, "busy_cores", lambda cpus: 3.2)
    t = th.default_threads(1)
    assert t.n == 5 and "3.2 kept busy" in t.why
    assert th.default_threads(2).n == 4
    monkeypatch.setattr(th, "cgroup_cpu_limit", lambda: 2.5)  # a pod of 2.5 CPUs on the machine
    t = th.default_threads(1)
    assert t.n == 3 and "quota of 2.5" in t.why


def test_apply_threads_order_and_effect(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(th, "default_threads", lambda n: th.Threads(5, f"default for {n}"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("RAYON_NUM_THREADS", "")
    try:
        t = th.apply_threads(0)
        assert (t.n, t.why) == (5, "default for 2")
        assert torch.get_num_threads() == 5
        assert os.environ["RAYON_NUM_THREADS"] == "5"
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert th.apply_threads(0).n == 3  # the user's OMP_NUM_THREADS
        assert th.apply_threads(2).n == 2  # train.threads wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
