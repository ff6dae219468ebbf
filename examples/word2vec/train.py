"""Skip-gram word2vec with negative sampling over tfpsx DynamicTable tables.

Graph mode, between-graph: every worker reads the corpus, draws (center, context)
pairs and negatives from its own random stream, and trains two tables (input and
output vectors) whose ids are hashes of the words, so no vocabulary is built. Modes:

  sync   the tables live on the parameter servers; each step the row gradients of all
         workers are summed per row on the PS, averaged and applied once (by the chief),
         and every worker waits for that before its next step. --steps counts these
         global steps.
  async  the tables live on the parameter servers; lookups and the Adagrad updates run
         there every step, no worker waits for another.
  geo    each worker trains local copies and syncs the changed rows every k steps
         (tfpsx.DistributedStrategy k_steps), the sync in a background thread.
  local  no sharing at all: each worker trains its own tables (the communication-free
         ceiling that benchmarks/geo_vs_async.py compares against).

With --cache_size N (async, geo) each worker keeps up to N rows per table in a worker
cache that a tfpsx.RowStager fills ahead of the steps, --stage_batches batches per run
of the stager: the steps run no PS op (async: the cache syncs every --cache_flush_steps
steps in the stager's flusher thread, and the stager counts the steps into global_step).

With --geo_pull_ahead S (geo) each round pulls only the changed rows among the ids of the
batches a worker trains before its next pull lands: the sampled batches' ids are recorded
ahead of the steps in a tfpsx.GeoReadAhead.

With --input splits (async, geo) the workers read the corpus's sentences instead of
sampling it: tfpsx.data.splits leases it split by split from PS 0 as each worker goes,
every pair of a sentence's words within the window is trained once an epoch (--epochs),
and a worker that dies gives its splits back from where its steps were in the model.

At the end every worker evaluates the shared tables (its own in local mode): the loss on
a fixed set of pairs, and how much closer words of one planted topic are than words of
different topics. Run it with

  tfpsx-run --server_num 1 --worker_num 2 examples/word2vec/train.py --mode geo --k_steps 100
  tfpsx-run --server_num 1 --worker_num 2 examples/word2vec/train.py --mode async \
      --input splits --epochs 2
"""

import hashlib
import os
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import tfpsx
from tfpsx import embedding as E

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "geo", ["sync", "async", "geo", "local"],
                  "how workers share the tables")
flags.DEFINE_string("k_steps", "100", "geo: local steps between syncs, or \"auto\" (tfpsx "
                    "chooses K and, table by table, whether rounds pay: docs/modes.md)")
flags.DEFINE_enum("geo_table_rule", None, ["average", "shared_slots"],
                  "geo: how the PS adds the workers' pushes of a row (default: tfpsx's "
                  "choice by the worker count; docs/modes.md)")
flags.DEFINE_integer("geo_hot_count", None, "geo: ids seen this often in a batch train on "
                     "the PS (0: none; default: tfpsx's choice by the worker count)")
flags.DEFINE_integer("geo_hot_per_round", None, "geo: ids the workers would train this "
                     "often in a round train on the PS (0: none; default: tfpsx's choice by "
                     "the worker count)")
flags.DEFINE_enum("geo_wire_dtype", None, ["float32", "bfloat16", "float16"],
                  "geo: the dtype table rows travel in (default: tfpsx's)")
flags.DEFINE_enum("geo_table_choice", None, ["auto", "rounds"],
                  "geo: 'auto' (each table runs rounds only while they move fewer bytes "
                  "than async) or 'rounds' (every table; default: tfpsx's choice by the "
                  "worker count)")
flags.DEFINE_enum("geo_slot_wire_dtype", None, ["float32", "bfloat16"],
                  "geo: the dtype a row's optimizer slots travel in under shared "
                  "slots (default: tfpsx's)")
