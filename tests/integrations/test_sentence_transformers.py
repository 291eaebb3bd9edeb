"""A sentence-transformers bi-encoder: one model called twice per step, at two lengths.

``MultipleNegativesRankingLoss`` runs the anchors (16 tokens) and the positives
(48 tokens) through the same ``SentenceTransformer``. The plan is for that
sequence of calls: every step holds the budget at the allocator with the plain
run's gradients (dropout on). A plan fitted on the anchors alone is warned about
at the first step that calls it twice, and planned for both before the next.
The model is a tiny BERT built from a config, its tokenizer from a word list:
nothing is downloaded.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from transformers import BertConfig, BertModel, BertTokenizerFast

import gradckpt

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, WIDTH, BATCH = 125, 64, 16


def _bi_encoder(path) -> SentenceTransformer:
    words = [f"w{i}" for i in range(VOCAB - 5)]
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4,
                            num_attention_heads=4, intermediate_size=4 * WIDTH,
                            max_position_embeddings=64)  # fmt: skip
        BertModel(config).save_pretrained(path)
    model = SentenceTransformer(modules=[Transformer(str(path)), Pooling(WIDTH)], device="cpu")
    return model.train()


def _features(length: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "token_type_ids": torch.zeros_like(ids)}  # fmt: skip


ANCHORS, POSITIVES = _features(16, 1), _features(48, 2)


def _step(model, *batches):
    loss = MultipleNegativesRankingLoss(model)
    # A fresh dict per call, as a data loader gives: the model writes its outputs into it.
    return lambda: loss([dict(b) for b in batches], None)


def _same(grads, ref):
    return grads.keys() == ref.keys() and all(torch.equal(grads[k], ref[k]) for k in ref)


def test_a_bi_encoder_at_two_lengths_holds_the_budget_with_plain_gradients(tmp_path, peak_and_grads):
    model = _bi_encoder(tmp_path)
    plain = copy.deepcopy(model)
    plain_peak, _ = peak_and_grads(plain, _step(plain, ANCHORS, POSITIVES))
    budget = int(0.7 * plain_peak)
    gradckpt.fit(model, _step(model, ANCHORS, POSITIVES), budget)
    for seed in range(5):
        peak, grads = peak_and_grads(model, _step(model, ANCHORS, POSITIVES), seed)
        _, ref = peak_and_grads(plain, _step(plain, ANCHORS, POSITIVES), seed)
        assert peak <= budget, (seed, peak, budget)
        assert _same(grads, ref), seed
    stats = gradckpt.shape_stats(model)
    assert stats.replans == 0 and stats.warnings == 0 and " then " in stats.active


def test_a_bi_encoder_fitted_on_its_anchors_is_warned_once_then_holds_the_budget(
    tmp_path, peak_and_grads
):
    model = _bi_encoder(tmp_path)
    plain = copy.deepcopy(model)
    plain_peak, _ = peak_and_grads(plain, _step(plain, ANCHORS, POSITIVES))
    budget = int(0.7 * plain_peak)
    anchors_only = MultipleNegativesRankingLoss(model)
    gradckpt.fit(model, lambda: anchors_only([dict(ANCHORS), dict(ANCHORS)], None), budget)
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(4):
            peak, grads = peak_and_grads(model, _step(model, ANCHORS, POSITIVES), seed)
            _, ref = peak_and_grads(plain, _step(plain, ANCHORS, POSITIVES), seed)
            peaks.append(peak)
            assert _same(grads, ref), seed
    said = [str(w.message) for w in caught if "did not foresee" in str(w.message)]
    # Never silently over: a step over the budget is the one the warning names.
    over = [i for i, p in enumerate(peaks) if p > budget]
    assert over in ([], [0]), (peaks, budget)
    assert len(said) == 1 and "predicted to peak at" in said[0]
