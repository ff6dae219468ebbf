"""``tfpsx-run``: start a whole PS job of one script on this machine.

Usage::

  tfpsx-run --server_num 2 --worker_num 2 [--log_dir logs] [--no_scheduler]
            [--max_restarts N] [--data_workers N] [--expose] train.py [args]

A scheduler (``log_dir/scheduler.log``) assigns ranks; every server and worker is a
separate process on a free 127.0.0.1 port, logging to ``log_dir/serverlog.N`` and
``log_dir/workerlog.N``; the chief's output also streams to
the console, prefixed with its role. TensorFlow's servers bind every interface on their
own; the job's listen on loopback only (:mod:`tfpsx.launcher.loopback`), unless
``--expose`` says the job is meant to be reached from other machines. TFPSX_TOKEN, when set, is the scheduler's token.
The launcher watches every process it started. A server or the chief (worker 0) that
fails ends the job: every process is stopped and the summary names the one that failed
and its log. With ``--max_restarts N`` such a failure restarts the whole job instead (new
ports, a fresh scheduler; the chief resumes from its last checkpoint), and a non-chief
worker that fails is started again in place (same rank and address: it registers again,
waits for the chief's session and trains on; in sync it takes the lost worker's part of
each step); N restarts in all. A
scheduler that fails is restarted on its address (up to 3 times; it
journals the job in ``log_dir/scheduler.state`` and takes it back, while servers serve
and workers train on). A non-chief worker that fails is reported and the others go on
(async and GEO train without it). ``--server_num 0`` runs a collective job (workers
only, ``tfpsx.init(is_collective=True)``): any worker that fails ends or, under
``--max_restarts``, restarts the whole job (no rank trains without the others). A task
that finds its port taken between the pick and its bind (exit code 98, a
``PortTakenError``: another launcher, an outgoing connection) starts the job again on
new ports, up to 3 times, outside ``--max_restarts``. The exit code is 0 when every process exits 0,
otherwise the failed one's (128 + N for signal N), after every process started here is
gone (also on Ctrl-C / SIGTERM; on SIGKILL the children die with the launcher). With
``--no_scheduler`` each process gets its cluster from
environment variables (``--config tf_config`` writes TF_CONFIG instead, so a plain TF
script that reads TF_CONFIG runs unchanged).

``--data_workers N`` adds TF's tf.data service (:mod:`tfpsx.data.service`): a dispatcher
(``dispatcherlog.0``) and N tf.data workers (``data_workerlog.i``), on loopback like the
rest; ``tfpsx.data.splits`` reads and parses its splits on them. One that exits is started
again on its address (5 times each, then the job stops).

``--chief`` adds a ``chief`` task (``chieflog.0``; TF_CONFIG type ``chief``, as Kubeflow
writes it; tfpsx's worker rank 0, the workers follow as ranks 1..W). The job then ends
when the chief ends: every other process (workers and servers that only serve, as with
TF's ``ParameterServerStrategy`` loop) gets ``--server_grace`` seconds to exit and is then
stopped, and the exit code is the chief's. ``--evaluator`` adds an ``evaluator`` task
(``evaluatorlog.0``), outside the training cluster as TF defines it: it runs until
training ended and ``--server_grace`` passed (``tfpsx.evaluate_checkpoints`` returns on
its own when the chief's last checkpoint is evaluated); one that fails on its own is
reported at once, training goes on, and the job's exit code is then the evaluator's.

SIGTERM stops a job in order: the launcher forwards it to the chief and the workers and
gives them ``TFPSX_STOP_GRACE`` seconds (60) to end on their own (a job that reads
``tfpsx.data.stream`` stops its stream: each worker trains what it holds, ``fit``
returns and the chief saves its last checkpoint), then stops every process. The exit
code is 0 when every worker ended with 0 in that time, else 143. A second SIGTERM or
Ctrl-C stops everything at once.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from typing import List, Optional

from tfpsx import cluster as _cluster
from tfpsx import settings
from tfpsx.control.watchdog import EXIT_PEER_LOST, EXIT_PORT_TAKEN
from tfpsx.errors import ClusterTimeoutError, ExposedPortError
from tfpsx.launcher import loopback
from tfpsx.launcher.local import MAX_SERVICE_RESTARTS, LocalCluster


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfpsx-run", description="Run a tfpsx parameter-server job on this machine.")
    p.add_argument("--server_num", type=str, default="1",
                   help="number of parameter servers (0: a collective job, workers only)")
    p.add_argument("--worker_num", type=str, default="1", help="number of workers")
    p.add_argument("--log_dir", default="logs", help="folder for per-process logs")
    p.add_argument("--no_scheduler", action="store_true",
                   help="give each process its cluster directly instead of via a scheduler")
    p.add_argument("--config", choices=("env", "tf_config"), default="env",
                   help="with --no_scheduler: TFPSX_* variables (env) or TF_CONFIG")
    p.add_argument("--timeout", type=str, default=None,
                   help="seconds the job may run before it is killed (default: no limit)")
    p.add_argument("--server_grace", type=str, default="60",
                   help="seconds servers (with --chief: every other process) get to exit "
                        "after the last worker (the chief) did; then they are stopped")
    p.add_argument("--chief", action="store_true",
                   help="add a chief task (TF_CONFIG type 'chief'; tfpsx worker rank 0): the "
                        "job ends when it ends, with its exit code")
    p.add_argument("--evaluator", action="store_true",
                   help="add an evaluator task (outside the training cluster) that runs "
                        "until training ended")
    p.add_argument("--max_restarts", type=str, default="0",
                   help="restarts in all: a server or the chief that fails restarts the whole "
                        "job (the chief resumes from its last checkpoint); a non-chief worker "
                        "that fails is started again in place (same rank and address)")
    p.add_argument("--data_workers", type=str, default="0",
                   help="start TF's tf.data service with this many data workers: "
                        "tfpsx.data.splits reads and parses its splits on them")
    p.add_argument("--expose", action="store_true",
                   help="let TensorFlow's servers listen on every interface, as TF does on "
                        "its own (default: loopback only; docs/security.md)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


# TF's C++ runtime writes some lines before it reads TF_CPP_MIN_LOG_LEVEL (absl's
# "before InitializeLog" ones: oneDNN, CPU features); the console drops those below the
# level the job runs with (its log files keep everything).
_CPP_LINE = re.compile(r"^([IWE])\d{4} [\d:.]+ +\d+ [\w.-]+\.cc:\d+\] ")
_ABSL_PREINIT = "WARNING: All log messages before absl::InitializeLog() is called"


def _cpp_level() -> int:
    """The TF_CPP_MIN_LOG_LEVEL the launched processes run with (see task_env)."""
    value = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
    return int(value) if value.isdigit() else 0


class _Tail(threading.Thread):
    """Streams a growing log file to stdout with a prefix until stopped.

    A progress bar (Keras redraws its line after a carriage return) is redrawn in place
    on a terminal; elsewhere only its last state before each newline is printed. Lines
    TF's C++ runtime logs below TF_CPP_MIN_LOG_LEVEL before reading it are left out."""

    def __init__(self, path: str, prefix: str):
        super().__init__(daemon=True, name=f"tfpsx-tail-{prefix}")
        self.path, self.prefix = path, prefix
        self._stop_event = threading.Event()
        self._tty = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
        self._hidden = {"I": 1, "W": 2, "E": 3}
        self._level = _cpp_level()
        self._shown = None  # the progress line on the terminal now

    def _keep(self, line: str) -> bool:
        if line.startswith(_ABSL_PREINIT):
            return self._level < 1
        m = _CPP_LINE.match(line)
        return not m or self._level < self._hidden[m.group(1)]

    def _line(self, text: str) -> None:
        if self._shown is not None:
            sys.stdout.write("\r\033[K")
            self._shown = None
        if self._keep(text):
            sys.stdout.write(f"{self.prefix} {text}\n")
        sys.stdout.flush()

    def _progress(self, text: str) -> None:
        if self._tty and text.strip() and text != self._shown:
            sys.stdout.write(f"\r\033[K{self.prefix} {text}")
            sys.stdout.flush()
            self._shown = text

    def run(self):
        while not os.path.exists(self.path) and not self._stop_event.wait(0.05):
            pass
        with open(self.path, encoding="utf-8", errors="replace", newline="") as f:
            pending = ""  # text since the last newline or carriage return
            while True:
                chunk = f.read()
                if chunk:
                    for piece in re.split(r"(\r|\n)", chunk.replace("\b", "")):
                        if piece == "\n":
                            self._line(pending)
                            pending = ""
                        elif piece == "\r":
                            self._progress(pending)
                            pending = ""
                        else:
                            pending += piece
                    self._progress(pending)
                elif self._stop_event.wait(0.05):
                    if pending:
                        self._line(pending)
                    elif self._shown is not None:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                    return

    def stop(self):
        self._stop_event.set()
        self.join(timeout=5)


