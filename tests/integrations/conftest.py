"""Fixtures shared by the integration tests.

``launch_ranks``: run a test file as ``world`` gloo ranks in subprocesses and collect what each saved.

Each rank runs ``python <script> <args...>`` with the torch.distributed
environment of a free loopback port and writes ``rank{r}.pt`` into ``out_dir``;
a rank that fails or outlives ``timeout_s`` fails the test with its log's tail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: str, args: list[str], out_dir: Path, world: int, timeout_s: int) -> list[dict]:
    """Every rank's saved results, in rank order."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )  # fmt: skip
        log = open(out_dir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = "\n".join(f"--- rank {i} (exit {rc}) ---\n{texts[i][-3000:]}" for i, rc in failed)
        pytest.fail(f"{Path(script).name} {' '.join(args)}: ranks failed or timed out "
                    f"({timeout_s}s):\n{tail}")  # fmt: skip
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="session")
def launch_ranks():
    """:func:`_launch`: ``launch_ranks(__file__, args, out_dir, world, timeout_s)``."""
    return _launch


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences, labels = inputs (causal LM), for the Trainer tests."""

    def __init__(self, n: int = 16, seed: int = 3, *, vocab: int = 128, seq: int = 32) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
