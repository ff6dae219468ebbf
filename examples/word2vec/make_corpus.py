"""Writes a small text corpus with planted structure for the word2vec example.

2,000 words in 20 topics of 100 (--topics, --per_topic: 200 x 500 is a 100,000-word
vocabulary); each sentence picks a topic and draws 85% of its words from it (Zipf-like
within the topic), the rest from anywhere. Words of one topic
share contexts, so a trained skip-gram model puts them close together: the example's
similarity check compares within-topic and across-topic cosine similarity.

  python examples/word2vec/make_corpus.py [--sentences 5000] [--topics 20]
      [--per_topic 100] [--out corpus.txt]
"""

import argparse
import os

import numpy as np

TOPICS, PER_TOPIC, LENGTH = 20, 100, 20


def word(topic: int, rank: int) -> str:
    return f"t{topic:02d}w{rank:03d}"


def topic_of(token: str) -> int:
    """The topic of a word ``t<topic>w<rank>``."""
    return int(token[1:token.index("w")])


def make(sentences: int, seed: int = 0, topics: int = TOPICS, per_topic: int = PER_TOPIC):
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, per_topic + 1) ** 0.8
    zipf /= zipf.sum()
    lines = []
    for _ in range(sentences):
        topic = rng.integers(topics)
        ranks = rng.choice(per_topic, size=LENGTH, p=zipf)
        off = rng.random(LENGTH) >= 0.85
        topics_drawn = np.where(off, rng.integers(topics, size=LENGTH), topic)
        lines.append(" ".join(word(t, r) for t, r in zip(topics_drawn, ranks)))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topics", type=int, default=TOPICS)
    p.add_argument("--per_topic", type=int, default=PER_TOPIC, help="words per topic")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "corpus.txt"))
    args = p.parse_args()
    with open(args.out, "w") as f:
        f.write(make(args.sentences, args.seed, args.topics, args.per_topic))
    print(f"wrote {args.sentences} sentences ({args.topics} topics of {args.per_topic} words) "
          f"to {args.out}")


if __name__ == "__main__":
    main()
