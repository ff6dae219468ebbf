"""Every ``TFPSX_*`` setting in one registry: name, type, default, parser and doc.

Code reads a setting through :func:`get` (an argument, when given, overrides the
environment), never ``os.environ`` directly, so a value is parsed and validated one way
everywhere and a bad one is a ``ValueError`` that names the variable, the value and what
was expected. The tables of variables in docs/settings.md are generated from this
registry (``python -m tfpsx.settings`` prints them; a test keeps the page in step).

This module is a bottom layer: it imports nothing from tfpsx (``setup.py`` loads it by
path, before the package is installed).

Example:
  >>> from tfpsx import settings
  >>> settings.get("TFPSX_RPC_TIMEOUT")              # 30.0 unless the variable is set
  >>> settings.get("TFPSX_RPC_TIMEOUT", override=5)  # an argument wins
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

# ----------------------------------------------------------------------------- parsers


def parse_int(value: Any, what: str, minimum: int = 0) -> int:
    """Parses a non-bool integer (an int, or a string of digits) >= ``minimum``."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        number = int(value)
    else:
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    if number < minimum:
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    return number


def parse_float(value: Any, what: str, minimum: float = 0.0) -> float:
    """Parses a number > ``minimum`` (e.g. a timeout in seconds)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number of seconds > {minimum:g}, "
                         f"got {value!r}") from None
    if isinstance(value, bool) or not number > minimum or math.isnan(number):
        raise ValueError(f"{what}: expected a number of seconds > {minimum:g}, got {value!r}")
    return number


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(value: Any, what: str) -> bool:
    """Parses True/False or one of 1/0, true/false, yes/no, on/off (never ``bool("0")``)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{what}: expected one of {', '.join(_TRUE + _FALSE)}, got {value!r}")


def parse_port(value: Any, what: str) -> int:
    """Parses a TCP port, 1-65535."""
    try:
        number = parse_int(value, what, 1)
    except ValueError:
        number = 0
    if not 1 <= number <= 65535:
        raise ValueError(f"{what}: expected a TCP port (an integer 1-65535), got {value!r}")
    return number


def _as_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a string, got {value!r}")
    return value


# ----------------------------------------------------------------------------- registry

