"""The control layer: how the processes of a job find each other and agree that it is over.

* :mod:`~tfpsx.control.protocol`: the ``Coordinator`` interface the runtime uses;
* :mod:`~tfpsx.control.counters`: its implementation without a scheduler (counter
  resources on PS 0: started/stopped workers, barriers, heartbeats);
* :mod:`~tfpsx.control.sched_client` / :mod:`~tfpsx.control.scheduler`: a node's side of
  the scheduler protocol and the scheduler itself (ranks, cluster, barriers, heartbeats,
  job end), over gRPC (:mod:`~tfpsx.control.proto`, optional TLS: :mod:`~tfpsx.control.tls`);
* :mod:`~tfpsx.control.channels`: fast-reconnect channels and the bounded wait for servers.
"""
