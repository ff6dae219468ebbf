"""Synthetic click logs in the Criteo Kaggle / Criteo 1TB text format, from a planted model.

One example a line, tab-separated: the label (0/1), 13 integer fields (counts, heavy
tailed, some negative, any may be empty), 26 categorical fields of 8 hex characters
(any may be empty). As in the real logs, the same hex value can stand in two fields for
two different things: a model must tell the fields apart.

The planted model (what makes a click):

* per field, a weight for each value: Zipf-distributed draws make a few values frequent
  (their weights carry the signal) and a long tail rare (small weights: noise a model
  cannot learn from a few sightings); vocabularies from 3 values to millions, shaped
  like Criteo's;
* crossed fields: a weight per combination of two small fields (an interaction a linear
  model cannot express: the deep part, or DeepFM's FM part, must learn it), and latent
  factor interactions between the frequent values of four field pairs;
* the integer fields through ``log1p``, one of them non-monotone;
* a bias putting the click rate near Criteo's ~25%.

It prints the planted model's eval AUC and log loss (the probabilities the labels were
drawn from: the best any model can do on this eval file) and writes them to
``<out>/planted.json`` with the row counts.

  python examples/criteo/make_data.py --out data/criteo --train_rows 300000 --eval_rows 30000
  python examples/criteo/make_data.py --out data/big --train_rows 4000000 --files 8

Files: ``<out>/train-00000-of-0000N.txt`` ..., ``<out>/eval.txt``, ``<out>/planted.json``.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

INT_FIELDS, CAT_FIELDS = 13, 26
# Vocabulary sizes shaped like Criteo's (the largest cut to keep memory modest).
VOCAB = [1460, 583, 2_000_000, 800_000, 305, 24, 12_517, 633, 3, 93_145, 5_683,
         1_500_000, 3_194, 27, 14_992, 1_000_000, 10, 5_652, 2_173, 4, 1_200_000, 18, 15,
         286_181, 105, 142_572]
ZIPF = [1.25, 1.2, 1.1, 1.1, 1.4, 1.5, 1.2, 1.3, 2.0, 1.15, 1.2, 1.1, 1.2, 1.5, 1.2, 1.1,
        1.6, 1.2, 1.2, 1.8, 1.1, 1.5, 1.5, 1.15, 1.3, 1.15]
CAT_MISSING = [0.0] * 18 + [0.4, 0.4, 0.0, 0.0, 0.35, 0.0, 0.4, 0.4]
INT_MISSING = [0.45, 0.0, 0.2, 0.2, 0.03, 0.2, 0.04, 0.0, 0.04, 0.45, 0.04, 0.75, 0.2]
HEAD = 300           # values per field with a full weight (the frequent ones)
CROSSES = [(8, 19), (16, 8), (19, 22)]   # small fields whose combinations have a weight
FACTORS = [(0, 1), (4, 6), (9, 12), (2, 14)]  # field pairs with latent interactions
RANK = 4


class Planted:
    """The planted model's parameters, drawn from ``seed`` (the same on every call)."""

    def __init__(self, seed: int = 7):
        rng = np.random.default_rng(seed)
        self.scale = rng.uniform(0.1, 0.4, CAT_FIELDS)
        # Weights of the head values, of a field's missing value, and the tail's scale.
        self.head = [rng.normal(0, 1, min(HEAD, v) + 1) * s for v, s in zip(VOCAB, self.scale)]
        self.tail_scale = 0.08 * self.scale
        self.cross = {pair: rng.normal(0, 0.6, (VOCAB[pair[0]] + 1) * (VOCAB[pair[1]] + 1))
                      for pair in CROSSES}
        self.factors = {f: rng.normal(0, 0.4, (min(HEAD, VOCAB[f]) + 1, RANK))
                        for pair in FACTORS for f in pair}
        self.dense = rng.normal(0, 0.15, INT_FIELDS)
        self.bias = 0.0  # set by calibrate()

    def logit(self, ids: np.ndarray, ints: np.ndarray, ints_missing: np.ndarray) -> np.ndarray:
        """``ids`` [n, 26]: value index per field (0: missing, 1..V); ``ints`` [n, 13]."""
        n = ids.shape[0]
        z = np.full(n, self.bias)
        for f in range(CAT_FIELDS):
            head = np.minimum(ids[:, f], len(self.head[f]) - 1)
            in_head = ids[:, f] < len(self.head[f])
            tail = _hash_normal(ids[:, f], f) * self.tail_scale[f]
            z += np.where(in_head, self.head[f][head], tail)
        for a, b in CROSSES:
            z += self.cross[(a, b)][ids[:, a] * (VOCAB[b] + 1) + ids[:, b]]
        for a, b in FACTORS:
            fa, fb = self.factors[a], self.factors[b]
            va = np.where((ids[:, a] < len(fa))[:, None], fa[np.minimum(ids[:, a], len(fa) - 1)], 0)
            vb = np.where((ids[:, b] < len(fb))[:, None], fb[np.minimum(ids[:, b], len(fb) - 1)], 0)
            z += (va * vb).sum(1)
        x = np.log1p(np.maximum(ints, 0)) * ~ints_missing
        z += (x - 1.5) @ self.dense
        z += 0.6 * np.sin(1.3 * x[:, 4]) - 0.15 * x[:, 1] * x[:, 6] / 4
        return z

    def calibrate(self, ids, ints, missing, rate: float = 0.25) -> None:
        """The bias giving a mean click probability of ``rate``."""
        base = self.logit(ids, ints, missing) - self.bias
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if _sigmoid(base + mid).mean() > rate:
                hi = mid
            else:
                lo = mid
        self.bias = (lo + hi) / 2


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _hash_normal(values: np.ndarray, salt: int) -> np.ndarray:
    """A fixed N(0, 1)-ish draw per (value, salt), without storing millions of weights."""
    salt = np.uint64((salt * 0x632BE59BD9B4E019 + 1) % (1 << 64))
    h = (values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + salt) \
        & np.uint64(0xFFFFFFFFFFFF)
    u = (h.astype(np.float64) + 0.5) / float(1 << 48)
    return np.sqrt(-2 * np.log(u)) * np.cos(2 * np.pi * ((h >> np.uint64(7)) % np.uint64(997))
                                             / 997.0)


