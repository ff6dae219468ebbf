"""A local cluster of real processes on 127.0.0.1: the launcher's core, and tests' and
demos' way to start a job.

Every process gets its own free port (portpicker), its own process group (so its
children die with it), death with the process that started it (no orphans when a
launcher is killed with SIGKILL), a log file, a metrics file (``TFPSX_METRICS_DIR`` is the log
folder), and a deadline; :meth:`LocalCluster.stop` kills by
PID whatever is still running, and the context manager calls it even when a test fails.
Its TensorFlow servers listen on 127.0.0.1 only (each task preloads the bind shim of
:mod:`tfpsx.launcher.loopback`, and :meth:`LocalCluster.wait` stops a job whose port
another machine could reach), unless ``loopback_only=False``.

Example:
  >>> with LocalCluster("train.py", server_num=1, worker_num=2, timeout=120) as c:
  ...     c.start()
  ...     codes = c.wait()          # {("worker", 0): 0, ...}; raises on the deadline
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import portpicker

from tfpsx import cluster as _cluster
from tfpsx import metrics, settings
from tfpsx.errors import ClusterTimeoutError, ExposedPortError
from tfpsx.launcher import loopback
from tfpsx.waits import wait_for

Task = Tuple[str, int]  # (role, index)
# The hosts a job kept on loopback may name: the bind shim binds 127.0.0.1.
_SHIM_HOSTS = ("127.0.0.1", "localhost")
# Restarts of each tf.data service task before the job stops.
MAX_SERVICE_RESTARTS = 5


def pick_ports(count: int) -> List[int]:
    """``count`` distinct free ports on this host."""
    ports: List[int] = []
    while len(ports) < count:
        port = portpicker.pick_unused_port()
        if port not in ports:
            ports.append(port)
    return ports


# Runs first in every task: asks for SIGKILL when the launcher dies (Linux
# PR_SET_PDEATHSIG, kept across exec), then becomes the task. Not a preexec_fn: that
# forces fork() where subprocess would vfork, and fork() runs grpc's atfork handlers in
# a process with live gRPC threads (measured: an abort in the child, a core dump).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the launcher died before the signal was set\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n")


def kill_process_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM then SIGKILL the process group led by ``proc`` (started with its own session)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class LocalCluster:
    """S servers and W workers of one script, each a separate process.

    Args:
      script: the Python script every process runs (or a list: argv after the interpreter).
      server_num, worker_num: the cluster's size.
      args: extra arguments for the script.
      env: extra environment for every process (overrides the defaults below).
      timeout: seconds the whole cluster may run before :meth:`wait` kills it and raises.
      log_dir: where ``serverlog.N`` / ``workerlog.N`` go (a temporary folder by default).
      config_mode: "env" writes TFPSX_* endpoint variables, "tf_config" writes TF_CONFIG,
        "scheduler" adds a scheduler process (``python -m tfpsx.control.scheduler``) that every
        server and worker registers with (each asks for the rank of its log's number).
      host: the address every task binds; 127.0.0.1 by default.
      loopback_only: keep TF's servers off every address but loopback (TF binds 0.0.0.0
        whatever ``host`` says): each task preloads :mod:`tfpsx.launcher.loopback`'s bind
        shim; where it was not built, :meth:`start` warns on stderr, naming the ports.
        False (``tfpsx-run --expose``) keeps TF's own binding, for a job other machines
        must reach.
      token: the scheduler's TFPSX_TOKEN, in "scheduler" mode.
      chief: add a ``chief`` task (TF_CONFIG type ``chief``, as Kubeflow writes it): it is
        the training cluster's worker rank 0 (``chieflog.0``), and the ``worker_num``
        workers follow as ranks 1..W (their TF_CONFIG indices stay 0..W-1).
      evaluator: add an ``evaluator`` task (``evaluatorlog.0``), outside the training
        cluster as TF defines it: its TF_CONFIG has task type ``evaluator`` and the
        training cluster, no task's cluster lists it; the other modes give it
        ``TFPSX_ROLE=evaluator`` and nothing to join.
      data_workers: N > 0 adds TF's tf.data service (:mod:`tfpsx.data.service`): a
        ``dispatcher`` (``dispatcherlog.0``, its journal in ``log_dir/dispatcher``) and N
        ``data_worker`` tasks (``data_workerlog.i``), on the job's host and kept on
        loopback like its TF servers; every training task gets the dispatcher's address
        in ``TFPSX_DATA_SERVICE`` (``tfpsx.data.splits`` reads through it). One that exits
        is started again on its address (:meth:`supervise`).
    """

    def __init__(self, script, server_num: int = 1, worker_num: int = 2,
                 args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
                 timeout: float = 120.0, log_dir: Optional[str] = None,
                 config_mode: str = "env", host: str = "127.0.0.1", token: Optional[str] = None,
                 chief: bool = False, evaluator: bool = False, loopback_only: bool = True,
                 data_workers: int = 0):
        if loopback_only and not _cluster.is_loopback(host):
            raise ValueError(f"LocalCluster: host {host!r} is not a loopback address, but "
                             "loopback_only=True keeps the job's servers on loopback; give "
                             "host='127.0.0.1', or loopback_only=False (tfpsx-run --expose) "
                             "to expose the job")
        if loopback_only and host not in _SHIM_HOSTS:
            # The shim binds 127.0.0.1: peers dialling 127.0.1.1 or ::1 would be refused
            # until the start-up timeout.
            raise ValueError(f"LocalCluster: host {host!r} is a loopback address, but the "
                             "loopback bind shim keeps a local job's servers on 127.0.0.1, "
                             "where peers dialling that host do not reach them; give "
                             "host='127.0.0.1' (or 'localhost'), or loopback_only=False "
                             "(tfpsx-run --expose) to bind as TensorFlow does")
        if config_mode not in ("env", "tf_config", "scheduler"):
            raise ValueError("config_mode: expected 'env', 'tf_config' or 'scheduler', got "
                             f"{config_mode!r}")
        # No servers: a collective job (its script calls tfpsx.init(is_collective=True)).
        settings.parse_int(server_num, "server_num", minimum=0)
        # With a chief, the chief alone may train (TF_CONFIG then has no "worker" job).
        settings.parse_int(worker_num, "worker_num", minimum=0 if chief else 1)
        self.data_workers = settings.parse_int(data_workers, "data_workers", minimum=0)
        self.chief, self.evaluator = bool(chief), bool(evaluator)
        self.argv = [script] if isinstance(script, str) else list(script)
        self.argv += list(args)
        self.server_num, self.worker_num = server_num, worker_num
        self.env = dict(env or {})
        self.timeout = timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tfpsx-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.config_mode = config_mode
        self.token = token
        self.host = host
        self.loopback_only = bool(loopback_only)
        shim = loopback.shim_path() if self.loopback_only else None
        # A path LD_PRELOAD can carry (a copy where the install's path has a space).
        self.shim = loopback.preloadable(shim) if shim is not None else None
        self._warned_exposed = False
        self._next_exposure_check = 0.0
        self._pick_addresses()
        # The scheduler's journal: a scheduler restarted with it takes this job back. A
        # new job starts without one.
        self.scheduler_state = os.path.join(self.log_dir, "scheduler.state")
        self._forget_journal()
        self.procs: Dict[Task, subprocess.Popen] = {}
        self._logs: Dict[Task, object] = {}
        self._started_at: Optional[float] = None
        self.service_restarts: Dict[Task, int] = {}

    def _forget_journal(self) -> None:
        for stale in (self.scheduler_state, self.scheduler_state + ".tmp"):
            if os.path.exists(stale):
                os.remove(stale)
        # (the tf.data dispatcher's: its workers' addresses are of the last incarnation)
        shutil.rmtree(os.path.join(self.log_dir, "dispatcher"), ignore_errors=True)

    def _pick_addresses(self) -> None:
        service = 1 + self.data_workers if self.data_workers else 0
        ports = [f"{self.host}:{p}" for p in
                 pick_ports(self.server_num + self.worker_num + 2 + service)]
        self.servers = ports[:self.server_num]
        self.workers = ports[self.server_num:self.server_num + self.worker_num]
        extra = iter(ports[self.server_num + self.worker_num:])
        self.scheduler_address = next(extra) if self.config_mode == "scheduler" else None
        self.chief_address = next(extra) if self.chief else None
        self.dispatcher_address = next(extra) if service else None
        self.data_worker_addresses = [next(extra) for _ in range(self.data_workers)]

    @property
    def primary(self) -> Task:
        """The task whose end ends the job: the chief, else worker 0."""
        return (_cluster.CHIEF, 0) if self.chief else (_cluster.WORKER, 0)

    def training_workers(self) -> List[str]:
        """Every training worker's address in rank order (the chief first)."""
        return [self.chief_address] * self.chief + self.workers

    def rank(self, role: str, index: int) -> int:
        """A task's rank in its tfpsx role: the chief is worker 0, worker i is i + 1 then."""
        if role == _cluster.CHIEF:
            return 0
        return index + 1 if role == _cluster.WORKER and self.chief else index

    def _tf_config(self, role: str, index: int) -> Dict:
        cluster = {"ps": self.servers} if self.servers else {}
        if self.chief:
            cluster["chief"] = [self.chief_address]
        if self.workers:
            cluster["worker"] = self.workers
        # The evaluator is outside the training cluster, as TF defines it (a coordinator
        # that connects to every task of its spec would wait for it forever).
        job = "ps" if role == _cluster.SERVER else role
        return {"cluster": cluster, "task": {"type": job, "index": index}}

    # ------------------------------------------------------------------ processes
    def task_env(self, role: str, index: int) -> Dict[str, str]:
        """The environment one task runs with."""
        # (A listen port is one process's: every task inheriting it would bind the same.)
        env = {k: v for k, v in os.environ.items()
               if k not in ("TF_CONFIG", "TFPSX_LISTEN_PORT")
               and k not in _cluster.CLUSTER_ENV_VARS}
        env.update({"PYTHONUNBUFFERED": "1", "TFPSX_METRICS_DIR": self.log_dir})
        # TF's C++ info and warning lines stay out of the logs unless the user asked.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # tfpsx's own roles: the chief trains as worker rank 0.
        tfpsx_role = _cluster.WORKER if role == _cluster.CHIEF else role
        rank = self.rank(role, index)
        if role in (_cluster.DISPATCHER, _cluster.DATA_WORKER):
            pass  # TF's tf.data service: no part of the training cluster
        elif self.config_mode == "tf_config":
            env["TF_CONFIG"] = json.dumps(self._tf_config(role, index))
        elif role == _cluster.EVALUATOR:
            env[_cluster.ENV_ROLE] = role  # outside the training cluster: nothing to join
        elif self.config_mode == "scheduler":
            endpoint = (self.servers[index] if role == _cluster.SERVER
                        else self.scheduler_address if role == _cluster.SCHEDULER
                        else self.training_workers()[rank])
            host, port = endpoint.rsplit(":", 1)
            env.update({_cluster.ENV_ROLE: tfpsx_role,
                        _cluster.ENV_SCHED_ADDR: self.scheduler_address,
                        _cluster.ENV_SERVER_NUM: str(self.server_num),
                        _cluster.ENV_WORKER_NUM: str(self.worker_num + self.chief)})
            if role == _cluster.SCHEDULER:
                env["TFPSX_SCHED_STATE"] = self.scheduler_state
            else:
                env.update({_cluster.ENV_RANK: str(rank), "TFPSX_HOST": host,
                            "TFPSX_PORT": port, "TFPSX_NODE_ID": f"local-{role}-{index}"})
            if self.token is not None:
                env[_cluster.ENV_TOKEN] = self.token
        else:
            env.update({_cluster.ENV_ROLE: tfpsx_role, _cluster.ENV_RANK: str(rank),
                        _cluster.ENV_WORKER_ENDPOINTS: ",".join(self.training_workers())})
            if self.servers:
                env[_cluster.ENV_SERVER_ENDPOINTS] = ",".join(self.servers)
        if role in (_cluster.WORKER, _cluster.CHIEF):
            env["TFPSX_STOPPED_FILE"] = self.stopped_path(role, index)
        if self.dispatcher_address is not None and role != _cluster.DATA_WORKER:
            env[_cluster.ENV_DATA_SERVICE] = f"grpc://{self.dispatcher_address}"
        env.update(self.env)
        if self.shim is not None:
            loopback.confine(env, self.shim, self.tf_ports())
        elif not self.loopback_only:
            loopback.release(env)  # a shim inherited from a confined parent's environment
        return env

    def tf_ports(self) -> List[int]:
        """The ports of the job's TensorFlow servers (servers, chief, workers, and the
        tf.data service's)."""
        addresses = self.servers + self.workers + ([self.chief_address] if self.chief else [])
        addresses += self.data_worker_addresses + (
            [self.dispatcher_address] if self.dispatcher_address else [])
        return [int(a.rsplit(":", 1)[1]) for a in addresses]

    def _warn_if_exposed(self) -> None:
        if self.loopback_only and self.shim is None and not self._warned_exposed:
            self._warned_exposed = True
            print(loopback.exposure_warning(
                self.tf_ports(), "the loopback bind shim (tfpsx/_loopback_bind*.so) was not "
                "built; reinstall tfpsx (pip install .) with a C++ compiler to build it"),
                file=sys.stderr, flush=True)

    def check_exposure(self, every: float = 0.5) -> None:
        """In a job kept on loopback, reads (at most every ``every`` seconds) what the
        job's TF ports listen on; one that another machine could reach (the shim did
        not take effect) stops the job: every task is killed and
        :class:`~tfpsx.errors.ExposedPortError` names the ports and addresses."""
        if not self.loopback_only or time.monotonic() < self._next_exposure_check:
            return
        self._next_exposure_check = time.monotonic() + every
        reachable = loopback.exposed(loopback.listening(self.tf_ports()))
        if not reachable:
            return
        self.stop()
        listed = "; ".join(f"port {p} on {', '.join(a)}" for p, a in sorted(reachable.items()))
        why = ("the loopback bind shim (tfpsx/_loopback_bind*.so) was not built; reinstall "
               "tfpsx (pip install .) with a C++ compiler" if self.shim is None else
               f"the loopback bind shim ({self.shim}) did not take effect in the task")
        raise ExposedPortError(
            f"local job stopped: its TensorFlow servers listened where other machines reach "
            f"them ({listed}) though the job is kept on loopback: {why}. Every task was "
            "killed. Run it with --expose (LocalCluster(loopback_only=False)) if other "
            "machines are meant to reach it (docs/security.md)")

    def log_path(self, role: str, index: int) -> str:
        if role == _cluster.SCHEDULER:
            return os.path.join(self.log_dir, "scheduler.log")
        return os.path.join(self.log_dir, f"{role}log.{index}")

    def stopped_path(self, role: str, index: int) -> str:
        """The file a training task creates when its ``tfpsx.stop_worker()`` returned."""
        return os.path.join(self.log_dir, f".stopped.{role}.{index}")

    def stopped(self, role: str, index: int) -> bool:
        """Whether the task's current process called ``tfpsx.stop_worker()``: its
        training is done (an exit after it, even a kill, needs no new process)."""
        return os.path.exists(self.stopped_path(role, index))

    def start_task(self, role: str, index: int, extra_env: Optional[Mapping[str, str]] = None
                   ) -> subprocess.Popen:
        """Starts one task (again, after it exited or was killed)."""
        task = (role, index)
        old = self.procs.get(task)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{role} {index} is still running (pid {old.pid})")
        try:  # (the previous process's; this one has not stopped)
            os.remove(self.stopped_path(role, index))
        except FileNotFoundError:
            pass
        env = self.task_env(role, index)
        env.update(extra_env or {})
        if task in self._logs:
            self._logs[task].close()  # the previous process's
        log = open(self.log_path(role, index), "ab")
        self._logs[task] = log
        # `-m tfpsx.control.scheduler` would warn: the package imports the module first.
        argv = (["-c", "import sys; from tfpsx.control.scheduler import main; sys.exit(main())"]
                if role == _cluster.SCHEDULER else self._service_argv(role, index)
                if role in (_cluster.DISPATCHER, _cluster.DATA_WORKER) else self.argv)
        proc = subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[task] = proc
        if self._started_at is None:
            self._started_at = time.monotonic()
        return proc

    def _service_argv(self, role: str, index: int) -> List[str]:
        run = ["-c", "import sys; from tfpsx.data.service import main; sys.exit(main())", role]
        if role == _cluster.DISPATCHER:
            port = self.dispatcher_address.rsplit(":", 1)[1]
            return run + ["--port", port, "--work_dir", os.path.join(self.log_dir, "dispatcher")]
        host, port = self.data_worker_addresses[index].rsplit(":", 1)
        return run + ["--port", port, "--host", host, "--dispatcher", self.dispatcher_address]

    def service_tasks(self) -> List[Task]:
        """The tf.data service's tasks: the dispatcher, then the data workers."""
        if not self.data_workers:
            return []
        return [(_cluster.DISPATCHER, 0)] + [(_cluster.DATA_WORKER, i)
                                             for i in range(self.data_workers)]

    def supervise(self) -> List[Tuple[Task, int]]:
        """Starts again, on its address, each tf.data service task that exited (the
        dispatcher takes the service back from its journal; what a data worker had not
        delivered the training tasks read again, :mod:`tfpsx.data.service`), up to
        :data:`MAX_SERVICE_RESTARTS` times each; then checks the job's ports
        (:meth:`check_exposure`). Returns the (task, exit code) started again.

        Raises:
          ClusterTimeoutError: a service task failed more often than that (every task
            is killed first).
        """
        again = []
        for task in self.service_tasks():
            proc = self.procs.get(task)
            if proc is None or proc.poll() is None:
                continue
            count = self.service_restarts.get(task, 0)
            if count >= MAX_SERVICE_RESTARTS:
                self.stop()
                raise ClusterTimeoutError(
                    f"{task[0]} {task[1]} of the tf.data service exited {count + 1} times "
                    f"(last code {proc.returncode}; see {self.log_path(*task)}); every task "
                    "was killed")
            self.service_restarts[task] = count + 1
            with open(self.log_path(*task), "a") as log:
                log.write(f"\n===== restart {count + 1} of {MAX_SERVICE_RESTARTS} after exit "
                          f"code {proc.returncode} =====\n")
            self.start_task(*task)
            again.append((task, proc.returncode))
        self.check_exposure()
        return again

    def add_worker(self) -> Task:
        """Starts one more worker on a free port: in "scheduler" mode it joins the running
        job with the next rank (the scheduler needs TFPSX_MAX_WORKER_NUM above the job's
        worker count: give it in ``env``). Returns its task."""
        if self.config_mode != "scheduler":
            raise ValueError("add_worker: a worker joins a running job through the scheduler "
                             f"(config_mode 'scheduler'), not {self.config_mode!r}")
        (port,) = pick_ports(1)
        self.workers.append(f"{self.host}:{port}")
        task = (_cluster.WORKER, len(self.workers) - 1)
        self.start_task(*task)
        return task

    def tasks(self) -> List[Task]:
        """Every task of the job; the scheduler (if any) first, then the tf.data service
        (if any), the evaluator (if any) last."""
        return ([(_cluster.SCHEDULER, 0)] * (self.config_mode == "scheduler") +
                self.service_tasks() +
                [(_cluster.SERVER, i) for i in range(self.server_num)] +
                [(_cluster.CHIEF, 0)] * self.chief +
                [(_cluster.WORKER, i) for i in range(len(self.workers))] +
                [(_cluster.EVALUATOR, 0)] * self.evaluator)

    def start(self, tasks: Optional[Iterable[Task]] = None) -> "LocalCluster":
        """Starts the given tasks (all by default)."""
        self._warn_if_exposed()
        for role, index in (self.tasks() if tasks is None else tasks):
            self.start_task(role, index)
        return self

    def restart(self, reason: str) -> "LocalCluster":
        """The whole job again: every task killed (by PID), new free ports, no scheduler
        journal (a new incarnation of the job), every task started; each log gets a line
        with ``reason`` and goes on."""
        self.stop()
        self._pick_addresses()
        self._forget_journal()
        for role, index in self.tasks():
            with open(self.log_path(role, index), "a") as log:
                log.write(f"\n===== tfpsx-run: {reason} =====\n")
        return self.start()

    def kill(self, role: str, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to one task's process group and waits for it to exit."""
        proc = self.procs[(role, index)]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def wait(self, tasks: Optional[Iterable[Task]] = None, timeout: Optional[float] = None
             ) -> Dict[Task, int]:
        """Waits for tasks (all started ones by default) to exit; returns their exit codes.

        Raises:
          ClusterTimeoutError: the deadline passed; every task is killed first, and the
            message names the ones still running and the tail of their logs.
        """
        wanted = list(self.procs) if tasks is None else list(tasks)
        if timeout is None:  # the cluster's deadline, from its start
            timeout = (self._started_at or time.monotonic()) + self.timeout - time.monotonic()

        def past_deadline(running, _waited) -> ClusterTimeoutError:
            tails = "\n".join(f"--- {r} {i} (pid {self.procs[(r, i)].pid}) log tail:\n"
                              f"{self.log(r, i)[-1500:]}" for r, i in running)
            self.stop()
            return ClusterTimeoutError(
                f"local cluster ran past its deadline; killed still-running tasks "
                f"{running}\n{tails}")

        wait_for(lambda _left: [t for t in wanted if self.procs[t].poll() is None],
                 lambda running: not running, max(0.0, timeout), past_deadline,
                 check=self.supervise)
        return {t: self.procs[t].returncode for t in wanted}

    def log(self, role: str, index: int) -> str:
        """The log of one task so far."""
        task = (role, index)
        if task in self._logs:
            self._logs[task].flush()
        try:
            with open(self.log_path(role, index), encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def metrics(self, role: str, index: int, event: Optional[str] = None) -> List[dict]:
        """The metrics records one task emitted (``tfpsx.metrics.emit``), oldest first."""
        return metrics.read(self.log_dir, role, index, event)

    def logs(self) -> str:
        """Every task's log, headed by its name (for assertion messages)."""
        return "\n".join(f"===== {r} {i} =====\n{self.log(r, i)}" for r, i in sorted(self.procs))

    def stop(self) -> None:
        """Kills every task still running, by PID (its process group), and closes logs."""
        for proc in self.procs.values():
            kill_process_group(proc)
        for log in self._logs.values():
            log.close()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
