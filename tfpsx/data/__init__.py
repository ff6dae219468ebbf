"""Feeding a job: the job's input read split by split as PS 0 leases them (every example
trained once, whatever happens to the job), and each worker's part of in-memory data.

* :func:`splits` (:mod:`.splits`): files cut into splits, leased to the workers as they
  go, read at the cost of the split's bytes, each batch's position committed when the
  step is in the model and saved in the model's checkpoint; :func:`next_batch` takes its
  batches in graph mode; :func:`input_stats` says where the job's epoch stands.
* :func:`stream` (:mod:`.stream`): the same for files that keep landing (a job that
  trains as they come until :func:`stream_stop` or SIGTERM);
* :func:`shard`, :func:`shard_arrays` (:mod:`.shard`): every W-th example of data a
  worker holds whole (a static cut: for in-memory data).
"""

from tfpsx.data.shard import shard, shard_arrays
from tfpsx.data.splits import input_stats, next_batch, splits
from tfpsx.data.stream import stop as stream_stop
from tfpsx.data.stream import stream

__all__ = ["shard", "shard_arrays", "splits", "stream", "stream_stop", "next_batch",
           "input_stats"]
