"""A minimal tfpsx job for the cluster tests: servers serve, workers register and stop.

Behaviour knobs come from env so one script covers the scenarios:
  JOB_BARRIERS=N      workers meet at N barriers
  JOB_SLEEP=S         workers sleep S seconds before stopping
  JOB_SKIP_STOP=1     workers exit without stop_worker()
  JOB_BARE_SERVER=1   servers run a bare tf.distribute.Server without the tfpsx ops
  JOB_PLACEMENT=1     the worker checks where counter ops run and prints JSON
  JOB_PID_DIR=D       every process writes its pid to D/<pid> (after init: its role)
  JOB_FAIL=I:C        worker I exits with code C right after init_worker()
  JOB_LATE_BARRIER=1  workers meet at one more barrier after the sleep
  JOB_EVAL_EXIT=C     an evaluator task exits with code C (else it waits for a signal)
"""
import os
import sys
import time

import tfpsx

if os.environ.get("JOB_PID_DIR"):
    open(os.path.join(os.environ["JOB_PID_DIR"], str(os.getpid())), "w").close()

tfpsx.init()
if os.environ.get("JOB_PID_DIR"):
    with open(os.path.join(os.environ["JOB_PID_DIR"], str(os.getpid())), "w") as f:
        f.write("server" if tfpsx.is_server() else f"worker {tfpsx.worker_index()}")
if tfpsx.is_evaluator():
    print("EVALUATOR_UP", flush=True)
    if os.environ.get("JOB_EVAL_EXIT"):
        sys.exit(int(os.environ["JOB_EVAL_EXIT"]))
    time.sleep(300)  # the launcher stops it once training ended
    sys.exit(0)
if tfpsx.is_server() and os.environ.get("JOB_BARE_SERVER") == "1":
    import tensorflow as tf

    tf.distribute.Server(tfpsx.cluster_spec(), job_name="ps", task_index=tfpsx.server_index())
    print("BARE_SERVER_UP", flush=True)
    time.sleep(300)
    sys.exit(0)
if tfpsx.is_server():
    report = tfpsx.run_server()
    print(f"RUN_SERVER_RETURNED stopped={report.stopped} lost={report.lost}", flush=True)
    sys.exit(0)

tfpsx.init_worker()
print(f"WORKER_READY {tfpsx.worker_index()}", flush=True)
config = tfpsx.cluster_config()
print(f"TASK {config.job_name}:{config.task_index} rank {tfpsx.worker_index()} of "
      f"{tfpsx.worker_num()} chief {tfpsx.is_chief()}", flush=True)
if os.environ.get("JOB_FAIL"):
    index, code = map(int, os.environ["JOB_FAIL"].split(":"))
    if index == tfpsx.worker_index():
        print(f"WORKER_FAILING with {code}", flush=True)
        sys.exit(code)
if os.environ.get("JOB_PLACEMENT") == "1":
    from placement import check_placement

    tfpsx.metrics.emit("placement", **check_placement())
for i in range(int(os.environ.get("JOB_BARRIERS", "0"))):
    tfpsx.barrier_worker()
    print(f"BARRIER_PASSED {i}", flush=True)
time.sleep(float(os.environ.get("JOB_SLEEP", "0")))
if os.environ.get("JOB_LATE_BARRIER") == "1":
    tfpsx.barrier_worker()
    print("LATE_BARRIER_PASSED", flush=True)
if os.environ.get("JOB_SKIP_STOP") != "1":
    tfpsx.stop_worker()
print("WORKER_DONE", flush=True)
