"""budget="auto": the device's memory, less the stated headroom (gradckpt.measure.device)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from gradckpt.measure import DeviceMemory, device_memory
from gradckpt.measure import device as device_mod

GiB, MiB = 1 << 30, 1 << 20
V1_LIMIT, V1_USAGE = "memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"


@pytest.fixture
def fake_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Point the module at a tmp /proc/meminfo and cgroup folder; returns a writer."""
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    (cgroup / "memory").mkdir(parents=True)
    monkeypatch.setattr(device_mod, "_MEMINFO", meminfo)
    monkeypatch.setattr(device_mod, "_CGROUP", cgroup)

    def write(total: int = 16 * GiB, available: int = 8 * GiB, files: dict | None = None) -> None:
        meminfo.write_text(
            f"MemTotal:       {total // 1024} kB\nMemFree:        1 kB\n"
            f"MemAvailable:   {available // 1024} kB\nHugePages_Total:       0\n"
        )
        for name, text in (files or {}).items():
            (cgroup / name).write_text(text + "\n")

    return write


def test_this_machine_is_sane() -> None:
    m = device_memory("cpu")
    assert m.device == "cpu" and m.held_bytes == 0
    assert 0 < m.budget_bytes < m.available_bytes <= m.total_bytes
    assert m.headroom_bytes == int(0.10 * m.available_bytes)
    assert m.line().startswith("auto budget: ") and " on cpu = " in m.line()
    assert "10% headroom" in m.rule


def test_held_bytes_are_added(fake_cpu) -> None:
    fake_cpu(available=8 * GiB)
    bare, held = device_memory("cpu"), device_memory(torch.device("cpu"), held_bytes=GiB)
    assert bare.available_bytes == 8 * GiB and bare.total_bytes == 16 * GiB
    assert held.available_bytes == 9 * GiB and held.held_bytes == GiB
    assert held.headroom_bytes == int(0.9 * GiB) and held.budget_bytes == 9 * GiB - int(0.9 * GiB)
    assert held.rule.startswith("MemAvailable 8.00 GiB + model 1.00 GiB held, less 10% headroom")
    assert held.line() == f"auto budget: 8.10 GiB on cpu = {held.rule}"


def test_cgroup_v2_limit_is_respected(fake_cpu) -> None:
    fake_cpu(available=8 * GiB, files={"memory.max": str(GiB), "memory.current": str(256 * MiB)})
    m = device_memory("cpu", held_bytes=100)
    assert m.available_bytes == 768 * MiB + 100 and m.total_bytes == 16 * GiB
    assert "cgroup limit free 0.75 GiB" in m.rule


def test_cgroup_v1_limit_is_respected(fake_cpu) -> None:
    fake_cpu(files={V1_LIMIT: str(2 * GiB), V1_USAGE: str(GiB)})
    assert device_memory("cpu").available_bytes == GiB


@pytest.mark.parametrize(
    "files",
    [
        {"memory.max": "max", "memory.current": str(GiB)},  # v2: no limit
        {V1_LIMIT: "9223372036854771712", V1_USAGE: str(GiB)},  # v1: no limit
        {"memory.max": str(64 * GiB), "memory.current": str(GiB)},  # looser than MemAvailable
        {},  # no cgroup files at all
    ],
)  # fmt: skip
def test_no_binding_cgroup_limit_leaves_memavailable(fake_cpu, files: dict[str, str]) -> None:
    fake_cpu(available=8 * GiB, files=files)
    m = device_memory("cpu")
    assert m.available_bytes == 8 * GiB and m.rule.startswith("MemAvailable")


def test_without_meminfo_sysconf_is_used(fake_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 4000}
    monkeypatch.setattr(device_mod.os, "sysconf", lambda name: pages[name])
    m = device_memory("cpu", held_bytes=10)
    assert (m.available_bytes, m.total_bytes) == (4096 * 1000 + 10, 4096 * 4000)


def test_no_way_to_read_memory_says_give_bytes(fake_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sysconf(name: str) -> int:
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(device_mod.os, "sysconf", no_sysconf)
    with pytest.raises(ValueError, match="budget in bytes"):
        device_memory("cpu")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """A pretend GPU: (free, total) and reserved bytes per index."""
    gpus = {0: (30 * GiB, 80 * GiB, 2 * GiB), 1: (GiB, 2 * GiB, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: gpus[i][:2])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: gpus[i][2])
    return gpus


def test_cuda_arithmetic(fake_cuda) -> None:
    m = device_memory("cuda", held_bytes=123)  # held_bytes is the CPU's; reserved counts here
    assert m.device == "cuda:0" and m.total_bytes == 80 * GiB
    assert m.available_bytes == 32 * GiB and m.held_bytes == 2 * GiB
    assert m.headroom_bytes == int(0.05 * 80 * GiB)
    assert m.budget_bytes == 32 * GiB - int(0.05 * 80 * GiB)
    assert "free 30.00 GiB + reserved 2.00 GiB" in m.rule and "max(5% of 80.00 GiB" in m.rule


def test_cuda_small_device_keeps_256_mib(fake_cuda) -> None:
    m = device_memory(torch.device("cuda", 1))
    assert m.device == "cuda:1" and m.headroom_bytes == 256 * MiB
    assert m.budget_bytes == GiB - 256 * MiB


def test_cuda_reserve_fraction_overrides_the_percentage(fake_cuda) -> None:
    m = device_memory("cuda:0", reserve_fraction=0.12)
    assert m.headroom_bytes == int(0.12 * 80 * GiB) and "max(12% of" in m.rule
    assert device_memory("cuda:1", reserve_fraction=0.01).headroom_bytes == 256 * MiB


def test_cuda_not_available_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"CUDA is not available.*bytes"):
        device_memory("cuda:0")


def test_meta_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    for dev in ("meta", next(model.parameters()).device):
        with pytest.raises(ValueError, match=r"needs the real device.*budget in bytes"):
            device_memory(dev)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "mps"}, "not 'mps'"),
        ({"reserve_fraction": 1.0}, "reserve_fraction"),
        ({"reserve_fraction": -0.1}, "reserve_fraction"),
        ({"held_bytes": -1}, "held_bytes"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        device_memory(**kwargs)


def test_budget_never_below_zero_and_frozen() -> None:
    m = DeviceMemory("cuda:0", GiB, 100 * MiB, 0, 256 * MiB, "rule")
    assert m.budget_bytes == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.available_bytes = 1  # type: ignore[misc]
