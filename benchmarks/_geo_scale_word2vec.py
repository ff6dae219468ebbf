"""The word2vec job of ``benchmarks/geo_scale.py``: skip-gram with negative sampling over
the planted-topic corpus of ``examples/word2vec/make_corpus.py``.

One table holds both vector sets (as the example's two tables do): a word's input vector
under its id, its output vector under ``1 << 32 | id``. An example is a center word, a
context word from its sentence (window 2) and 5 negatives drawn from the unigram
distribution: 7 keys, no dense part. The metric is the example's: the mean loss of
held-out (center, context + negatives) examples.
"""

from __future__ import annotations

import os
import sys
from typing import Dict

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "word2vec"))
import make_corpus  # noqa: E402  (the planted-topic corpus)

NEGATIVES, WINDOW = 5, 2
FIELDS, INTS = 2 + NEGATIVES, 0
OUTPUT = np.int64(1) << 32  # an output vector's key: OUTPUT | word


def data(rows: int, eval_rows: int, seed: int, topics: int = 20, per_topic: int = 100):
    """(train, eval): dicts of ``keys`` [n, 7] int64 (center, context, negatives), ``x``
    [n, 0], ``y`` [n] (unused); the example's corpus shape: 20 topics x 100 words."""
    text = make_corpus.make(max(1, (rows + eval_rows) // 10), seed, topics, per_topic)
    sentences = [line.split() for line in text.splitlines() if line]
    vocab = {w: i for i, w in enumerate(sorted({w for s in sentences for w in s}))}
    tokens = np.array([vocab[w] for s in sentences for w in s], np.int64)
    sentence = np.repeat(np.arange(len(sentences)), [len(s) for s in sentences])
    rng = np.random.default_rng(seed)

    def part(n):
        center = rng.integers(0, len(tokens), size=n)
        offset = rng.integers(1, WINDOW + 1, size=n) * rng.choice([-1, 1], size=n)
        context = np.clip(center + offset, 0, len(tokens) - 1)
        context = np.where(sentence[context] == sentence[center], context,
                           np.clip(center - np.sign(offset), 0, len(tokens) - 1))
        negatives = tokens[rng.integers(0, len(tokens), size=(n, NEGATIVES))]
        keys = np.concatenate([tokens[center][:, None],
                               OUTPUT | tokens[context][:, None], OUTPUT | negatives], axis=1)
        return {"keys": keys, "x": np.zeros((n, INTS), np.float32),
                "y": np.zeros(n, np.float32)}

    return part(rows), part(eval_rows)


class NoDense:
    """word2vec has no dense part."""

    def __init__(self, *_, **__):
        self.vars = []

    def values(self):
        return []


INIT_STDDEV = 0.1  # the example's initializer


def per_example(rows) -> tf.Tensor:
    """The skip-gram loss of each example of a batch's rows [b, 7, dim]: the context is
    the positive, the negatives the rest."""
    logits = tf.einsum("bd,bkd->bk", rows[:, 0], rows[:, 1:])
    labels = tf.concat([tf.ones_like(logits[:, :1]), tf.zeros_like(logits[:, 1:])], axis=1)
    return tf.reduce_sum(
        tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits), axis=1)


def objective(rows) -> tf.Tensor:
    """What a step minimizes: the sum over the batch (the example's objective; a mean
    would shrink each row's gradient by the batch size under Adagrad's start)."""
    return tf.reduce_sum(per_example(rows))


def metrics(rows_of, e) -> Dict[str, float]:
    """The held-out loss; ``rows_of(keys)``: the table's rows of keys [n, 7]."""
    total = sum(float(objective(rows_of(tf.constant(e["keys"][i:i + 8192]))))
                for i in range(0, len(e["keys"]), 8192))
    return {"loss": round(total / len(e["keys"]), 5)}