_PARSERS: Dict[str, Callable[[Any, str], Any]] = {
    "seconds": parse_float,
    "int": lambda v, w: parse_int(v, w, 0),
    "count": lambda v, w: parse_int(v, w, 1),
    "bool": parse_bool,
    "port": parse_port,
    "str": _as_str,
    "path": _as_str,
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``TFPSX_*`` variable.

    Attributes:
      name: the variable.
      type: "seconds", "int" (>= 0), "count" (>= 1), "bool", "port", "str", "path", or a
        description of a value the cluster resolver parses ("host:port", ...).
      default: the value when unset (None: no default).
      doc: one line for the docs.
      group: the docs table it is listed in.
      read_by: who reads it, when not tfpsx's Python code (e.g. "setup.py").
    """
    name: str
    type: str
    default: Any
    doc: str
    group: str
    read_by: str = ""

    def parse(self, value: Any, what: Optional[str] = None) -> Any:
        parser = _PARSERS.get(self.type)
        if parser is None:
            raise ValueError(f"{self.name} ({self.type}) is parsed by the cluster resolver "
                             "(tfpsx.cluster), not by settings.get()")
        return parser(value, what or self.name)


_GROUPS = {
    "cluster": "Where the cluster comes from (read by `tfpsx.init()`)",
    "scheduler": "Scheduler registration (with `TFPSX_SCHED_ADDR`)",
    "timeouts": "Bounded waits: nothing waits forever, each wait says what it waits for",
    "runtime": "Runtime switches",
    "build": "Building the op library (read by `setup.py`)",
}

SETTINGS: Dict[str, Setting] = {s.name: s for s in [
    # cluster
    Setting("TFPSX_ROLE", "server | worker | scheduler", None,
            "this process's role", "cluster"),
    Setting("TFPSX_RANK", "int", None,
            "this process's rank within its role (optional with a scheduler: asks for it)",
            "cluster"),
    Setting("TFPSX_SERVER_ENDPOINTS", "host:port list", None,
            "comma-separated host:port of every server, rank order (no scheduler)", "cluster"),
    Setting("TFPSX_WORKER_ENDPOINTS", "host:port list", None,
            "comma-separated host:port of every worker, rank order (no scheduler)", "cluster"),
    Setting("TFPSX_DENSE_ENDPOINTS", "str", None,
            "hybrid mode: comma-separated host:port of every worker's dense all-reduce "
            "server, rank order (each binds its own port); unset: each worker picks a free "
            "port and they meet on server 0", "cluster"),
    Setting("TFPSX_LOOPBACK_PORTS", "str", None,
            "set by the launcher (tfpsx-run, LocalCluster) in each task of a local job: the "
            "job's TF ports, whose wildcard binds the preloaded bind shim moves to loopback "
            "(a task whose server listens beyond it stops; docs/security.md)", "cluster",
            read_by="the loopback bind shim and tfpsx.control.sockets"),
    Setting("TFPSX_STOPPED_FILE", "str", None,
            "set by the launcher (tfpsx-run, LocalCluster) in each training task: a file "
            "tfpsx.stop_worker() creates once the worker's training is done, so that a "
            "worker killed after it is not started again into a job that ended", "cluster",
            read_by="tfpsx.stop_worker"),
    Setting("TFPSX_DATA_SERVICE", "str", None,
            "set by the launcher (tfpsx-run --data_workers N) in each training task: the "
            "job's tf.data service dispatcher (grpc://host:port), through whose workers "
            "tfpsx.data.splits reads and parses its splits (docs/data.md)", "cluster",
            read_by="tfpsx.data.splits"),
    Setting("TFPSX_LISTEN_PORT", "port", None,
            "the port this process's server listens on, when the address the cluster lists "
            "for it is not its own (a NAT, a container's mapped port, a proxy): the others "
            "dial the listed address; unset: the listed address's port", "cluster"),
    Setting("TFPSX_SCHED_ADDR", "host:port", None,
            "the scheduler: it assigns ranks and endpoints", "cluster"),
    Setting("TFPSX_SERVER_NUM", "count", None,
            "how many servers the job has", "cluster"),
    Setting("TFPSX_WORKER_NUM", "count", None,
            "how many workers the job has", "cluster"),
    Setting("TFPSX_MAX_WORKER_NUM", "count", None,
            "the scheduler: how many workers it admits in all (default TFPSX_WORKER_NUM); "
            "workers beyond TFPSX_WORKER_NUM join the running job (async and GEO)",
            "scheduler"),
    # scheduler registration
    Setting("TFPSX_TOKEN", "str", None,
            "shared secret; a registration without it is refused; required when the "
            "scheduler listens beyond loopback (docs/security.md)", "scheduler"),
    Setting("TFPSX_HOST", "str", None,
            "the address this node serves on (default: the local IP that routes to the "
            "scheduler)", "scheduler"),
    Setting("TFPSX_PORT", "int", None,
            "the port this node registers and serves on (default: a free one; 0 lets the "
            "scheduler pick); with TFPSX_LISTEN_PORT, the port the others dial",
            "scheduler"),
    Setting("TFPSX_NODE_ID", "str", None,
            "stable node id (default host:pid); a node that re-registers with it keeps its rank",
            "scheduler"),
    Setting("TFPSX_SCHED_STATE", "path", None,
            "the scheduler journals its job state there; a scheduler restarted with it "
            "takes the job back (tfpsx-run: <log_dir>/scheduler.state)", "scheduler"),
    Setting("TFPSX_RESTART_WAIT", "seconds", 120.0,
            "the scheduler, once every worker died and none finished (a lost server takes "
            "them all): how long it keeps the job for them to be started again (an "
            "orchestrator's restart policy) before the job ends", "scheduler"),
    Setting("TFPSX_SCHED_LOSS_TIMEOUT", "seconds", 600.0,
            "how long a server keeps serving while the scheduler is unreachable (waiting for "
            "a restarted one) before it exits with an error", "scheduler"),
    Setting("TFPSX_TLS_CERT", "path", None,
            "PEM certificate: the scheduler serves TLS with cert + key", "scheduler"),
    Setting("TFPSX_TLS_KEY", "path", None, "PEM private key of TFPSX_TLS_CERT", "scheduler"),
    Setting("TFPSX_TLS_CA", "path", None,
            "PEM CA file nodes verify the scheduler with", "scheduler"),
    # timeouts
    Setting("TFPSX_CONNECT_TIMEOUT", "seconds", 120.0,
            "a worker waiting for its servers (or a node for the scheduler) to accept "
            "connections", "timeouts"),
    Setting("TFPSX_REGISTER_TIMEOUT", "seconds", 600.0,
            "servers waiting for every worker to call init_worker() (the error lists the "
            "missing ones); nodes waiting for the cluster to complete", "timeouts"),
    Setting("TFPSX_HEARTBEAT_INTERVAL", "seconds", 2.0,
            "how often a node sends a heartbeat", "timeouts"),
    Setting("TFPSX_HEARTBEAT_TIMEOUT", "seconds", 60.0,
            "a node silent this long is reported lost and no longer waited for", "timeouts"),
    Setting("TFPSX_BARRIER_TIMEOUT", "seconds", 600.0, "barrier_worker()", "timeouts"),
    Setting("TFPSX_RPC_TIMEOUT", "seconds", 30.0,
            "one control call (to PS 0 or the scheduler); GEO's last sync at the end",
            "timeouts"),
    Setting("TFPSX_RECOVERY_WAIT", "seconds", 0.25,
            "how often a non-chief polls for the chief's init (TF's own: 30 s)", "timeouts"),
    Setting("TFPSX_SESSION_TIMEOUT", "seconds", 600.0,
            "a non-chief waiting for the chief to initialize or restore the model", "timeouts"),
    Setting("TFPSX_SESSION_CLOSE_TIMEOUT", "seconds", 120.0,
            "graph mode: TF's close of a training session (after an error, before its "
            "MonitoredSession creates a new one; at the end)", "timeouts"),
    Setting("TFPSX_LEASE_TIMEOUT", "seconds", 60.0,
            "a worker's input splits (tfpsx.data.splits) come back to the others when it "
            "renewed none of its leases for this long (it died); it renews every third of it",
            "timeouts"),
    Setting("TFPSX_SAVE_BARRIER_TIMEOUT", "seconds", 30.0,
            "tfpsx.data.splits(exact_saves=True): the chief's save waits this long for every "
            "worker holding a lease to pause (then saves anyway, naming how many did not); "
            "a barrier whose chief died falls after it", "timeouts"),
    Setting("TFPSX_EVAL_TIMEOUT", "seconds", 900.0,
            "an evaluator waiting for the chief's next checkpoint (or its end of training)",
            "timeouts"),
    Setting("TFPSX_SYNC_STEP_TIMEOUT", "seconds", 300.0,
            "one sync step: the other workers' gradients, or the chief's apply", "timeouts"),
    Setting("TFPSX_SYNC_ATTEMPT", "seconds", 0.5,
            "graph-mode sync: the longest the chief's run waits in the graph for a step's "
            "gradients before it reads the group again (a worker that left or died)",
            "timeouts"),
    Setting("TFPSX_STALENESS_TIMEOUT", "seconds", 300.0,
            "bounded staleness: a worker waiting for the slowest", "timeouts"),
    Setting("TFPSX_COLLECTIVE_TIMEOUT", "seconds", 600.0,
            "one collective (an all-reduce or a broadcast) waiting for the other workers: "
            "the bound behind the peer watch, which names a lost rank sooner", "timeouts"),
    Setting("TFPSX_COLLECTIVE_LINGER", "seconds", 1.0,
            "a collective rank leaving without a scheduler: how long it stays after its "
            "last all-reduce, for the peers' pulls of its bytes (with a scheduler the "
            "barrier there makes it exact)", "timeouts"),
    Setting("TFPSX_LOST_GRACE", "seconds", 10.0,
            "a worker that lost a server: how long its training code gets to fail by "
            "itself before the process exits with code 138 (retryable)", "timeouts"),
    Setting("TFPSX_STOP_GRACE", "seconds", 60.0,
            "tfpsx-run on SIGTERM: how long the chief and the workers get to end on their "
            "own (a stream input stops and the chief saves its last checkpoint) before "
            "every process is stopped", "timeouts"),
    Setting("TFPSX_INPUT_COMMIT_SECONDS", "seconds", 0.5,
            "how often a worker commits the input positions of its applied steps to PS 0 "
            "(tfpsx.data.splits): a worker killed repeats at most its steps of this long "
            "(and the batches in flight); each commit is a remote call (every 50 ms cost "
            "the Criteo job 11% more context switches than a static cut's, every 0.2 s "
            "3% of its examples/s)", "timeouts"),
    Setting("TFPSX_GEO_RECHECK_SECONDS", "seconds", 300.0,
            "GEO with geo_table_choice='auto': how long a table trains async before the "
            "chief has it run rounds again for a few rounds, to re-check whether they pay "
            "(each re-check pulls the rows its copy missed)", "timeouts"),
    Setting("TFPSX_GEO_QUIET_ROUND_SECONDS", "seconds", 0.5,
            "GEO with geo_table_choice='auto': while every table trains async (and the dense "
            "weights too), a round moves nothing, so it runs at most this often (and every "
            "k_steps); the steps' input positions commit as async's. Such a round reports "
            "the steps to global_step (graph mode: a last_step or a save every N steps may "
            "run this long past) and reads the job's choice (a worker learns of a table "
            "trying rounds within this long)", "timeouts"),
    # runtime switches
    Setting("TFPSX_METRICS_DIR", "path", None,
            "folder where every process appends its metrics as JSON lines "
            "(metrics.<role>.<rank>.jsonl); tfpsx-run sets it to --log_dir", "runtime"),
    Setting("TFPSX_CRASH_TRACE", "bool", True,
            "a process that dies of a fatal signal (SIGSEGV ...) first writes its native stack "
            "and every Python thread's to stderr (its log); off: signal handlers left alone",
            "runtime"),
    Setting("TFPSX_MALLOC_TUNING", "bool", True,
            "glibc's malloc keeps the buffers a step frees (below 32 MiB from the heap, up "
            "to 1 GiB kept at a heap's top): with glibc's defaults each step's buffers were "
            "fresh pages, faulted in again (the Criteo job's Keras workers 1.3x the CPU); "
            "left alone where the user tunes malloc (MALLOC_*_, GLIBC_TUNABLES, a preloaded "
            "allocator); off: glibc's defaults", "runtime"),
    Setting("TFPSX_TABLE_HUGE_PAGES", "bool", False,
            "transparent huge pages for table rows (off: slower in a TF process on these VMs)",
            "runtime", read_by="the C++ table core"),
    Setting("TFPSX_TIER_IO_URING", "bool", True,
            "a tiered table's batch reads go to the kernel in one io_uring submission where "
            "the kernel allows (off, or no ring: one pread per read)", "runtime",
            read_by="the C++ table core"),
    # build
    Setting("TFPSX_BUILD_JOBS", "count", None,
            "parallel compiler processes (default: the CPU count)", "build", read_by="setup.py"),
    Setting("TFPSX_TF_PYTHON", "path", None,
            "the Python whose TensorFlow the ops are built against (default: the installing "
            "one)", "build", read_by="setup.py"),
    Setting("TFPSX_WITH_CUDA", "bool", False,
            "also compile the CUDA kernels (*.cu.cc) with nvcc", "build", read_by="setup.py"),
]}


def setting(name: str) -> Setting:
    """The registry entry of ``name``; a KeyError names the known settings."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a tfpsx setting; known: {', '.join(SETTINGS)}") \
            from None


