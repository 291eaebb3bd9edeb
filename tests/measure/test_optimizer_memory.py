"""optimizer_memory: predicted on fake tensors, checked against real optimizers on the CPU.

The promise: predicted state bytes equal the real ones exactly, and the step
peaks (first step, later step) are within 2% of what the CPU allocator holds
(``AllocatorTracker``, which sees kernel-internal memory too). The models are
small, but their parameters dominate the few bytes of bookkeeping.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradckpt.measure import AllocatorTracker, OptimizerMemory, OptimizerMemoryError
from gradckpt.measure import optimizer_memory as predict

WIDTH = 256


def mlp(dtype: torch.dtype = torch.float32, grads: bool = True) -> nn.Module:
    """3 x Linear(256, 256) (789,504 fp32 bytes) on the default device, with grads."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)]).to(dtype=dtype)
    if grads:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    return model


def state_of(opt: torch.optim.Optimizer) -> int:
    sizes = {}
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                sizes[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()
    return sum(sizes.values())


def measure(build: Callable[[], torch.optim.Optimizer]) -> tuple[int, int, int]:
    """Real state bytes, first-step peak (constructor included) and later-step peak."""
    with AllocatorTracker() as first:
        opt = build()  # inside: Adagrad makes its state in the constructor
        opt.step()
    with AllocatorTracker() as later:
        opt.step()
    return state_of(opt), first.peak_bytes, later.peak_bytes


def assert_matches(om: OptimizerMemory, real: tuple[int, int, int]) -> None:
    state, first, later = real
    assert om.state_bytes == state, (om, real)
    assert abs(om.first_step_bytes - first) <= 0.02 * first, (om, real)
    assert abs(om.step_bytes - later) <= 0.02 * later, (om, real)


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    # The first step of the process sets up kernels and the profiler: not the optimizer's.
    model = mlp()
    measure(lambda: torch.optim.Adam(model.parameters(), foreach=True))
    measure(lambda: torch.optim.Adam(model.parameters()))


def lora_groups(model: nn.Module) -> list[dict]:
    """A frozen base, LoRA-like adapters in one group, a head with its own lr and decay."""
    rank = 8
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    adapters = []
    for layer in model[:2]:
        layer.lora_a = nn.Parameter(torch.randn(rank, WIDTH) / WIDTH)
        layer.lora_b = nn.Parameter(torch.zeros(WIDTH, rank))
        adapters += [layer.lora_a, layer.lora_b]
    head = list(model[2].parameters())
    for p in [*adapters, *head]:
        p.requires_grad_(True)
        p.grad = torch.randn_like(p)
    return [
        {"params": adapters, "lr": 1e-3, "weight_decay": 0.0},
        {"params": head, "lr": 1e-4, "weight_decay": 0.1},
    ]


CASES: dict[str, tuple[str, Callable[[nn.Module], torch.optim.Optimizer]]] = {
    "sgd-momentum": (
        "SGD (momentum, for-loop)",
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    ),
    "adam": ("Adam (for-loop)", lambda m: torch.optim.Adam(m.parameters())),
    "adamw-foreach": ("AdamW (foreach)", lambda m: torch.optim.AdamW(m.parameters(), foreach=True)),
    "adamw-fused": ("AdamW (fused)", lambda m: torch.optim.AdamW(m.parameters(), fused=True)),
    "adamw-default": ("AdamW (for-loop)", lambda m: torch.optim.AdamW(m.parameters())),
    "adagrad": ("Adagrad (for-loop)", lambda m: torch.optim.Adagrad(m.parameters())),
    "rmsprop": ("RMSprop (for-loop)", lambda m: torch.optim.RMSprop(m.parameters())),
    "adafactor": ("Adafactor (for-loop)", lambda m: torch.optim.Adafactor(m.parameters())),
}

# Measured on this CPU build (fp32, 3 x Linear(256, 256), 789,504 parameter bytes):
# state, first step, later step, each predicted == measured unless noted.
#   SGD momentum   789,504   789,504 (+12 predicted)    12
#   Adam           1,579,032 2,104,356                  525,324
#   AdamW foreach  1,579,032 2,368,548                  789,516
#   AdamW fused    1,579,032 1,579,044                  12
#   Adagrad        789,528   1,052,708                  263,180
#   RMSprop        789,528   1,052,696 (+12 predicted)  263,168 (+12 predicted)
#   Adafactor      9,240     275,496                    266,256
# The 12 bytes of SGD's later step are a Python number wrapped as a 0-dim double
# plus its cast to fp32, held during an op: the prediction adds them on the CPU.
# Param-group mix (AdamW, LoRA adapters + head): 591,896 / 1,116,196 / 524,300, all equal.


@pytest.mark.parametrize("case", list(CASES))
def test_prediction_matches_real_optimizer(case: str) -> None:
    name, build = CASES[case]
    model = mlp()
    om = predict(model, build(model))  # a live optimizer: a fresh one is replayed
    assert (om.name, om.method) == (name, "fake")
    assert_matches(om, measure(lambda: build(model)))


def test_param_group_mix_matches_real() -> None:
    model = mlp()
    groups = lora_groups(model)
    live = torch.optim.AdamW(groups)
    om = predict(model, live)
    trainable = sum(p.numel() * 4 for g in groups for p in g["params"])
    assert om.state_bytes == 2 * trainable + 4 * sum(len(g["params"]) for g in groups)
    fresh = [{**g, "params": list(g["params"])} for g in groups]
    assert_matches(om, measure(lambda: torch.optim.AdamW(fresh)))
    # The same model by name: AdamW over the parameters that require grad.
    assert predict(model, "adamw").state_bytes == om.state_bytes


@pytest.mark.parametrize("foreach", [False, True])
def test_bf16_params(foreach: bool) -> None:
    model = mlp(torch.bfloat16)
    om = predict(model, (torch.optim.AdamW, {"foreach": foreach}))
    # bf16 moments, fp32 'step' scalars
    assert om.state_bytes == 2 * 394_752 + 6 * 4
    assert_matches(om, measure(lambda: torch.optim.AdamW(model.parameters(), foreach=foreach)))


@pytest.mark.xfail(
    torch.backends.cpu.get_cpu_capability() != "AVX2",
    strict=True,
    reason="CPU bf16 matmul (oneDNN) takes an output-sized scratch buffer inside the kernel: "
    "Adafactor's row_var @ col_var. Measured later step 274,048 B, predicted 133,132 B "
    "(state 4,632 B exact; first step 278,680 vs 137,764). fp32 has no scratch and matches. "
    "On an AVX2-only CPU (AMD EPYC, 2026-12-02) no scratch is taken: measured 134,150 B, "
    "and the prediction holds.",
)
def test_bf16_adafactor_kernel_scratch_not_seen() -> None:
    model = mlp(torch.bfloat16)
    om = predict(model, "adafactor")
    assert_matches(om, measure(lambda: torch.optim.Adafactor(model.parameters())))


def test_live_optimizer_left_untouched() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), weight_decay=0.05)
    groups = [{k: (v if k != "params" else [id(p) for p in v]) for k, v in g.items()}
              for g in opt.param_groups]  # fmt: skip
    defaults = copy.deepcopy(opt.defaults)
    predict(model, opt)
    assert len(opt.state) == 0
    assert groups == [{k: (v if k != "params" else [id(p) for p in v]) for k, v in g.items()}
                      for g in opt.param_groups]  # fmt: skip
    assert opt.param_groups[0]["lr"] is groups[0]["lr"] and opt.defaults.keys() == defaults.keys()
    # After a real step: state, step counts and values stay as they were.
    opt.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    tensors = {id(p): dict(s) for p, s in opt.state.items()}
    om = predict(model, opt)
    assert om.state_bytes == state_of(opt)
    for p, s in opt.state.items():
        assert s.keys() == before[id(p)].keys()
        for k, v in s.items():
            assert v is tensors[id(p)][k] and torch.equal(v, before[id(p)][k])


