"""The profiler: what it records, and that it leaves the model exactly as found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.measure import AllocatorTracker, MemoryTracker
from gradckpt.profiling import NEVER, ProfileError, find_blocks, profile
from gradckpt.testing import make


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "unet", "bn_convnet"])
def test_peaks_equal_the_tracker_and_the_allocator(name):
    ex = make(name)
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    torch.manual_seed(0)
    with MemoryTracker(ex.model) as tracker:
        ex.loss_fn().backward()
    ex.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with AllocatorTracker() as allocator:
        ex.loss_fn().backward()
    assert prof.peak_level == "allocator"
    assert prof.tracker_peak_bytes == tracker.peak_bytes
    assert prof.measured_peak_bytes == prof.param_bytes + allocator.peak_bytes


def test_model_state_is_bit_identical_after_profiling():
    ex = make("bn_convnet")
    model = ex.model
    torch.manual_seed(3)
    ex.loss_fn().backward()  # existing gradients must survive profiling
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    grad_objects = {k: p.grad for k, p in model.named_parameters()}
    rng = torch.get_rng_state()
    profile(model, ex.loss_fn, repeats=2)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, p in model.named_parameters():
        assert p.grad is grad_objects[k] and torch.equal(p.grad, grads[k])
    assert "forward" not in model.__dict__
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_units_are_blocks_and_the_modules_between_them():
    ex = make("gpt")
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    paths = [u.path for u in prof.units]
    assert [u.path for u in prof.blocks] == ex.block_paths
    assert paths[0] == "tok_emb" and paths[-1] == "lm_head"
    assert all(u.chained for u in prof.blocks[1:])
    for u in prof.units:
        ops = prof.unit_ops(u)
        assert all(op.unit == u.index and op.local == i for i, op in enumerate(ops))


def test_saved_tensors_and_their_lifetimes_are_recorded():
    ex = make("mlp")
    prof = profile(ex.model, ex.loss_fn, repeats=1)
    assert prof.packs and all(p.position < p.unpack < NEVER for p in prof.packs if p.storage >= 0)
    freed_in_forward = [s for s in prof.storages if s.natural_free < NEVER]
    assert freed_in_forward
    # A storage autograd keeps dies later in the plain step than it would naturally.
    kept = {p.storage for p in prof.packs if p.storage >= 0}
    assert all(prof.storages[s].free >= prof.storages[s].natural_free for s in kept)
    assert any(op.backward and op.unit >= 0 for op in prof.ops)


def test_profile_under_fake_tensors_matches_the_real_step():
    ex = make("gpt")
    real = profile(ex.model, ex.loss_fn, repeats=1)
    fake = profile(ex.model, ex.loss_fn, fake=True)
    assert fake.fake and fake.measured_peak_bytes == real.tracker_peak_bytes
    assert fake.peak_level == "tensors" and all(o.workspace == 0 for o in fake.ops)
    assert [o.name for o in fake.ops] == [o.name for o in real.ops]
    assert fake.step_time > 0 and all(o.time >= 0 for o in fake.ops)


def test_meta_model_is_profiled_without_allocating():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(4)])
    x = torch.randn(8, 4096)
    prof = profile(
        model, lambda: model(x).square().mean(), blocks=[f"{i}" for i in range(4)], fake=True
    )
    assert prof.param_bytes == 4 * (4096 * 4096 + 4096) * 4
    assert prof.measured_peak_bytes > prof.param_bytes
    assert all(p.device.type == "meta" for p in model.parameters())


def test_blocks_given_by_path_or_predicate():
    ex = make("resnet")
    assert find_blocks(ex.model, ["layer1.0"]) == ["layer1.0"]
    found = find_blocks(ex.model, lambda path, m: type(m).__name__ == "BasicBlock")
    assert found == ex.block_paths
    with pytest.raises(ValueError, match="does not have"):
        find_blocks(ex.model, ["layer9"])
    with pytest.raises(TypeError, match="list of module paths"):
        find_blocks(ex.model, "layer1.0")


def test_bad_loss_fn_is_refused_clearly():
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with pytest.raises(ProfileError, match="scalar loss"):
        profile(model, lambda: model(x))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        profile(lambda: 0, lambda: model(x).sum())


def test_callable_package_profiles():
    ex = make("mlp")
    assert gradckpt.profile(ex.model, ex.loss_fn, repeats=1).measured_peak_bytes > 0


def test_a_module_shared_by_two_parents_is_a_unit_per_call_and_is_left_clean():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h):
            return torch.tanh(self.lin(h))

    class Stack(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = block(h)
            return h

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            shared = nn.Linear(8, 8)
            self.enc, self.dec = Stack(shared), Stack(shared)

        def forward(self, x):
            return self.dec(self.enc(x))

    model = Model()
    prof = profile(model, lambda: model(torch.randn(4, 8)).sum(), repeats=1)
    # One module (named by its first path), called twice: a unit per call, in call order.
    paths = [u.path for u in prof.units]
    assert paths == [
        "enc.emb#0", "enc.blocks.0", "enc.blocks.1", "enc.emb#1", "dec.blocks.0", "dec.blocks.1"
    ]  # fmt: skip
    assert [(u.calls, u.call) for u in prof.units if u.module_path == "enc.emb"] == [(2, 0), (2, 1)]
    assert all("forward" not in m.__dict__ for m in model.modules())
