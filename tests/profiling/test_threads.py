"""Two models fitted at once from two threads: they take turns at torch's profiler.

Torch's profiler is one per process; before the lock two ``fit`` calls in two
threads crashed the process (SIGSEGV in kineto) or measured each other's
allocations. The threads run in a child interpreter so a crash fails the test
instead of killing pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import json, threading
    import torch
    import gradckpt
    from gradckpt.measure import AllocatorTracker, state_bytes
    from gradckpt.testing import make

    def example(seed):
        return make("mlp", blocks=4, width=64, hidden=256, batch=256, seed=seed)

    def allocator_peak(ex):
        ex.model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with AllocatorTracker() as at:
            ex.loss_fn().backward()
        ex.model.zero_grad(set_to_none=True)
        return state_bytes(ex.model) + at.peak_bytes

    # What each model's profile says when profiled alone.
    alone = {}
    for seed in (0, 1):
        prof = gradckpt.profile(example(seed).model, example(seed).loss_fn, repeats=1)
        alone[seed] = prof.measured_peak_bytes

    examples = {seed: example(seed) for seed in (0, 1)}
    plans, errors = {}, {}
    barrier = threading.Barrier(2)

    def work(seed):
        ex = examples[seed]
        barrier.wait()  # both start at once
        try:
            plans[seed] = gradckpt.fit(ex.model, ex.loss_fn, budget=0.7)
        except BaseException as e:
            errors[seed] = repr(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"errors": errors, "alone": alone, "plans": {}}
    for seed, plan in plans.items():
        out["plans"][seed] = {
            "baseline": plan.baseline_peak_bytes,
            "predicted": plan.predicted_peak_bytes,
            "budget": plan.budget_bytes,
            "measured": allocator_peak(examples[seed]),
        }
    print("RESULT " + json.dumps(out))
    """
)


def test_two_threads_fit_two_models_at_once():
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert out["errors"] == {}
    assert sorted(out["plans"]) == ["0", "1"]
    for seed, plan in out["plans"].items():
        # Each profile saw its own step only: the plain peak measured alone.
        assert plan["baseline"] == out["alone"][seed], (seed, plan, out["alone"])
        assert abs(plan["budget"] - 0.7 * plan["baseline"]) <= 1
        # The plan holds its budget at the allocator and is what was predicted.
        assert plan["measured"] <= plan["budget"], plan
        assert abs(plan["predicted"] - plan["measured"]) <= 0.02 * plan["measured"], plan
