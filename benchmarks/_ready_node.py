"""A node that only joins the cluster: prints when tfpsx.init() has the full cluster."""
import time

import tfpsx

config = tfpsx.init()
print(f"READY {time.time():.6f} {config.role} {config.index} of {len(config.servers)}+"
      f"{len(config.workers)}", flush=True)
time.sleep(600)  # the benchmark kills it
