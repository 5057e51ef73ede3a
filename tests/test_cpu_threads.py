"""The CPU thread count: affinity, cgroup quota (v1 and v2, the tightest of the group and its
ancestors), the flag and OMP_NUM_THREADS, shared among the ranks on the machine."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagellm.config import cpu_threads
from pagellm.config.cpu_threads import cgroup_cpu_quota, resolve_cpu_threads, usable_cores
from pagellm.engine.arg_utils import EngineArgs


def _fake_fs(root: Path, proc_cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


def test_cgroup_v2_quota_is_the_tightest_of_the_group_and_its_ancestors(tmp_path):
    root = _fake_fs(tmp_path, "0::/pods/pod1/app\n", {
        "sys/fs/cgroup/cpu.max": "max 100000\n",
        "sys/fs/cgroup/pods/cpu.max": "300000 100000\n",
        "sys/fs/cgroup/pods/pod1/app/cpu.max": "max 100000\n",
    })
    assert cgroup_cpu_quota(root) == 3.0


def test_cgroup_v1_quota_from_a_container_whose_path_is_the_hosts(tmp_path):
    # The path is the host's; inside the container the controller's mount is the group itself.
    root = _fake_fs(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_cpu_quota(root) == 2.5


def test_no_quota(tmp_path):
    root = _fake_fs(tmp_path, "1:cpu:/\n0::/\n", {
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None
    assert cgroup_cpu_quota(tmp_path / "nowhere") is None


def test_usable_cores_is_the_affinity_capped_by_the_quota_rounded_down(tmp_path, eight_cores):
    assert usable_cores(_fake_fs(tmp_path / "a", "0::/\n", {"sys/fs/cgroup/cpu.max": "max 100000"})) == 8
    assert usable_cores(_fake_fs(tmp_path / "b", "0::/\n", {"sys/fs/cgroup/cpu.max": "350000 100000"})) == 3
    assert usable_cores(_fake_fs(tmp_path / "c", "0::/\n", {"sys/fs/cgroup/cpu.max": "50000 100000"})) == 1


@pytest.mark.parametrize(("cores", "num_ranks", "threads"), [(1, 1, 1), (2, 1, 1), (8, 1, 7), (8, 2, 3), (2, 4, 1),
                                                            (16, 3, 5)])
def test_default_leaves_a_core_and_shares_the_rest_among_the_ranks(tmp_path, monkeypatch, cores, num_ranks, threads):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    root = _fake_fs(tmp_path, "0::/\n", {})
    assert resolve_cpu_threads(None, num_ranks, environ={}, root=root)[0] == threads


def test_flag_then_omp_num_threads_override_the_default(tmp_path, eight_cores):
    root = _fake_fs(tmp_path, "0::/\n", {})
    assert resolve_cpu_threads(5, 2, environ={"OMP_NUM_THREADS": "3"}, root=root) == (5, "cpu_threads (--cpu-threads)")
    assert resolve_cpu_threads(None, 2, environ={"OMP_NUM_THREADS": "3"}, root=root) == (3, "OMP_NUM_THREADS")
    assert resolve_cpu_threads(None, 2, environ={"OMP_NUM_THREADS": "4,2"}, root=root)[0] == 4  # nested levels
    assert resolve_cpu_threads(None, 2, environ={"OMP_NUM_THREADS": "lots"}, root=root)[0] == 3  # ignored


def test_engine_config_carries_the_count_and_a_bad_flag_is_named(tmp_path):
    args = {"model": "llama-3.2-1b", "load_format": "dummy", "device": "cpu"}
    assert EngineArgs(**args, cpu_threads=2).create_engine_config().parallel.cpu_threads == 2
    with pytest.raises(ValueError, match=r"cpu_threads \(--cpu-threads\) must be a positive integer, got 0"):
        EngineArgs(**args, cpu_threads=0).create_engine_config()
    with pytest.raises(ValueError, match=r"engine_step_timeout \(--engine-step-timeout\) must be a number of seconds"):
        EngineArgs(**args, engine_step_timeout=-1).create_engine_config()
