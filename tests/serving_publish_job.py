"""A chief that trains and publishes (tests/ops/test_serving_deltas.py's model), as a
process of its own so that a test can kill it mid-delta.

  python serving_publish_job.py CKPT SERVED SEED [--die_at_done] [--export DIR]

Restores CKPT if it holds a checkpoint, fits one epoch of 256 examples (a save every 3
batches, each published into SERVED), and with --export writes a full export of the
final step. --die_at_done: the process exits with code 137 (as a SIGKILL would leave
it) at its first delta's DONE marker, after the delta's files and manifest were renamed
into place: a chief killed mid-delta.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops"))

import tfpsx  # noqa: E402
from tfpsx.keras.checkpoint import IncrementalCheckpoint  # noqa: E402
from tfpsx.serving import Publisher, publish  # noqa: E402
from test_serving_deltas import fit, model_and_tables  # noqa: E402


def main(argv):
    ckpt_dir, served, seed = argv[0], argv[1], int(argv[2])
    model, _, _ = model_and_tables()
    ckpt = IncrementalCheckpoint(ckpt_dir, full_every=100, save_freq=3,
                                 publisher=Publisher(served))
    ckpt.restore(model)
    if "--die_at_done" in argv:
        write = publish._write_synced

        def dying(path, data):
            if os.path.basename(path) == publish.DONE:
                os._exit(137)
            write(path, data)

        publish._write_synced = dying
    fit(model, ckpt, seed)
    if "--export" in argv:
        tfpsx.export_serving(model, argv[argv.index("--export") + 1])
    print("PUBLISHED", publish.published(served), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
