"""A worker's ``tf.data`` pipeline of a leased input (:func:`tfpsx.data.splits`,
:func:`tfpsx.data.stream`): its leases read split by split, a chunk at a time, parsed and
batched, each batch carrying its position (every record's split and end offset) to the
step that trains it; or read and parsed by the tf.data service."""

from __future__ import annotations

import logging

import tensorflow as tf

from tfpsx import compat
from tfpsx.control import splits as _coordinator
from tfpsx.data import service as _service
from tfpsx.ops import bindings

logger = logging.getLogger("tfpsx")


def _chunks(source):
    """The records of one lease, in order, a chunk at a time, with their position:
    (records, keys, ends), vectors of one chunk's records."""
    fmt, chunk = source.format, source.chunk_bytes

    def read(key, path, start, resume, end):
        def step(offset, _):
            def chunk_at():
                records, ends, nxt = bindings.read_split(path, start, offset, end, chunk,
                                                         format=fmt)
                return nxt, offset, records, ends

            def done():
                return (tf.constant(-1, tf.int64), offset, tf.zeros([0], tf.string),
                        tf.zeros([0], tf.int64))

            nxt, at, records, ends = tf.cond(offset >= 0, chunk_at, done)
            return nxt, (at, records, ends)

        chunks = (tf.data.Dataset.range(1 << 62).scan(resume, step)
                  .take_while(lambda at, records, ends: at >= 0))
        return chunks.map(lambda at, records, ends: (records, tf.fill(tf.shape(ends), key),
                                                     ends))

    return read


def dataset_of(source, parse, batch_size, interleave, drop_remainder,
               parse_batches, num_parallel_calls, service) -> tf.data.Dataset:
    """This worker's dataset of a registered input (``source``: a
    ``tfpsx.data.splits.SplitInput``; the other arguments: :func:`tfpsx.data.splits`'s)."""
    name, digest = source.name, source.digest
    leases = tf.data.Dataset.from_generator(
        source.leases, output_signature=(tf.TensorSpec([], tf.int64),
                                         tf.TensorSpec([], tf.string),
                                         tf.TensorSpec([], tf.int64),
                                         tf.TensorSpec([], tf.int64),
                                         tf.TensorSpec([], tf.int64)))
    with_position = source.clustered

    def shaped(parsed, keys, ends):
        position = _coordinator.make_position(name, keys, ends)
        parsed = parsed if isinstance(parsed, tuple) else (parsed,)
        return parsed + (position,) if with_position else (
            parsed if len(parsed) > 1 else parsed[0])

    def parsed(chunks, record_batches, then):
        """``chunks`` (records, keys, ends) as batches (or records) through ``parse``,
        each ``then(parsed, keys, ends)``."""
        records = (chunks.unbatch() if batch_size is None else
                   chunks.rebatch(batch_size, drop_remainder=record_batches))
        if parse is None:
            return records.map(lambda r, k, e: then(r, k, e))
        if batch_size is None or parse_batches:
            return records.map(lambda r, k, e: then(parse(r), k, e),
                               num_parallel_calls=num_parallel_calls)
        return records.unbatch().map(lambda r, k, e: (parse(r), k, e),
                                     num_parallel_calls=num_parallel_calls).batch(
            batch_size, drop_remainder=record_batches).map(lambda p, k, e: then(p, k, e))

    # The job's service reads for its workers; one given here for any reader.
    dispatcher = _service.address(service) if (source.clustered or service) else None
    if dispatcher is None:
        # A chunk an element (a vector of records), batches cut by rebatch: tf.data's
        # per-element machinery per record would cost twice the parsing (measured: 1.43 s
        # against 0.57 s for 200,000 Criteo lines read and parsed, a TextLineDataset
        # 0.64 s). A sequential interleave, a chunk read ahead: a parallel one prefetches
        # leases (six taken for one batch, against two), which a worker then holds and
        # does not train.
        chunks = leases.interleave(_chunks(source), cycle_length=interleave).prefetch(1)
        data = parsed(chunks, drop_remainder, shaped)
    else:
        # Each lease read and parsed on a data worker (its batches end with the lease,
        # cut to batch_size again here), the position carried as without the service.
        read = _chunks(source)

        def flat(p, k, e):
            return (p if isinstance(p, tuple) else (p,)) + (k, e)

        def remote(key, path, start, resume, end):
            one = tf.data.Dataset.range(1).flat_map(
                lambda _: read(key, path, start, resume, end))
            return parsed(one, False, flat)

        example = [tf.constant(0, tf.int64), tf.constant(""), tf.constant(0, tf.int64),
                   tf.constant(0, tf.int64), tf.constant(0, tf.int64)]
        spec = remote(*example).element_spec
        batches = leases.interleave(_service.read_through(dispatcher, remote, spec),
                                    cycle_length=interleave)
        if batch_size is not None:
            batches = batches.rebatch(batch_size, drop_remainder=drop_remainder)
        data = batches.map(lambda *x: shaped(x[0] if len(x) == 3 else x[:-2], x[-2], x[-1]))
        logger.info("input %s: read and parsed by the tf.data service at %s", name,
                    dispatcher)
    logger.info("input %s: %s; worker %d reads splits as leased from %s", name, digest,
                source.worker, ("this process" if not source.clustered else "PS 0"
                                if source.home == _coordinator.PS0 else "rank 0 (no servers)"))
    # A little read-ahead only: what a worker reads ahead of its steps it holds as leases,
    # which a slow worker must not hoard. Its size unknown to Keras, which would otherwise
    # learn an epoch's length from a worker's first and cut the later ones to it.
    # No autotuning thread (AUTOTUNE keeps TF's defaults, untuned): it costs CPU the
    # workers' steps need (measured: the Criteo job's CPU 1.094x a static cut's with it,
    # 1.042x without: farm-bench, 4 pairs of whole jobs), and in TF 2.21 an iterator's
    # deletion waits out its sleep (examples/criteo/criteo_data.py), which every epoch's
    # new iterator would pay.
    options = tf.data.Options()
    options.autotune.enabled = False
    return compat.unsized(data.prefetch(2).with_options(options))
