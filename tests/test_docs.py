"""The documentation is tested: every Python block runs, and the site builds strictly.

Every ```python block of ``README.md`` and ``docs/**/*.md`` is executed, in page
order, the blocks of one page sharing one namespace (as a reader runs them one
after the other). Two HTML comments, invisible on GitHub and on the site, may
stand on the lines right before a block:

* ``<!-- setup: NAME -->`` runs the hidden setup ``NAME`` (below, :data:`SETUPS`)
  into the page's namespace first. The setups define what the text takes as
  given (``model``, ``batch``, ``loss_fn``, ``opt``, a Trainer's ``args``, ...)
  with the small models of :mod:`gradckpt.testing` and
  :mod:`gradckpt.integrations.hf.zoo`, built from configs with random weights,
  where the text shows big ones.
* ``<!-- not-run: REASON -->`` marks a block that cannot run here (CUDA, several
  processes, a download); the reason is required and the marked blocks are counted.

Blocks run in a temporary working directory (files they write, such as
``plan.json``, land there) with one thread, so the timing is that of CI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# The test command CI runs, copied from the README: it must stay there verbatim.
TEST_COMMAND = (
    'python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e ".[test]" '
    "&& .venv/bin/python -m pytest"
)
DEMO_COMMAND = (
    'python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e ".[demo]" '
    "&& .venv/bin/gradckpt demo"
)
README_MAX_LINES = 300

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[A-Za-z0-9_+-]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<key>setup|not-run)\s*:(?P<value>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a page, with the directives written right before it."""

    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    setup: str | None
    not_run: str | None  # the reason, when the block is marked not to run


def _directives(lines: list[str], fence_index: int) -> dict[str, str]:
    """The ``<!-- key: value -->`` comments on the lines just above the fence."""
    found: dict[str, str] = {}
    i = fence_index - 1
    while i >= 0 and (m := _DIRECTIVE.match(lines[i])):
        found[m["key"]] = m["value"].strip()
        i -= 1
    return found


