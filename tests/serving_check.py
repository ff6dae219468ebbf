"""Runs a served SavedModel in a fresh process that never imports tfpsx, as a server would.

  python serving_check.py SAVED_MODEL_DIR INPUTS.npz OUTPUTS.npz

Loads the model twice: with ``tf.saved_model.load`` (TF2) and with the TF1 loader TF
Serving's C++ loader mirrors (restore op, init op, then the signature's tensors in a
session); calls ``serving_default`` on the named inputs of INPUTS.npz with both; writes
``tf2/<name>`` and ``tf1/<name>`` outputs to OUTPUTS.npz; fails if tfpsx got imported or
if the graph holds an op whose type starts with ``Tfpsx``. Prints ``SERVED <names>``.
"""

import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2


def op_types(path):
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    types = set()
    for meta in proto.meta_graphs:
        types.update(n.op for n in meta.graph_def.node)
        functions = {f.signature.name for f in meta.graph_def.library.function}
        for fn in meta.graph_def.library.function:  # (a call of a library function: no op)
            types.update(n.op for n in fn.node_def if n.op not in functions)
    return types


def main(path, inputs_path, outputs_path):
    inputs = dict(np.load(inputs_path))
    bad = sorted(t for t in op_types(path) if t.startswith("Tfpsx"))
    assert not bad, f"tfpsx ops in the served graph: {bad}"

    out = {}
    served = tf.saved_model.load(path).signatures["serving_default"]
    for name, value in served(**{k: tf.constant(v) for k, v in inputs.items()}).items():
        out[f"tf2/{name}"] = value.numpy()

    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], path)
        sig = meta.signature_def["serving_default"]
        assert set(sig.inputs) == set(inputs), (sorted(sig.inputs), sorted(inputs))
        fetches = {k: v.name for k, v in sig.outputs.items()}
        feed = {sig.inputs[k].name: v for k, v in inputs.items()}
        for name, value in sess.run(fetches, feed).items():
            out[f"tf1/{name}"] = value

    assert "tfpsx" not in sys.modules, "tfpsx was imported"
    np.savez(outputs_path, **out)
    print("SERVED", " ".join(sorted(out)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