flags.DEFINE_integer("geo_pull_ahead", 0, "geo, --input sample: >= 1 pulls only the changed "
                     "rows a worker reads before its next pull lands (the batches' ids "
                     "recorded ahead in a tfpsx.GeoReadAhead), every changed row each N-th "
                     "round; 0: every changed row each round", lower_bound=0)
flags.DEFINE_string("corpus", os.path.join(HERE, "corpus.txt"), "text file, one sentence a line")
flags.DEFINE_integer("steps", 1000, "--input sample: local steps per worker (sync: global "
                     "steps)")
flags.DEFINE_enum("input", "sample", ["sample", "splits"],
                  "sample: each worker draws random pairs of the whole corpus (--steps); "
                  "splits: the corpus's sentences leased split by split from PS 0 as each "
                  "worker goes (tfpsx.data.splits), every sentence's pairs trained once an "
                  "epoch (--epochs), async or geo")
flags.DEFINE_integer("epochs", 1, "--input splits: passes over the corpus")
flags.DEFINE_integer("batch_sentences", 8, "--input splits: sentences a step (their pairs)")
flags.DEFINE_integer("split_bytes", 32 << 10, "--input splits: bytes of a split of the corpus")
flags.DEFINE_integer("batch_size", 512, "(center, context) pairs per step")
flags.DEFINE_integer("negatives", 5, "negative samples per pair")
flags.DEFINE_integer("window", 2, "context window on each side")
flags.DEFINE_integer("dim", 64, "embedding width")
flags.DEFINE_float("learning_rate", 0.1, "Adagrad learning rate")
flags.DEFINE_integer("log_every", 0, "print the training loss every N steps (0: never)")
flags.DEFINE_integer("seed", 0, "seed of the sampling streams (each worker adds its rank)")
flags.DEFINE_integer("cache_size", 0, "async / geo: rows of a worker cache per table (0: none)")
flags.DEFINE_integer("cache_flush_steps", 100, "async: steps between the caches' syncs")
flags.DEFINE_integer("stage_batches", 1, "with a cache: batches staged per run of the "
                     "stager (one PS round trip for several batches)", lower_bound=1)
flags.DEFINE_float("max_seconds", 0, "also stop a worker after this many seconds of "
                   "training (0: no limit; --steps bounds it still): equal wall time per mode")
flags.DEFINE_integer("eval_every", 0, "the chief also evaluates the shared tables every N "
                     "steps (0: at the end only); the pauses are left out of the timeline")


def word_id(word: str) -> int:
    """A stable 63-bit id per word (Python's hash() changes between processes)."""
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little") >> 1


class Corpus:
    """Token ids and skip-gram sampling over a text file."""

    def __init__(self, path: str, window: int):
        with open(path) as f:
            sentences = [line.split() for line in f if line.strip()]
        if not sentences:
            raise ValueError(f"word2vec: corpus {path!r} has no words")
        self.words = sorted({w for s in sentences for w in s})
        ids = {w: word_id(w) for w in self.words}
        tokens, sentence = [], []
        for i, s in enumerate(sentences):
            tokens.extend(ids[w] for w in s)
            sentence.extend([i] * len(s))
        self.tokens = np.asarray(tokens, np.int64)
        self.sentence = np.asarray(sentence, np.int64)
        self.window = window
        self.ids = ids

    def pairs(self, rng, count: int):
        """(center, context) ids: a random token and a neighbour in its sentence."""
        n = len(self.tokens)
        center = rng.integers(0, n, size=count)
        offset = rng.integers(1, self.window + 1, size=count) * rng.choice([-1, 1], size=count)
        context = np.clip(center + offset, 0, n - 1)
        same = self.sentence[context] == self.sentence[center]
        context = np.where(same, context, center - offset.clip(-1, 1))  # stay in the sentence
        context = np.clip(context, 0, n - 1)
        return self.tokens[center], self.tokens[context]

    def negatives(self, rng, shape):
        """Negatives from the unigram distribution (random token positions)."""
        return self.tokens[rng.integers(0, len(self.tokens), size=shape)]