def python_blocks(page: Path) -> list[Block]:
    """Every ```python block of ``page`` (indented ones too), in order."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m["indent"], i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # past the closing fence
        if m["lang"] in ("python", "py", "python3", "pycon"):
            d = _directives(lines, start)
            blocks.append(
                Block(page, start + 1, "\n".join(body) + "\n", d.get("setup"), d.get("not-run"))
            )
    return blocks


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ---------------------------------------------------------------- hidden setups
# Each takes the page's namespace and the temporary directory and fills in the
# names the text takes as given. Keep them small: the whole file runs in CI.


def _imports(ns: dict[str, Any]) -> None:
    import gradckpt

    ns.update(torch=torch, gradckpt=gradckpt)


def _hf_gpt2(ns: dict[str, Any], tmp: Path, *, layers: int = 2, seq: int = 32) -> None:
    """``model`` (a GPT-2 from a config), its ``batch``, ``loss_fn`` and an AdamW ``opt``."""
    from gradckpt.integrations.hf.zoo import hf_example

    _imports(ns)
    ex = hf_example("gpt2", layers=layers, hidden=64, seq=seq, batch=2)
    ns.update(model=ex.model, batch=ex.inputs, loss_fn=ex.loss_fn)
    ns["opt"] = torch.optim.AdamW(ex.model.parameters(), lr=1e-4)


def _hf_gpt2_shapes(ns: dict[str, Any], tmp: Path) -> None:
    """The GPT-2 above, ``batch_128`` (sequence length 128) and a ``loader`` of other lengths."""
    from gradckpt.integrations.hf.zoo import hf_example

    _imports(ns)
    ex = hf_example("gpt2", layers=2, hidden=64, seq=128, batch=2)
    g = torch.Generator().manual_seed(0)

    def tokens(length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 128, (2, length), generator=g)
        return {"input_ids": ids, "labels": ids}

    ns.update(model=ex.model, batch_128=ex.inputs, loader=[tokens(n) for n in (64, 96, 128, 64)])


def _zoo_gpt(ns: dict[str, Any], tmp: Path) -> None:
    """``model`` and ``loss_fn``: the tiny GPT of :mod:`gradckpt.testing`."""
    from gradckpt.testing import make

    _imports(ns)
    ex = make("gpt", layers=4)
    ns.update(model=ex.model, loss_fn=ex.loss_fn)


def _pipeline_stage(ns: dict[str, Any], tmp: Path) -> None:
    """Rank 0 of 2 pipeline stages (no process group: ``gather_stage_plans`` returns this
    rank's plan alone): ``stage_module``, one micro-batch ``x_mb``/``y_mb``, ``loss_fn``."""
    from gradckpt.testing.pipelines import gpt_stages, next_token_loss

    _imports(ns)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    ns.update(stage_module=gpt_stages(2, layers=4, seq=32)[0], rank=0, world=2,
              x_mb=ids[:, :-1], y_mb=ids[:, 1:], loss_fn=next_token_loss)  # fmt: skip


def _saved_plan(ns: dict[str, Any], tmp: Path) -> None:
    """The tiny GPT and a ``plan.json`` made for it in the working directory."""
    _zoo_gpt(ns, tmp)
    gradckpt = ns["gradckpt"]
    gradckpt.plan(ns["model"], ns["loss_fn"], 0.8).save("plan.json")


def _profile_and_plan(ns: dict[str, Any], tmp: Path) -> None:
    """The tiny GPT, its ``profile`` and a ``plan`` made from it."""
    _zoo_gpt(ns, tmp)
    gradckpt = ns["gradckpt"]
    ns["profile"] = prof = gradckpt.profile(ns["model"], ns["loss_fn"])
    ns["plan"] = gradckpt.plan(ns["model"], ns["loss_fn"], 0.8, profiling=gradckpt.ProfileOptions(profile=prof))


def _token_data(n: int = 8, seq: int = 32) -> Any:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (n, seq), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer_args(tmp: Path, **options: Any) -> Any:
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(tmp / "trainer"), max_steps=3, per_device_train_batch_size=2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    settings.update(options)
    return TrainingArguments(**settings)


def _hf_trainer(ns: dict[str, Any], tmp: Path) -> None:
    """A GPT-2 ``model``, Trainer ``args`` (3 steps, nothing saved), ``data`` and ``Trainer``."""
    from transformers import Trainer

    _hf_gpt2(ns, tmp)
    ns.update(Trainer=Trainer, args=_trainer_args(tmp), data=_token_data())


def _hf_tune(ns: dict[str, Any], tmp: Path) -> None:
    """A GPT-2, its ``make_loss``, Trainer ``args`` (global batch 4), ``train_dataset``, ``collator``."""
    from transformers import Trainer, default_data_collator

    from gradckpt.tuning import sliced_loss

    _hf_gpt2(ns, tmp, layers=1, seq=8)  # tune profiles every divisor of the global batch
    ns.update(
        Trainer=Trainer,
        make_loss=sliced_loss(ns["model"], ns["batch"]),
        args=_trainer_args(tmp, max_steps=2, per_device_train_batch_size=4),
        train_dataset=_token_data(),
        collator=default_data_collator,
    )


def _lightning(ns: dict[str, Any], tmp: Path) -> None:
    """``L`` (lightning.pytorch), a LightningModule ``module`` around the tiny GPT, a ``loader``."""
    import lightning.pytorch as L
    import torch.nn.functional as F

    from gradckpt.testing import GPT

    _imports(ns)
    vocab, seq = 32, 32  # many thin layers: activations dominate, so 0.5 can be planned

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(layers=8, d_model=32, heads=4, seq=seq, vocab=vocab, dropout=0.1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, vocab, (16, seq + 1), generator=g))
    ns.update(L=L, module=TinyLM(), loader=torch.utils.data.DataLoader(data, batch_size=8))


