"""How many rows a tiered shard must bring back per step, whatever its speed: the floor
under benchmarks/tiered_table.py's Zipf stream (issue 41's 0.8x target).

The stream of tiered_store_peer.cc (Zipf(1.1) ranks over the filled ids, 1% new ids a
batch, 4,096 ids a step) replayed against a RAM that holds `--rows` rows, under three
policies:

- lru: the tier's (rows least recently updated leave, from 90% of the RAM down to 75%);
- lfu: the same marks, the rows least often seen leave first;
- oracle: the `--rows` most probable ids always in RAM, nothing else (the best any
  policy can do on a stream that does not change).

It prints, per RAM size, the unique ids of a step and how many of them are not in RAM
(rows brought back, each one moved out again). The tier's time per step is then at
least those rows times the cost of moving one, which the profile gives.

    python benchmarks/tier_miss_floor.py --ids 2267191 --rows 35000,76000,150000
"""

import argparse

import numpy as np


def stream(ids, steps, batch, seed):
    """The batches (ranks; new ids above `ids`), as tiered_store_peer.cc draws them."""
    p = np.arange(1, ids + 1, dtype=np.float64) ** -1.1
    cdf = np.cumsum(p / p.sum())
    rng = np.random.default_rng(seed)
    fresh = ids
    out = []
    for _ in range(steps):
        b = np.searchsorted(cdf, rng.random(batch))
        b[: batch // 100] = np.arange(fresh, fresh + batch // 100)
        fresh += batch // 100
        out.append(b)
    return out, fresh


def misses(feeds, ids, total, rows, policy, warm):
    """Mean filled ids a step not in RAM (rows brought back; a new id costs no read),
    after `warm` steps."""
    if policy == "oracle":
        return float(np.mean([np.count_nonzero((u >= rows) & (u < ids))
                              for u in map(np.unique, feeds[warm:])]))
    freq = np.zeros(total, np.int64)
    step = np.zeros(total, np.int64)
    in_ram = np.zeros(total, bool)
    got = []
    for s, f in enumerate(feeds):
        u, c = np.unique(f, return_counts=True)
        if s >= warm:
            got.append(np.count_nonzero(~in_ram[u] & (u < ids)))
        in_ram[u] = True
        freq[u] += c
        step[u] = s
        held = np.flatnonzero(in_ram)
        if len(held) > 0.9 * rows:  # the high-water mark: down to the low one
            score = step[held] if policy == "lru" else freq[held]
            out = held[np.argsort(score, kind="stable")[: len(held) - int(0.75 * rows)]]
            in_ram[out[step[out] != s]] = False  # the step's own rows stay
    return float(np.mean(got))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=2267191, help="filled ids (the peer's at "
                    "32 MiB, dim 16, 10x)")
    ap.add_argument("--rows", default="35000,76000,150000", help="rows RAM holds")
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--warm", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    feeds, total = stream(args.ids, args.steps, args.batch, seed=7)
    unique = np.mean([len(np.unique(f)) for f in feeds])
    print(f"{args.ids} ids, {args.batch} a step, {unique:.0f} unique a step")
    print("| rows in RAM | brought back a step: lru | lfu | oracle |")
    print("| ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        got = [misses(feeds, args.ids, total, rows, p, args.warm) for p in ("lru", "lfu", "oracle")]
        print(f"| {rows:,} | " + " | ".join(f"{m:.0f}" for m in got) + " |")


if __name__ == "__main__":
    main()