MAX_SCHEDULER_RESTARTS = 3  # a scheduler that keeps dying is a failure of its own
MAX_PORT_RESTARTS = 3  # new ports each time: a fourth taken one is no race


def _name(task) -> str:
    role, index = task
    if role in (_cluster.SCHEDULER, _cluster.CHIEF, _cluster.EVALUATOR):
        return f"the {role}"  # one of its kind
    return f"{role} {index}"


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_PEER_LOST:  # restart me
        return "it lost a peer and asks for a restart"
    if code == EXIT_PORT_TAKEN:
        return "another process holds its port"
    if code == 124:
        return "timed out"
    return "failed"


def _stop_in_order(job, workers, interrupted) -> Optional[float]:
    """SIGTERM forwarded to the chief and the workers, which get TFPSX_STOP_GRACE seconds
    to end (a second signal cuts it short). Returns the seconds they took when every
    one ended with 0, else None."""
    grace = settings.get("TFPSX_STOP_GRACE")
    started = time.monotonic()
    live = [t for t in workers if job.procs[t].poll() is None]
    for task in live:
        try:
            job.procs[task].send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    print(f"tfpsx-run: SIGTERM: asked {len(live)} worker(s) to stop; they have {grace:g} s "
          "(TFPSX_STOP_GRACE) to end on their own", file=sys.stderr, flush=True)
    while any(job.procs[t].poll() is None for t in live):
        if len(interrupted) > 1 or time.monotonic() - started > grace:
            stuck = [_name(t) for t in live if job.procs[t].poll() is None]
            print(f"tfpsx-run: {', '.join(stuck)} still running "
                  f"{time.monotonic() - started:.1f} s after SIGTERM; stopping everything",
                  file=sys.stderr, flush=True)
            return None
        time.sleep(0.1)
    codes = {_name(t): job.procs[t].poll() for t in live}
    if any(code != 0 for code in codes.values()):
        print(f"tfpsx-run: after SIGTERM the workers exited with {codes}", file=sys.stderr)
        return None
    return time.monotonic() - started


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        # 0: a collective job (workers only; the script calls tfpsx.init(is_collective=True)).
        server_num = settings.parse_int(args.server_num, "--server_num", minimum=0)
        worker_num = settings.parse_int(args.worker_num, "--worker_num",
                                        minimum=0 if args.chief else 1)
        timeout = (None if args.timeout is None
                   else settings.parse_float(args.timeout, "--timeout"))
        grace = settings.parse_float(args.server_grace, "--server_grace")
        max_restarts = settings.parse_int(args.max_restarts, "--max_restarts", minimum=0)
        data_workers = settings.parse_int(args.data_workers, "--data_workers", minimum=0)
    except ValueError as e:
        print(f"tfpsx-run: {e}", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"tfpsx-run: script {args.script!r} not found", file=sys.stderr)
        return 2
    try:
        job = LocalCluster(args.script, server_num, worker_num, args=args.script_args,
                           timeout=float("inf") if timeout is None else timeout,
                           log_dir=args.log_dir,
                           config_mode=args.config if args.no_scheduler else "scheduler",
                           token=settings.raw(_cluster.ENV_TOKEN), chief=args.chief,
                           evaluator=args.evaluator, loopback_only=not args.expose,
                           data_workers=data_workers)
    except ValueError as e:  # nothing started
        print(f"tfpsx-run: {e}", file=sys.stderr)
        return 2
    if args.expose:
        print(loopback.exposure_warning(job.tf_ports(), "--expose asked for it"),
              file=sys.stderr, flush=True)
    # Our own logs start fresh for this run.
    for role, index in job.tasks():
        open(job.log_path(role, index), "w").close()

    interrupted = []
    stopped_in_order = None  # seconds the workers took to end on SIGTERM

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    primary = job.primary  # the chief, else worker 0: its end ends the job
    tail = _Tail(job.log_path(*primary), f"[{_name(primary).replace('the ', '')}]")
    tail.start()
    start = time.monotonic()
    failed = None  # (task, code): what ends the job
    lost_workers = []  # (task, code) of non-chief workers that failed; the others go on
    finished = set()  # workers killed after their stop_worker(): done, not started again
    evaluator_failed = None  # (task, code) of an evaluator that failed on its own
    exposed = None  # the ExposedPortError that stopped a job kept on loopback
    scheduler_restarts = job_restarts = port_restarts = 0

    def start_again(reason: str):
        """The whole job again (new ports, a fresh scheduler); returns what a new
        incarnation starts with: (failed, lost_workers, scheduler_restarts,
        evaluator_failed)."""
        job.restart(reason)
        finished.clear()
        return None, [], 0, None

    try:
        job.start()
        workers = [t for t in job.tasks() if t[0] in (_cluster.CHIEF, _cluster.WORKER)]
        evaluators = [t for t in job.tasks() if t[0] == _cluster.EVALUATOR]
        services = job.service_tasks()  # they serve until stopped; one that exits: again
        others = [t for t in job.tasks()  # the scheduler, servers
                  if t not in workers and t not in evaluators and t not in services]
        while not interrupted:
            try:
                # A port another machine reaches stops the job; a tf.data service task
                # that exited starts again on its address.
                for task, code in job.supervise():
                    then = ("it takes the service back from its journal"
                            if task[0] == _cluster.DISPATCHER else
                            "the workers read again what it had not delivered")
                    print(f"tfpsx-run: {_name(task)} exited with code {code} ({_how(code)}; "
                          f"see {job.log_path(*task)}); started it again on its address "
                          f"({job.service_restarts[task]} of {MAX_SERVICE_RESTARTS}): {then}",
                          file=sys.stderr, flush=True)
            except ExposedPortError as e:
                exposed = e
                break
            except ClusterTimeoutError as e:
                print(f"tfpsx-run: {e}", file=sys.stderr, flush=True)
                failed = (("launcher", 0), 1)
                break
            if failed is not None:
                if failed[0][0] == "launcher" or job_restarts >= max_restarts:
                    break
                # A server (its share of the model) or the chief is gone: the job comes
                # back whole, and the chief resumes from its last checkpoint.
                job_restarts += 1
                (role, index), code = failed
                print(f"tfpsx-run: {_name((role, index))} exited with code {code} "
                      f"({_how(code)}; see {job.log_path(role, index)}); restarting the job "
                      f"({job_restarts} of {max_restarts}): every process starts again and "
                      "the chief resumes from its last checkpoint", file=sys.stderr, flush=True)
                failed, lost_workers, scheduler_restarts, evaluator_failed = start_again(
                    f"restart {job_restarts} of {max_restarts} after {_name((role, index))} "
                    f"exited with code {code}")
            # A task that could not listen on its port (taken between the pick and the
            # bind): the job starts again on new ports, not counted in --max_restarts.
            taken = [t for t in job.tasks() if t in job.procs
                     and job.procs[t].poll() == EXIT_PORT_TAKEN]
            if taken and port_restarts < MAX_PORT_RESTARTS:
                port_restarts += 1
                print(f"tfpsx-run: {_name(taken[0])} could not listen on its address "
                      f"(another process holds the port; see {job.log_path(*taken[0])}); "
                      f"starting the job again on new ports ({port_restarts} of "
                      f"{MAX_PORT_RESTARTS})", file=sys.stderr, flush=True)
                failed, lost_workers, scheduler_restarts, evaluator_failed = start_again(
                    f"new ports after {_name(taken[0])} found its port taken")
                continue
            for task in evaluators:
                code = job.procs[task].poll()
                if code not in (None, 0) and evaluator_failed is None:
                    # It only reads checkpoints: training goes on without it.
                    evaluator_failed = (task, code)
                    print(f"tfpsx-run: {_name(task)} exited with code {code} ({_how(code)}; "
                          f"see {job.log_path(*task)}); training goes on without it",
                          file=sys.stderr, flush=True)
            # A server or the scheduler that fails while workers run ends the job (its
            # share of the model is gone). One that exits 0 does so after every worker
            # called stop_worker(), while workers may still be finishing.
            for task in others:
                code = job.procs[task].poll()
                if code not in (None, 0) and task[0] == _cluster.SCHEDULER and \
                        scheduler_restarts < MAX_SCHEDULER_RESTARTS:
                    # It holds no model: a new one takes the job back from its journal
                    # while servers serve and workers train on.
                    scheduler_restarts += 1
                    print(f"tfpsx-run: the scheduler exited with code {code} ({_how(code)}); "
                          f"restarting it on {job.scheduler_address} "
                          f"({scheduler_restarts} of {MAX_SCHEDULER_RESTARTS}): the job goes on",
                          file=sys.stderr, flush=True)
                    job.start_task(*task)
                    continue
                if code not in (None, 0):
                    failed = (task, code)
                    print(f"tfpsx-run: {_name(task)} exited with code {code} "
                          f"({_how(code)}) while workers were running; stopping the job",
                          file=sys.stderr)
                    break
            # A worker that exited because it lost a peer (EXIT_PEER_LOST) is a consequence:
            # one that failed by itself, seen in the same pass, is the cause the job names
            # (a killed rank's survivor exits 138 within moments, often before this pass).
            codes = [(task, job.procs[task].poll()) for task in workers]
            for task, code in sorted(codes, key=lambda tc: tc[1] == EXIT_PEER_LOST):
                if failed or code in (None, 0) or task in dict(lost_workers) or \
                        task in finished:
                    continue
                if job.stopped(*task):
                    # Its training was done (tfpsx.stop_worker() returned): killed on its
                    # way out, it has nothing to do again (the job may already be over).
                    finished.add(task)
                    print(f"tfpsx-run: {_name(task)} exited with code {code} ({_how(code)}) "
                          "after its tfpsx.stop_worker(): its training was done; not "
                          "started again", file=sys.stderr, flush=True)
                    continue
                if task == primary or job.server_num == 0:
                    # The chief initializes and checkpoints; in a collective job (no
                    # servers) no rank trains without the others: the job comes back whole.
                    failed = (task, code)
                elif job_restarts < max_restarts:
                    # Its share of the model is on the servers: a new process of the same
                    # rank and address joins the running job.
                    job_restarts += 1
                    print(f"tfpsx-run: {_name(task)} exited with code {code} ({_how(code)}; "
                          f"see {job.log_path(*task)}); starting it again in place "
                          f"({job_restarts} of {max_restarts}): same rank and address, the "
                          "others go on", file=sys.stderr, flush=True)
                    with open(job.log_path(*task), "a") as log:
                        log.write(f"\n===== tfpsx-run: restart {job_restarts} of {max_restarts}"
                                  f" after {_name(task)} exited with code {code} =====\n")
                    job.start_task(*task)
                else:
                    lost_workers.append((task, code))
                    print(f"tfpsx-run: {_name(task)} exited with code {code} "
                          f"({_how(code)}; see {job.log_path(*task)}); the other workers go "
                          "on (async and GEO train without it; sync fails: within "
                          "TFPSX_HEARTBEAT_TIMEOUT with a scheduler, else after "
                          "TFPSX_SYNC_STEP_TIMEOUT; --max_restarts starts it again)",
                          file=sys.stderr, flush=True)
            if failed:
                continue
            if job.chief and job.procs[primary].poll() is not None:
                break  # the chief ended (0: a failure was handled above): so does the job
            if all(job.procs[t].poll() is not None for t in workers):
                break
            if timeout is not None and time.monotonic() - start > timeout:
                failed = (("launcher", 0), 124)
                print(f"tfpsx-run: job ran past --timeout {timeout:g} s; stopping it",
                      file=sys.stderr)
                continue
            time.sleep(0.1)
        if not failed and not interrupted:
            # With a chief, every other process may still run (TF's PSS workers and
            # servers only serve); without one, servers and the evaluator may.
            rest = [t for t in job.tasks() if t != primary] if job.chief else others + evaluators
            deadline = time.monotonic() + grace
            while any(job.procs[t].poll() is None for t in rest) and not interrupted:
                if time.monotonic() > deadline:
                    stuck = [_name(t) for t in rest if job.procs[t].poll() is None]
                    print(f"tfpsx-run: {', '.join(stuck)} still running {grace:g} s after "
                          f"{'the chief' if job.chief else 'the last worker'} exited; "
                          "stopping them", file=sys.stderr)
                    break
                time.sleep(0.1)
            if not job.chief:  # with a chief, its code is the job's
                failed = next(((t, job.procs[t].poll()) for t in others
                               if job.procs[t].poll() not in (None, 0)), None)
            for task in evaluators:
                code = job.procs[task].poll()
                if code not in (None, 0) and evaluator_failed is None:
                    evaluator_failed = (task, code)
        if interrupted == [signal.SIGTERM] and not failed:
            stopped_in_order = _stop_in_order(job, workers, interrupted)
        if failed is None and lost_workers and not job.chief:
            failed = lost_workers[0]
        if failed is None and evaluator_failed is not None:
            failed = evaluator_failed
    finally:
        job.stop()
        tail.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)

    seconds = time.monotonic() - start
    if exposed is not None:
        print(f"tfpsx-run: FAILED after {seconds:.1f} s: {exposed}", file=sys.stderr)
        return 1
    if stopped_in_order is not None:
        print(f"tfpsx-run: stopped on SIGTERM: every worker ended on its own in "
              f"{stopped_in_order:.1f} s (a stream input keeps what is left in the chief's "
              f"last checkpoint); stopped all {len(job.procs)} processes (logs in "
              f"{job.log_dir})", file=sys.stderr)
        return 0
    if interrupted:
        print(f"tfpsx-run: interrupted by signal {interrupted[0]}; stopped all "
              f"{len(job.procs)} processes (logs in {job.log_dir})", file=sys.stderr)
        return 128 + interrupted[0]
    if failed:
        (role, index), code = failed
        where = job.log_path(role, index) if role != "launcher" else job.log_dir
        print(f"tfpsx-run: FAILED: {_name((role, index))} exited with code {code} "
              f"({_how(code)}) after {seconds:.1f} s; see {where}", file=sys.stderr)
        return code if 0 < code < 256 else (128 - code if code < 0 else 1)
    if job.chief:
        print(f"tfpsx-run: job finished: the chief exited 0 in {seconds:.1f} s "
              f"({server_num} server(s), {worker_num} worker(s)"
              f"{', an evaluator' if args.evaluator else ''}; logs in {job.log_dir})", flush=True)
    else:
        print(f"tfpsx-run: job finished: {server_num} server(s), {worker_num} worker(s) exited "
              f"0 in {seconds:.1f} s (logs in {job.log_dir})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