def raw(name: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's text, or None when it is unset or blank."""
    setting(name)
    value = (os.environ if env is None else env).get(name)
    return None if value is None or value.strip() == "" else value


def get(name: str, override: Any = None, env: Optional[Mapping[str, str]] = None) -> Any:
    """The value of ``name``: ``override`` if given, else the environment, else the default.

    Raises:
      ValueError: the value does not parse (the message names the variable, or "argument
        for <name>" for an override, the value and what was expected).
    """
    spec = setting(name)
    if override is not None:
        return spec.parse(override, f"argument for {name}")
    value = raw(name, env)
    return spec.default if value is None else spec.parse(value)


def markdown(groups: Sequence[str] = tuple(_GROUPS)) -> str:
    """docs/settings.md's tables of variables, one per group."""
    out = []
    for group in groups:
        out.append(f"**{_GROUPS[group]}**\n")
        out.append("| variable | type | default | what |")
        out.append("| --- | --- | --- | --- |")
        for s in SETTINGS.values():
            if s.group != group:
                continue
            default = "" if s.default is None else (
                f"{s.default:g} s" if s.type == "seconds" else str(s.default).lower())
            doc = s.doc + (f" (read by {s.read_by})" if s.read_by else "")
            out.append(f"| `{s.name}` | {s.type} | {default} | {doc} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
