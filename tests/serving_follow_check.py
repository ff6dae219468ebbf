"""Follows a published model in a fresh process that never imports tfpsx, as a server
would, and compares it with a full export taken at the same step.

  python serving_follow_check.py MODEL_DIR FULL_EXPORT INPUTS.npz FOLLOWER_PY OUT.json

With stock TensorFlow only (tfpsx is made unimportable first):

1. every op type of every base's graph is a registered stock op (none starts ``Tfpsx``);
2. TF2: ``Follower`` (FOLLOWER_PY, loaded from its file) loads the latest base and
   applies every delta after it; its ``serving_default`` outputs on INPUTS against the
   full export's: the largest absolute difference;
3. a delta applied again is refused (an InvalidArgumentError) and changes nothing;
4. TF1, as TF Serving's Predict runs a signature: the first base loaded in a session,
   each delta fed to ``apply_delta`` fetching only its outputs, then ``serving_default``
   against the full export's, both run in TF1 sessions;
5. a second ``Follower`` (a restarted follower) catches up to the same sequence and the
   same outputs.

Writes the results to OUT.json. Tests call :func:`follow`, which runs it.
"""

import importlib.util
import json
import os
import subprocess
import sys

if __name__ == "__main__":
    sys.modules["tfpsx"] = None  # an import of tfpsx would fail: stock TF only

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import op_def_registry  # noqa: E402

from serving_check import op_types  # noqa: E402  (tests/, beside this script)


def bundle(delta):
    """A delta's tensors as arrays (read with TF's checkpoint reader, no session)."""
    reader = tf.train.load_checkpoint(os.path.join(delta, "delta"))
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()}


def tf1_outputs(path, inputs, deltas=()):
    """serving_default in a TF1 session, after feeding each delta to apply_delta
    (fetching only its outputs); returns (outputs, applied sequences)."""
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], path)
        applied = []
        for delta in deltas:
            sig = meta.signature_def["apply_delta"]
            feed = {sig.inputs[k].name: v for k, v in bundle(delta).items()}
            got = sess.run({k: v.name for k, v in sig.outputs.items()}, feed)
            applied.append(int(got["applied_sequence"]))
        sig = meta.signature_def["serving_default"]
        fetches = {k: v.name for k, v in sig.outputs.items()}
        out = sess.run(fetches, {sig.inputs[k].name: v for k, v in inputs.items()})
    return out, applied


def max_diff(a, b):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLLOWER = os.path.join(ROOT, "tfpsx", "serving", "follower.py")


def follow(model_dir, full, query, tmp_path) -> dict:
    """Runs this check in a fresh process on ``query`` ({input name: array}); returns
    its results."""
    feed, out = str(tmp_path / "query.npz"), str(tmp_path / "followed.json")
    np.savez(feed, **query)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(model_dir),
                           str(full), feed, FOLLOWER, out], capture_output=True, text=True,
                          timeout=300, env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0 and "FOLLOWED" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def main(model_dir, full, inputs_path, follower_py, out_path):
    spec = importlib.util.spec_from_file_location("follower", follower_py)
    follower = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(follower)
    inputs = dict(np.load(inputs_path))
    feed = {k: tf.constant(v) for k, v in inputs.items()}
    out = {}

    bases = follower._bases(model_dir)
    types = set()
    for base in bases:
        types |= op_types(os.path.join(model_dir, str(base)))
    out["unregistered_ops"] = sorted(t for t in types if op_def_registry.get(t) is None)
    out["tfpsx_ops"] = sorted(t for t in types if t.startswith("Tfpsx"))

    want = {k: v.numpy() for k, v in
            tf.saved_model.load(full).signatures["serving_default"](**feed).items()}
    f = follower.Follower(model_dir)
    out["base"], out["base_sequence"] = f.base, f.applied
    out["base_diff"] = max_diff({k: v.numpy() for k, v in f.predict(**feed).items()}, want)
    out["applied"] = f.catch_up()
    out["sequence"] = f.applied
    got = {k: v.numpy() for k, v in f.predict(**feed).items()}
    out["diff"] = max_diff(got, want)

    first = os.path.join(model_dir, follower.DELTAS, str(f.base + 1))
    try:
        f.model.signatures["apply_delta"](**follower.read_delta(first))
        out["duplicate"] = "applied"
    except tf.errors.InvalidArgumentError as e:
        out["duplicate"] = "refused" if "out of order" in str(e) else str(e)[:300]
    out["duplicate_sequence"] = int(f.model.signatures["applied_sequence"]()["applied_sequence"])
    out["duplicate_diff"] = max_diff({k: v.numpy() for k, v in f.predict(**feed).items()},
                                     want)

    deltas = [os.path.join(model_dir, follower.DELTAS, str(s))
              for s in range(f.base + 1, f.applied + 1)]
    tf1_got, out["tf1_applied"] = tf1_outputs(os.path.join(model_dir, str(f.base)), inputs,
                                              deltas)
    tf1_want, _ = tf1_outputs(full, inputs)
    out["tf1_diff"] = max_diff(tf1_got, tf1_want)

    again = follower.Follower(model_dir)
    again.catch_up()
    out["restarted_sequence"] = again.applied
    out["restarted_diff"] = max_diff({k: v.numpy() for k, v in again.predict(**feed).items()},
                                     want)
    out["tfpsx_imported"] = sys.modules.get("tfpsx") is not None
    with open(out_path, "w") as fh:
        json.dump(out, fh)
    print("FOLLOWED", json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:6])