SETUPS = {
    "hf-gpt2": _hf_gpt2,
    "hf-gpt2-small": lambda ns, tmp: _hf_gpt2(ns, tmp, layers=1, seq=8),
    "hf-gpt2-shapes": _hf_gpt2_shapes,
    "zoo-gpt": _zoo_gpt,
    "pipeline-stage": _pipeline_stage,
    "saved-plan": _saved_plan,
    "profile-and-plan": _profile_and_plan,
    "hf-trainer": _hf_trainer,
    "hf-tune": _hf_tune,
    "lightning": _lightning,
}

# ---------------------------------------------------------------- the tests

ALL_BLOCKS = [b for page in PAGES for b in python_blocks(page)]
RUN_PAGES = sorted({_rel(b.page) for b in ALL_BLOCKS if b.not_run is None})


def test_every_python_fence_is_collected():
    """A block the parser missed would go untested: count the fences another way."""
    for page in PAGES:
        text = page.read_text()
        fences = len(re.findall(r"^[ \t]*```(?:python|py|python3|pycon)\b", text, re.M))
        assert fences == len(python_blocks(page)), _rel(page)
    assert len(ALL_BLOCKS) >= 10  # the docs do show code: a parser finding none is broken


def test_the_parser_reads_directives_and_indented_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- setup: zoo-gpt -->\n```python\nx = 1\n```\n\n"
        "- a list item:\n\n  <!-- not-run: needs CUDA -->\n  ```python\n  y = x.cuda()\n  ```\n\n"
        "```bash\nls\n```\n\n```python\nz = 2\n```\n"
    )
    blocks = python_blocks(page)
    assert [(b.setup, b.not_run, b.code) for b in blocks] == [
        ("zoo-gpt", None, "x = 1\n"),
        (None, "needs CUDA", "y = x.cuda()\n"),
        (None, None, "z = 2\n"),
    ]
    assert [b.line for b in blocks] == [4, 11, 19]


def test_blocks_not_run_say_why_and_are_counted():
    marked = [b for b in ALL_BLOCKS if b.not_run is not None]
    for b in marked:
        assert len(b.not_run) >= 8, f"{_rel(b.page)}:{b.line}: a not-run block needs a reason"
    # The few blocks that cannot run on a CPU; a new one must be added here on purpose.
    assert [f"{_rel(b.page)}:{b.not_run}" for b in marked] == NOT_RUN, marked


NOT_RUN: list[str] = []


def test_setups_named_exist():
    for b in ALL_BLOCKS:
        assert b.setup is None or b.setup in SETUPS, f"{_rel(b.page)}:{b.line}: setup {b.setup!r}"


# (setup, code) of the blocks that ran: a block repeated on another page (the
# quickstart on the README and the site's home) with the same hidden setup, which
# defines every name it reads, runs once per session, unless a later block of its
# page reads on from it (one without a setup of its own).
_RAN: set[tuple[str, str]] = set()


def _ran_already(b: Block, following: Block | None) -> bool:
    repeated = b.setup is not None and (b.setup, b.code) in _RAN
    return repeated and (following is None or following.setup is not None)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ns: dict[str, Any] = {"__name__": "__docs__"}
    try:
        blocks = [b for b in ALL_BLOCKS if _rel(b.page) == page and b.not_run is None]
        for b, following in zip(blocks, [*blocks[1:], None]):
            if _ran_already(b, following):
                continue
            if b.setup is not None:
                SETUPS[b.setup](ns, tmp_path)
            with warnings.catch_warnings():
                # Messages the library prints on purpose (use_cache turned off, ...) are
                # not the test's concern here; errors still fail it. A deprecation that
                # points at a line of the docs does: the docs show the current spelling.
                warnings.simplefilter("ignore")
                for category in (DeprecationWarning, FutureWarning):
                    warnings.filterwarnings("error", category=category, module="__docs__")
                try:
                    exec(compile(b.code, f"{page}:{b.line}", "exec"), ns)
                except Exception as e:
                    raise AssertionError(f"{page}:{b.line}: the block raised {e!r}") from e
            if b.setup is not None:
                _RAN.add((b.setup, b.code))
    finally:
        torch.set_num_threads(threads)


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert TEST_COMMAND in text  # CI runs exactly this line
    assert DEMO_COMMAND in text


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page or an API name gone fails."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()
