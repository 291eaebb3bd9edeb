"""StorageWatcher: exact bytes for known allocation sequences, on CPU, meta and fake tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gradckpt.measure import StorageWatcher, storage_key

aten = torch.ops.aten


def _known_sequence(watch, device: str = "cpu"):
    """Allocations of known sizes, views, an in-place op and frees; returns (mode, keys)."""
    with watch() as mode:
        a = torch.empty(256, device=device)  # +1024
        keys = {"a": storage_key(a)}
        v = a.view(16, 16)  # view: +0
        a.mul_(2)  # in-place: +0
        t = v.t()  # view of a view: +0
        b = torch.empty(10, 10, dtype=torch.float64, device=device)  # +800
        c = torch.empty(3, dtype=torch.int8, device=device)  # +3 -> peak 1827
        keys.update(b=storage_key(b), c=storage_key(c))
        del a  # v and t still hold a's storage
        assert mode.watcher.live_bytes == 1827
        del v, t  # -1024
        del c  # -3
        d = torch.empty(50, device=device)  # +200
        keys["d"] = storage_key(d)
        assert mode.watcher.live_bytes == 1000
    del b, d  # the mode is gone but the watcher still reports frees until close()
    return mode, keys


@pytest.mark.parametrize("where", ["cpu", "meta", "fake"])
def test_known_sequence_gives_exact_live_and_peak_bytes(watch, where):
    fake = FakeTensorMode() if where == "fake" else contextlib.nullcontext()
    with fake:
        mode, k = _known_sequence(watch, "meta" if where == "meta" else "cpu")
    assert mode.watcher.peak_bytes == 1827
    assert mode.log == [
        ("alloc", k["a"], 1024),
        ("alloc", k["b"], 800),
        ("alloc", k["c"], 3),
        ("free", k["a"], None),
        ("free", k["c"], None),
        ("alloc", k["d"], 200),
        ("free", k["b"], None),
        ("free", k["d"], None),
    ]
    assert mode.watcher.live_bytes == 0
    assert len(mode.watcher) == 0


def test_views_inplace_and_detach_of_existing_storage_allocate_nothing(watch):
    p = torch.ones(100)  # exists before: must never be counted, even when returned by an op
    with watch() as mode:
        views = [p.view(10, 10), p[1:], p.detach(), p.expand(3, 100), *p.split(25)]
        p.mul_(2)
        torch.add(p, 1, out=p)
        # _unsafe_view's schema claims a fresh result, but it is a view.
        unsafe = aten._unsafe_view(p, (10, 10))
        assert mode.watcher.live_bytes == 0
        copy = p.clone()  # the only real allocation
    assert mode.log == [("alloc", storage_key(copy), 400)]
    assert mode.watcher.live_bytes == 400
    del views, unsafe


def test_outputs_sharing_a_storage_count_once():
    watcher = StorageWatcher()
    x = torch.empty(64)
    # aten.max.dim returns two fresh tensors; here both share x's storage.
    watcher.observe(aten.max.dim, (x, x[8:]))
    assert watcher.live_bytes == 256
    assert len(watcher) == 1
    assert watcher.track(x[3:]) is False  # known storage
    watcher.observe(aten.max.dim, (x[:4], x))
    assert watcher.live_bytes == 256
    del x
    assert watcher.live_bytes == 0


def test_list_returns_are_counted_per_storage(watch):
    x = torch.ones(3, 4)
    with watch() as mode:
        copies = aten.unbind_copy.int(x)  # fresh Tensor[]: three 16-byte storages
        views = aten.unbind.int(x)  # aliasing Tensor[]: nothing
        assert mode.watcher.live_bytes == 48
    assert [entry[2] for entry in mode.log] == [16, 16, 16]
    del copies, views


def test_zero_byte_storages_are_ignored(watch):
    with watch() as mode:
        e = torch.empty(0)
        z = torch.empty(5, 0, 3)
    assert mode.log == []
    assert storage_key(e) not in mode.watcher
    del z


def test_resize_of_a_watched_storage_is_a_free_and_a_new_alloc(watch):
    with watch() as mode:
        o = torch.empty(4)  # 16 bytes
        key = storage_key(o)
        o.resize_(64)  # same storage, now 256 bytes
        assert storage_key(o) == key
        o.resize_(8)  # shrinking a tensor keeps its storage's bytes
    assert mode.log == [("alloc", key, 16), ("free", key, None), ("alloc", key, 256)]
    assert mode.watcher.live_bytes == 256
    assert mode.watcher.peak_bytes == 256
    assert mode.watcher.nbytes(key) == 256


def test_close_stops_reporting_frees(watch):
    with watch() as mode:
        a = torch.empty(10)
        b = torch.empty(20)
    del a
    assert mode.watcher.live_bytes == 80
    mode.watcher.close()
    del b
    assert mode.log[-1][0] == "free" and len(mode.log) == 3  # b's free never arrives
    assert mode.watcher.live_bytes == 80  # frozen at close
    assert len(mode.watcher) == 0


def test_storage_less_tensors_are_skipped():
    watcher = StorageWatcher()
    sparse = torch.eye(3).to_sparse()
    assert watcher.track(sparse) is False
    assert watcher.live_bytes == 0


def test_storage_key_is_shared_by_views_only():
    x = torch.empty(8)
    assert storage_key(x) == storage_key(x.view(2, 4)) == storage_key(x[2:])
    assert storage_key(x) != storage_key(x.clone())