def draw(rng, n: int):
    """``n`` examples: value indices [n, 26] (0: missing), ints [n, 13], missing [n, 13]."""
    ids = np.empty((n, CAT_FIELDS), np.int64)
    for f, (v, a) in enumerate(zip(VOCAB, ZIPF)):
        z = rng.zipf(a, n)
        z = np.where(z <= v, z, rng.integers(1, v + 1, n))  # the rest of the tail: uniform
        if CAT_MISSING[f]:
            z[rng.random(n) < CAT_MISSING[f]] = 0
        ids[:, f] = z
    ints = np.floor(rng.lognormal(mean=np.linspace(0.3, 3.0, INT_FIELDS), sigma=1.3,
                                  size=(n, INT_FIELDS))).astype(np.int64)
    ints[:, 1] -= 2  # like Criteo's I2: small negatives occur
    missing = rng.random((n, INT_FIELDS)) < np.array(INT_MISSING)
    return ids, ints, missing


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def hex_values(ids: np.ndarray) -> np.ndarray:
    """Each value index as 8 hex characters, not salted by field (two fields share
    strings, as in Criteo); missing (0) as ''."""
    h = ((ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(40503))
         & np.uint64(0xFFFFFFFF))
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    digits = _HEX[((h[..., None] >> shifts) & np.uint64(0xF)).astype(np.int64)]
    text = digits.reshape(-1).view("S8").reshape(ids.shape).astype(str)
    return np.where(ids == 0, "", text)


def lines(labels, ids, ints, missing):
    """The examples as Criteo text lines."""
    cols = [labels.astype(str)]
    int_text = ints.astype(str)
    cols += [np.where(missing[:, j], "", int_text[:, j]) for j in range(INT_FIELDS)]
    cat_text = hex_values(ids)
    cols += [cat_text[:, f] for f in range(CAT_FIELDS)]
    return "".join(map(lambda row: "\t".join(row) + "\n", zip(*[c.tolist() for c in cols])))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve: the rank statistic, ties given their mean rank."""
    _, where, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = ((ends - counts + 1 + ends) / 2.0)[where]
    pos = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auc: needs both classes, got {n_pos} positive and {n_neg} negative")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def write(path: str, rng, planted: Planted, rows: int, chunk: int = 100_000):
    """Writes ``rows`` examples; returns (labels, probabilities)."""
    labels, probs = [], []
    with open(path, "w") as f:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            ids, ints, missing = draw(rng, n)
            p = _sigmoid(planted.logit(ids, ints, missing))
            y = (rng.random(n) < p).astype(np.int64)
            f.write(lines(y, ids, ints, missing))
            labels.append(y)
            probs.append(p)
    return np.concatenate(labels), np.concatenate(probs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--train_rows", type=int, default=300_000)
    p.add_argument("--eval_rows", type=int, default=30_000)
    p.add_argument("--files", type=int, default=1, help="training files")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("train_rows", "eval_rows", "files"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    planted = Planted()
    calib = np.random.default_rng(10_000)
    planted.calibrate(*draw(calib, 200_000))
    rng = np.random.default_rng(args.seed)
    per_file = math.ceil(args.train_rows / args.files)
    train_labels = []
    for i in range(args.files):
        rows = min(per_file, args.train_rows - i * per_file)
        path = os.path.join(args.out, f"train-{i:05d}-of-{args.files:05d}.txt")
        train_labels.append(write(path, rng, planted, rows)[0])
    eval_labels, eval_probs = write(os.path.join(args.out, "eval.txt"),
                                    np.random.default_rng(args.seed + 1000), planted,
                                    args.eval_rows)
    summary = {"train_rows": args.train_rows, "eval_rows": args.eval_rows, "files": args.files,
               "click_rate": float(np.concatenate(train_labels).mean()),
               "planted_auc": auc(eval_labels, eval_probs),
               "planted_logloss": logloss(eval_labels, eval_probs)}
    with open(os.path.join(args.out, "planted.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {args.train_rows} training rows ({args.files} file(s)) and {args.eval_rows} "
          f"eval rows to {args.out} in {time.time() - start:.1f} s; click rate "
          f"{summary['click_rate']:.3f}; planted model on the eval rows: auc "
          f"{summary['planted_auc']:.4f} logloss {summary['planted_logloss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
