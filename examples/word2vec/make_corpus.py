"""Writes a small text corpus with planted structure for the word2vec example.

2,000 words in 20 topics of 100; each sentence picks a topic and draws 85% of its
words from it (Zipf-like within the topic), the rest from anywhere. Words of one topic
share contexts, so a trained skip-gram model puts them close together: the example's
similarity check compares within-topic and across-topic cosine similarity.

  python examples/word2vec/make_corpus.py [--sentences 5000] [--out corpus.txt]
"""

import argparse
import os

import numpy as np

TOPICS, PER_TOPIC, LENGTH = 20, 100, 20


def word(topic: int, rank: int) -> str:
    return f"t{topic:02d}w{rank:03d}"


def topic_of(token: str) -> int:
    return int(token[1:3])


def make(sentences: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, PER_TOPIC + 1) ** 0.8
    zipf /= zipf.sum()
    lines = []
    for _ in range(sentences):
        topic = rng.integers(TOPICS)
        ranks = rng.choice(PER_TOPIC, size=LENGTH, p=zipf)
        off = rng.random(LENGTH) >= 0.85
        topics = np.where(off, rng.integers(TOPICS, size=LENGTH), topic)
        lines.append(" ".join(word(t, r) for t, r in zip(topics, ranks)))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "corpus.txt"))
    args = p.parse_args()
    with open(args.out, "w") as f:
        f.write(make(args.sentences, args.seed))
    print(f"wrote {args.sentences} sentences to {args.out}")


if __name__ == "__main__":
    main()
