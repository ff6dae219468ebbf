"""The fixed cost of one TF1 ``session.run`` from a worker to an op on PS 0: what a
protocol pays per extra run in a step (graph sync's chief runs its apply after its
training run, every other worker its token wait). A PS server and a worker server in
this process, over gRPC on 127.0.0.1; rounds of ``--runs`` runs of one ``assign_add``.

  python benchmarks/session_run_cost.py [--rounds 3] [--runs 2000]
"""

import argparse
import statistics
import time

import tensorflow as tf

from tfpsx.launcher.local import pick_ports


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=2000)
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    ps, worker = (f"127.0.0.1:{port}" for port in pick_ports(2))
    spec = tf.train.ClusterSpec({"ps": [ps], "worker": [worker]})
    servers = [tf.distribute.Server(spec, job_name=job, task_index=0)
               for job in ("ps", "worker")]
    per_run = []
    with tf.Graph().as_default():
        with tf.device("/job:ps/task:0"):
            v = tf.compat.v1.get_variable("v", [], tf.int64, use_resource=True,
                                          initializer=tf.zeros_initializer())
            bump = v.assign_add(1)
        with tf.compat.v1.Session(servers[1].target) as session:
            session.run(v.initializer)
            for _ in range(200):  # warm-up
                session.run(bump)
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.runs):
                    session.run(bump)
                per_run.append(1000 * (time.perf_counter() - start) / args.runs)
    print(f"session_run_cost: one session.run of an op on PS 0: median "
          f"{statistics.median(per_run):.3f} ms (rounds: "
          f"{', '.join(f'{x:.3f}' for x in per_run)})")


if __name__ == "__main__":
    main()
