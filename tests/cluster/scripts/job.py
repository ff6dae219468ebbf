"""A minimal tfpsx job for the cluster tests: servers serve, workers register and stop.

Behaviour knobs come from env so one script covers the scenarios:
  JOB_BARRIERS=N      workers meet at N barriers
  JOB_SLEEP=S         workers sleep S seconds before stopping
  JOB_SKIP_STOP=1     workers exit without stop_worker()
"""
import os
import sys
import time

import tfpsx

tfpsx.init()
if tfpsx.is_server():
    report = tfpsx.run_server()
    print(f"RUN_SERVER_RETURNED stopped={report.stopped} lost={report.lost}", flush=True)
    sys.exit(0)

tfpsx.init_worker()
print(f"WORKER_READY {tfpsx.worker_index()}", flush=True)
for i in range(int(os.environ.get("JOB_BARRIERS", "0"))):
    tfpsx.barrier_worker()
    print(f"BARRIER_PASSED {i}", flush=True)
time.sleep(float(os.environ.get("JOB_SLEEP", "0")))
if os.environ.get("JOB_SKIP_STOP") != "1":
    tfpsx.stop_worker()
print("WORKER_DONE", flush=True)