def sentence_pairs(corpus: Corpus, seed: int):
    """``parse`` of --input splits: a batch of sentences (their text) -> every (center,
    context) pair of their words within the window and its negatives, (center ids [n],
    context + negative ids [n, 1 + negatives]), in numpy inside the input pipeline."""
    rng = np.random.default_rng(seed)
    window, negatives = FLAGS.window, FLAGS.negatives

    def pairs(lines):
        center, context = [], []
        for line in lines:
            ids = [corpus.ids.get(w) or word_id(w) for w in line.decode().split()]
            for i, c in enumerate(ids):
                for j in range(max(0, i - window), min(len(ids), i + window + 1)):
                    if j != i:
                        center.append(c)
                        context.append(ids[j])
        center = np.asarray(center, np.int64)
        negs = corpus.negatives(rng, (len(center), negatives))
        return center, np.concatenate([np.asarray(context, np.int64)[:, None], negs], axis=1)

    def parse(lines):
        center, targets = tf.numpy_function(pairs, [lines], [tf.int64, tf.int64])
        center.set_shape([None])
        targets.set_shape([None, 1 + negatives])
        return center, targets

    return parse


def eval_pairs(corpus: Corpus):
    """The fixed evaluation pairs: (center ids [4096], context + negative ids [4096, k])."""
    rng = np.random.default_rng(12345)
    center, context = corpus.pairs(rng, 4096)
    negs = corpus.negatives(rng, (4096, FLAGS.negatives))
    return center, np.concatenate([context[:, None], negs], axis=1)


def pair_loss(vin, vout) -> float:
    """word2vec's loss per pair (mean): centers' rows [b, d], targets' rows [b, k, d]."""
    logits = np.einsum("bd,bkd->bk", vin, vout)
    labels = np.zeros_like(logits)
    labels[:, 0] = 1
    return float(np.mean(np.sum(
        np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits))), axis=1)))


class Probe:
    """The eval loss of the shared tables during training: the rows of the fixed pairs'
    ids read by ``read(unique_in, unique_out)`` (the tables' rows, new ids at their
    initial values), the loss computed here."""

    def __init__(self, corpus: Corpus):
        center, targets = eval_pairs(corpus)
        self.ids_in, self._in = np.unique(center, return_inverse=True)
        self.ids_out, self._out = np.unique(targets, return_inverse=True)
        self._shape = targets.shape

    def loss(self, rows_in, rows_out) -> float:
        vout = rows_out[self._out].reshape(self._shape + (rows_out.shape[-1],))
        return pair_loss(rows_in[self._in], vout)