def test_meta_model_adamw() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    om = predict(model, "AdamW")
    assert (om.name, om.method) == ("AdamW (for-loop)", "fake")
    assert om.state_bytes == 2 * param_bytes + 4 * len(params)  # moments + fp32 'step'
    assert om.step_peak_bytes >= om.state_bytes
    cuda = predict(model, "adamw", device="cuda")  # fake CUDA: torch's default is foreach
    assert cuda.name == "AdamW (foreach)" and cuda.state_bytes == om.state_bytes
    assert cuda.step_bytes == param_bytes  # one sqrt of every exp_avg_sq at once


def test_meta_model_adafactor_and_strings() -> None:
    with torch.device("meta"):
        model = mlp(grads=False)
    om = predict(model, "adafactor")  # reads .item(): answered, torch's sizes don't depend on it
    assert om.state_bytes == 9_240 and om.method == "fake"
    assert predict(model, "SGD").state_bytes == 0
    assert predict(model, (torch.optim.SGD, {"momentum": 0.9})).state_bytes == 789_504
    assert predict(model, torch.optim.RMSprop).name == "RMSprop (for-loop)"


class ItemSGD(torch.optim.Optimizer):
    """A custom optimizer whose step reads a tensor's value (no fake kernel can)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                scale = 1.0 / (1.0 + p.grad.norm().item())
                buf.mul_(0.9).add_(p.grad, alpha=scale)
                p.add_(buf, alpha=-group["lr"])


def test_custom_optimizer_reading_values_is_measured_for_real() -> None:
    model = mlp()
    om = predict(model, ItemSGD(model.parameters()))
    assert (om.name, om.method, om.state_bytes) == ("ItemSGD", "measured", 789_504)
    assert_matches(om, measure(lambda: ItemSGD(model.parameters())))
    with torch.device("meta"):
        meta = mlp(grads=False)
    with pytest.raises(OptimizerMemoryError, match=r"ItemSGD.*pass optimizer=None") as err:
        predict(meta, ItemSGD)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", [42, "nadamx", nn.Linear, (nn.Linear, {}), (torch.optim.SGD, 0.1)])
def test_not_an_optimizer(bad: object) -> None:
    with pytest.raises(OptimizerMemoryError, match="pass optimizer=None") as err:
        predict(mlp(), bad)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_json_round_trip() -> None:
    om = predict(mlp(), "adamw")
    data = json.loads(json.dumps(om.to_json()))
    assert OptimizerMemory.from_json(data) == om
    assert om.step_peak_bytes == max(om.first_step_bytes, om.state_bytes + om.step_bytes)
    with pytest.raises(ValueError, match="method"):
        OptimizerMemory("x", 0, 0, 0, "guessed")


def test_frozen_model_has_no_optimizer_memory() -> None:
    model = mlp(grads=False).requires_grad_(False)
    assert predict(model, "adam") == OptimizerMemory("Adam", 0, 0, 0, "fake")
