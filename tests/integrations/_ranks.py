"""The body of a gloo rank script: run one rank's work, save what it returns, exit.

Shared by the rank scripts (``test_distributed.py``, ``test_compiled_fsdp.py``)
that ``launch_ranks`` in ``conftest.py`` runs as subprocesses.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def run_rank(work: Callable[[int, int], dict], out_dir: str) -> None:
    """Run ``work(rank, world)`` in a gloo process group and save its result.

    The process leaves with ``os._exit`` once the result is saved and the group
    destroyed: gloo's worker threads can abort interpreter finalization
    ("terminate called without an active exception", exit -6; a known torch
    teardown race, pytorch#190489) after every rank's work has finished and been
    written. A failure inside ``work`` still exits non-zero with its traceback.
    """
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = work(rank, world)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears down while another still talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