def evaluate(rows_in, rows_out, corpus: Corpus, dim: int):
    """(loss on fixed pairs, within-topic minus across-topic cosine similarity)."""
    table_in = dict(zip(rows_in["keys"].tolist(), rows_in["values"]))
    table_out = dict(zip(rows_out["keys"].tolist(), rows_out["values"]))
    zero = np.zeros(dim, np.float32)
    center, out_ids = eval_pairs(corpus)
    vin = np.stack([table_in.get(int(c), zero) for c in center])
    vout = np.stack([[table_out.get(int(o), zero) for o in row] for row in out_ids])
    loss = pair_loss(vin, vout)
    # Planted structure: words named t<topic>w<rank> belong to their topic.
    # 400 words spread over the vocabulary (its first 400 may all be of one topic)
    words = [w for w in corpus.words if corpus.ids[w] in table_in]
    words = words[::max(1, len(words) // 400)][:400]
    if len(words) < 2:
        return float(loss), 0.0
    vectors = np.stack([table_in[corpus.ids[w]] for w in words])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True) + 1e-9
    sims = vectors @ vectors.T
    topic = np.array([w[:w.index("w")] for w in words])
    same = topic[:, None] == topic[None, :]
    off_diagonal = ~np.eye(len(words), dtype=bool)
    gap = sims[same & off_diagonal].mean() - sims[~same].mean()
    return float(loss), float(gap)


def stage(stager, emb_in, emb_out, batches, i):
    """Starts staging batches i .. i + --stage_batches - 1 (cycling) into the tables'
    caches, in one run; None without a stager."""
    if stager is None:
        return None
    group = [batches[(i + j) % len(batches)] for j in range(FLAGS.stage_batches)]
    return stager.stage({emb_in: np.concatenate([c for c, _ in group]),
                         emb_out: np.concatenate([t.reshape(-1) for _, t in group])},
                        batches=len(group))


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    tfpsx.init()
    if tfpsx.is_server():
        tfpsx.run_server()
        return 0
    splits = FLAGS.input == "splits"
    if splits and (FLAGS.mode not in ("async", "geo") or FLAGS.cache_size):
        raise app.UsageError(f"--input splits trains async or geo without --cache_size (got "
                             f"--mode {FLAGS.mode} --cache_size {FLAGS.cache_size}): sync "
                             "takes a batch of every worker a step (tfpsx.data.splits ends "
                             "the workers' data at different steps), a cache's stager "
                             "stages sampled batches")
    if FLAGS.geo_pull_ahead and (FLAGS.mode != "geo" or splits):
        raise app.UsageError(f"--geo_pull_ahead {FLAGS.geo_pull_ahead} reads the sampled "
                             "batches ahead in GEO mode: it needs --mode geo and --input "
                             f"sample (got --mode {FLAGS.mode} --input {FLAGS.input})")
    tfpsx.init_worker()
    me = tfpsx.worker_index()
    corpus = Corpus(FLAGS.corpus, FLAGS.window)
    rng = np.random.default_rng(FLAGS.seed + me)
    k_steps = (FLAGS.k_steps if FLAGS.k_steps == "auto" else int(FLAGS.k_steps)) \
        if FLAGS.mode == "geo" else 0
    rule = {key: getattr(FLAGS, key) for key in ("geo_table_rule", "geo_hot_count",
                                                 "geo_hot_per_round", "geo_wire_dtype",
                                                 "geo_slot_wire_dtype", "geo_table_choice")
            if k_steps and getattr(FLAGS, key) is not None}  # unnamed: tfpsx's choice
    if FLAGS.geo_pull_ahead:
        rule["geo_pull_ahead"] = FLAGS.geo_pull_ahead
    strategy = tfpsx.DistributedStrategy(a_sync=FLAGS.mode != "sync",
                                         a_sync_configs={"k_steps": k_steps, **rule})
    local_device = [f"/job:{tfpsx.cluster_config().job_name}/task:{me}"]

    with tf.Graph().as_default():
        if splits:  # every sentence's pairs once an epoch, leased as each worker goes
            data = tfpsx.data.splits(FLAGS.corpus, sentence_pairs(corpus, FLAGS.seed + me),
                                     FLAGS.batch_sentences, split_bytes=FLAGS.split_bytes,
                                     seed=FLAGS.seed, epochs=FLAGS.epochs)
            read_center, read_targets = tfpsx.data.next_batch(data.repeat(FLAGS.epochs))
        with tfpsx.model_scope(strategy):
            global_step = tf.compat.v1.train.get_or_create_global_step()
            devices = local_device if FLAGS.mode == "local" else None
            opt = E.Adagrad(FLAGS.learning_rate)
            cache = ({"cache_size": FLAGS.cache_size, "flush_steps": FLAGS.cache_flush_steps}
                     if FLAGS.cache_size and FLAGS.mode in ("async", "geo") else {})
            emb_in = E.DynamicTable("w2v_in", FLAGS.dim, optimizer=opt, devices=devices,
                                    initializer=E.normal(stddev=0.1), **cache)
            emb_out = E.DynamicTable("w2v_out", FLAGS.dim, optimizer=opt, devices=devices,
                                     initializer=E.normal(stddev=0.1), **cache)
            # A cache's rows are staged one batch ahead in a thread of the stager's: the
            # steps read and train the caches only.
            # In async mode the stager also counts the steps into global_step (a step's
            # own increment would be a PS round trip in every step).
            stager = (tfpsx.RowStager([emb_in, emb_out], ahead=1, global_step=(
                global_step if FLAGS.mode == "async" else None)) if cache else None)
            # --geo_pull_ahead: each sampled batch's ids, recorded ahead of its step.
            reader = (tfpsx.GeoReadAhead([emb_in, emb_out]) if FLAGS.geo_pull_ahead
                      else None)
            if splits:
                center, targets = read_center, read_targets
            else:
                center = tf.compat.v1.placeholder(tf.int64, [None], name="center")
                targets = tf.compat.v1.placeholder(tf.int64, [None, 1 + FLAGS.negatives],
                                                   name="targets")
            pairs = tf.size(center)
            # The step stamps rows for TTL eviction; GEO's local copies need no PS read.
            step = global_step if FLAGS.mode in ("async", "sync") else None
            looked_in = emb_in.lookup_unique(center, step=step)
            looked_out = emb_out.lookup_unique(targets, step=step)
            logits = tf.einsum("bd,bkd->bk", looked_in.embeddings, looked_out.embeddings)
            labels = tf.one_hot(tf.zeros_like(center, tf.int32), 1 + FLAGS.negatives)
            # word2vec's objective: per pair, the positive's and the negatives' terms
            # summed; trained on the batch sum (each pair moves its rows as in the original
            # per-example SGD), reported as the mean per pair.
            per_pair = tf.reduce_sum(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits), axis=1)
            objective = tf.reduce_sum(per_pair)
            loss = tf.reduce_mean(per_pair)
            train = [emb_in.minimize(objective, [looked_in], step=step),
                     emb_out.minimize(objective, [looked_out], step=step)]
            if FLAGS.mode == "async" and stager is None:  # GEO reports local steps to
                train.append(tf.compat.v1.assign_add(global_step, 1))  # global_step when it
                # pushes, a stager when it stages, sync counts its global steps; local: never
            train_op = tf.group(*train)
            export_in, export_out = emb_in.export(), emb_out.export()
            # The shared rows (the PS's; local: this worker's) of the eval pairs' ids.
            probe = Probe(corpus)
            probe_rows = [E.ShardedTable.rows(emb_in, tf.constant(probe.ids_in), False),
                          E.ShardedTable.rows(emb_out, tf.constant(probe.ids_out), False)]

        # Sampling happens before the clock starts: the benchmark times training.
        batches = []
        for _ in range(0 if splits else FLAGS.steps):
            c, ctx = corpus.pairs(rng, FLAGS.batch_size)
            negs = corpus.negatives(rng, (FLAGS.batch_size, FLAGS.negatives))
            batches.append((c, np.concatenate([ctx[:, None], negs], axis=1)))
        losses, points = [], []
        # Sync: run until the global step reaches --steps (a worker may take more or fewer
        # of the steps than another: tokens are not per worker, as in TF).
        last_step = FLAGS.steps if FLAGS.mode == "sync" else None
        probing = me == 0 and FLAGS.eval_every > 0
        with tfpsx.MonitoredTrainingSession(last_step=last_step) as sess:
            start, cpu_start = time.perf_counter(), time.process_time()
            paused = cpu_paused = 0.0  # spent evaluating, left out of the timeline
            i = 0
            staging = stage(stager, emb_in, emb_out, batches, 0)
            examples = 0
            while not sess.should_stop() and (last_step or splits or i < FLAGS.steps):
                if FLAGS.max_seconds and time.perf_counter() - start - paused > FLAGS.max_seconds:
                    break
                if splits:
                    try:
                        _, value, n = sess.run([train_op, loss, pairs])
                    except tf.errors.OutOfRangeError:
                        break  # the last epoch's end
                else:
                    while reader is not None and reader.recorded < i + reader.batches_ahead:
                        ahead_c, ahead_t = batches[reader.recorded % len(batches)]
                        reader.record({emb_in: ahead_c, emb_out: ahead_t})
                    c, t = batches[i % len(batches)]
                    if staging is not None and i % FLAGS.stage_batches == 0:
                        staging.result()  # batches i .. i + stage_batches - 1 are cached
                        # the next group, during these steps
                        staging = stage(stager, emb_in, emb_out, batches,
                                        i + FLAGS.stage_batches)
                    _, value, n = sess.run([train_op, loss, pairs], {center: c, targets: t})
                losses.append(value)
                examples += int(n)
                i += 1
                if FLAGS.log_every and i % FLAGS.log_every == 0:
                    print(f"worker {me}: step {i}, loss {np.mean(losses[-50:]):.4f}",
                          flush=True)
                if probing and i % FLAGS.eval_every == 0:
                    began, cpu_began = time.perf_counter(), time.process_time()
                    points.append({"seconds": began - start - paused, "step": i,
                                   "loss": probe.loss(*sess.run(probe_rows))})
                    paused += time.perf_counter() - began
                    cpu_paused += time.process_time() - cpu_began
            seconds = time.perf_counter() - start - paused  # training's
            # This process's CPU (every thread's) while it trained: what a step costs the
            # worker, which wall time hides where the workers share cores.
            cpu_seconds = time.process_time() - cpu_start - cpu_paused
            if FLAGS.mode == "local":
                rows_in, rows_out = sess.run([export_in, export_out])
                final = probe.loss(*sess.run(probe_rows))
        tfpsx.barrier_worker()  # every worker's last push is in
        if FLAGS.mode != "local":
            with tf.compat.v1.Session(tfpsx.server_target(), config=tfpsx.session_config()) as s:
                rows_in, rows_out = s.run([export_in, export_out])
                final = probe.loss(*s.run(probe_rows))
                global_steps = int(s.run(global_step))
        else:
            global_steps = 0
        if probing:
            points.append({"seconds": seconds, "step": i, "loss": final})
    eval_loss, gap = evaluate(rows_in, rows_out, corpus, FLAGS.dim)
    report = {"worker": me, "mode": FLAGS.mode, "k_steps": k_steps, "steps": len(losses),
              "seconds": seconds, "examples_per_sec": examples / seconds, "examples": examples,
              "cpu_seconds": cpu_seconds,
              "train_loss": float(np.mean(losses[-50:])), "eval_loss": eval_loss,
              "similarity_gap": gap, "vocab_rows": int(len(rows_in["keys"])),
              "global_step": global_steps,
              "points": points}
    if splits:
        report["input_stats"] = tfpsx.data.input_stats()
    if FLAGS.mode == "geo":
        c = tfpsx.metrics.snapshot()["geo"]  # the GEO communicator's counters
        report.update(pushes=c["pushes"], rows_sent=c["rows_sent"], mb_sent=c["bytes_sent"] / 1e6,
                      rows_received=c["rows_received"], mb_received=c["bytes_received"] / 1e6,
                      ms_per_sync=1000 * c["sync_seconds"] / max(1, c["pushes"]),
                      round_wait_seconds=c["round_wait_seconds"],
                      pulls_ahead=c["pulls_ahead"])
    print(f"worker {me}: {FLAGS.mode} {report['examples_per_sec']:.0f} examples/s, "
          f"eval loss {eval_loss:.4f}, within-topic minus across-topic similarity {gap:.3f}",
          flush=True)
    tfpsx.metrics.emit("word2vec", **report)  # metrics.worker.<me>.jsonl under tfpsx-run
    tfpsx.stop_worker()
    return 0


if __name__ == "__main__":
    app.run(main)
