"""A local job stays off the network: the bind shim its tasks preload (the job's ports
only, from an install whose path has a space too), a task and a launcher that stop a
job whose port another machine reaches, the warning where the shim is missing and the
--expose opt-out, and the scheduler's refusal to listen beyond this machine without a
token. Processes here are plain Python (no TensorFlow): a socket bound as TF's gRPC
server binds it (0.0.0.0 and a dual-stack ::)."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tfpsx import cluster
from tfpsx.control import scheduler
from tfpsx.launcher import loopback, run
from tfpsx.launcher.local import LocalCluster

# Binds as gRPC's wildcard listener does (a dual-stack IPv6 socket on ::, and an IPv4 one
# on 0.0.0.0) on the job's ports, an IPv6-only socket on :: (asyncio's
# create_server(host=None) makes one), the user's own server on 0.0.0.0 (a port not of the
# job), an explicit 127.0.0.1 bind, and a port the task confines itself at run time (a
# server it picked a port for: tfpsx.control.sockets.confine_port); prints "ok"; waits.
_BINDER = r"""
import socket, sys
from tfpsx.control import sockets
dual, four, v6only, own, mine, later = (int(p) for p in sys.argv[1:])
socks = []
def listen(family, address, port, v6only_flag=None):
    s = socket.socket(family, socket.SOCK_STREAM)
    if v6only_flag is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only_flag)
    s.bind((address, port)); s.listen(4); socks.append(s)
listen(socket.AF_INET6, "::", dual, 0)
listen(socket.AF_INET, "0.0.0.0", four)
listen(socket.AF_INET6, "::", v6only, 1)
listen(socket.AF_INET, "0.0.0.0", own)
listen(socket.AF_INET, "127.0.0.1", mine)
sockets.confine_port(later)
listen(socket.AF_INET, "0.0.0.0", later)
print("ok", flush=True)
sys.stdin.read()
"""


def _bind(env, ports):
    proc = subprocess.Popen([sys.executable, "-c", _BINDER, *map(str, ports)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == "ok\n", (line, proc.stderr.read() if proc.poll() is not None else "")
        return proc
    except BaseException:
        proc.kill()
        raise


def _stop(proc):
    proc.kill()
    proc.wait(timeout=10)


def _spaced_shim(tmp_path):
    """The built shim, copied under a folder whose path has a space (a virtualenv in "My
    Projects"): the loader would split it in LD_PRELOAD."""
    shim = loopback.shim_path()
    assert shim is not None, "setup.py builds tfpsx/_loopback_bind*.so"
    folder = tmp_path / "My Projects" / "venv"
    folder.mkdir(parents=True)
    spaced = folder / os.path.basename(shim)
    spaced.write_bytes(open(shim, "rb").read())
    return str(spaced)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["installed", "path with a space"])
def test_the_shim_keeps_the_jobs_ports_on_loopback_and_nothing_else(tmp_path, monkeypatch,
                                                                     where):
    ports = __import__("tfpsx.launcher.local", fromlist=["pick_ports"]).pick_ports(6)
    dual, four, v6only, own, mine, later = ports
    base = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    bare = _bind(base, ports)
    try:
        # Without the shim, what TF does: its wildcard sockets reach every interface.
        seen = loopback.listening(ports)
        assert sorted(loopback.exposed(seen)) == sorted([dual, four, v6only, own, later]), seen
    finally:
        _stop(bare)
    if where == "installed":
        shim = loopback.shim_path()
    else:  # what LocalCluster gives LD_PRELOAD: a copy the loader can parse
        installed, spaced = loopback.shim_path(), _spaced_shim(tmp_path)
        monkeypatch.setattr(loopback, "shim_path", lambda: spaced)
        shim = LocalCluster("train.py", 1, 1, log_dir=str(tmp_path)).shim
        assert " " not in shim and open(shim, "rb").read() == open(installed, "rb").read()
    env = loopback.confine(dict(base, LD_PRELOAD="libm.so.6"), shim, [dual, four, v6only])
    proc = _bind(env, ports)
    try:
        seen = loopback.listening(ports)
        assert sorted(seen) == sorted(ports), seen
        assert seen[dual] == ["::ffff:127.0.0.1"] and seen[four] == ["127.0.0.1"], seen
        assert seen[v6only] == ["::1"] and seen[mine] == ["127.0.0.1"], seen
        assert seen[later] == ["127.0.0.1"], seen  # confined at run time by the task
        assert seen[own] == ["0.0.0.0"], seen  # the user's own server: where it asked
        assert sorted(loopback.exposed(seen)) == [own], seen
        for port in (dual, four, mine, later):  # a peer on this machine reaches them
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        _stop(proc)


def test_confine_puts_the_shim_first_keeps_the_users_preload_and_lists_the_ports():
    env = loopback.confine({"LD_PRELOAD": "/opt/a.so:/x/_loopback_bind.so /b.so"},
                           "/x/_loopback_bind.so", [7002, 7001])
    assert env["LD_PRELOAD"] == "/x/_loopback_bind.so /opt/a.so /b.so"
    assert env[loopback.PORTS_ENV] == "7001,7002"
    assert loopback.confine({}, "/x/s.so", [1])["LD_PRELOAD"] == "/x/s.so"
    with pytest.raises(ValueError, match="LD_PRELOAD cannot carry the path '/My Projects/s.so'"):
        loopback.confine({}, "/My Projects/s.so", [1])
    # An exposed job's tasks: a shim inherited from a confined parent is dropped.
    inherited = {"LD_PRELOAD": "/x/_loopback_bind.so /opt/a.so", loopback.PORTS_ENV: "1"}
    assert loopback.release(inherited) == {"LD_PRELOAD": "/opt/a.so"}
    assert loopback.release({"LD_PRELOAD": "/y/_loopback_bind.cpython-311.so"}) == {}


def test_a_confined_task_whose_server_listens_beyond_loopback_stops(monkeypatch):
    # The task's own check (tfpsx.control.ports.listening runs it after a server starts):
    # no shim in this process, so a wildcard bind on a confined port is exposed.
    from tfpsx.control import ports as task_ports
    from tfpsx.errors import ExposedPortError

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with task_ports.listening("server 0", f"127.0.0.1:{port}"):
            pass  # not confined: nothing to check
        monkeypatch.setenv(loopback.PORTS_ENV, f"1,{port}")
        with pytest.raises(ExposedPortError, match=rf"server 0 listens on 0\.0\.0\.0 port "
                                                   rf"{port}, reachable from other machines.*"
                                                   r"bind shim was not loaded"):
            with task_ports.listening("server 0", f"127.0.0.1:{port}"):
                pass
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_the_launcher_stops_a_job_whose_port_other_machines_reach(tmp_path, monkeypatch,
                                                                 capsys):
    # The shim did not take effect (here: not built): each worker binds its port as TF
    # does; the launcher reads the sockets, kills every task and names the port.
    from tfpsx.errors import ExposedPortError

    monkeypatch.setattr(loopback, "shim_path", lambda: None)
    script = tmp_path / "bind.py"
    script.write_text(
        "import os, socket, time\n"
        "if os.environ['TFPSX_ROLE'] == 'worker':\n"
        "    me = os.environ['TFPSX_WORKER_ENDPOINTS'].split(',')[int(os.environ['TFPSX_RANK'])]\n"
        "    s = socket.socket(); s.bind(('0.0.0.0', int(me.rsplit(':', 1)[1]))); s.listen(1)\n"
        "time.sleep(60)\n")
    with LocalCluster(str(script), 1, 1, log_dir=str(tmp_path / "logs"), timeout=50) as c:
        c.start()
        port = c.tf_ports()[1]
        with pytest.raises(ExposedPortError, match=rf"local job stopped.*port {port} on "
                                                   r"0\.0\.0\.0.*was not built.*--expose"):
            c.wait()
        assert all(p.poll() is not None for p in c.procs.values())
    logs = tmp_path / "logs2"
    assert run.main(["--server_num", "1", "--worker_num", "1", "--no_scheduler", "--timeout",
                     "50", "--log_dir", str(logs), str(script)]) == 1
    err = capsys.readouterr().err
    assert "tfpsx-run: FAILED after" in err and "on 0.0.0.0" in err, err


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False),
    ("tfpsx-scheduler", False)])
def test_is_loopback(host, expected):
    assert cluster.is_loopback(host) is expected


def test_a_local_cluster_preloads_the_shim_into_every_task(tmp_path, monkeypatch):
    c = LocalCluster("train.py", 1, 2, log_dir=str(tmp_path), env={"LD_PRELOAD": "/opt/a.so"})
    shim = loopback.shim_path()
    ports = ",".join(str(p) for p in sorted(c.tf_ports()))
    for role, index in c.tasks():
        env = c.task_env(role, index)
        assert env["LD_PRELOAD"] == f"{shim} /opt/a.so"
        assert env[loopback.PORTS_ENV] == ports
    # --expose: TF's own binding, and a shim inherited from a confined parent dropped.
    monkeypatch.setenv("LD_PRELOAD", f"{shim} /opt/b.so")
    monkeypatch.setenv(loopback.PORTS_ENV, "1234")
    exposed = LocalCluster("train.py", 1, 2, log_dir=str(tmp_path), loopback_only=False)
    for role, index in exposed.tasks():
        env = exposed.task_env(role, index)
        assert env["LD_PRELOAD"] == "/opt/b.so" and loopback.PORTS_ENV not in env


@pytest.mark.parametrize("host", ["127.0.1.1", "::1"])
def test_a_loopback_host_the_shim_does_not_bind_is_refused(tmp_path, host):
    # The shim binds 127.0.0.1: peers dialling 127.0.1.1 or ::1 would be refused until the
    # start-up timeout.
    with pytest.raises(ValueError, match=rf"host '{host}' is a loopback address, but the "
                                         r"loopback bind shim keeps .* on 127\.0\.0\.1"):
        LocalCluster("train.py", 1, 1, log_dir=str(tmp_path), host=host)
    LocalCluster("train.py", 1, 1, log_dir=str(tmp_path), host="localhost")
    LocalCluster("train.py", 1, 1, log_dir=str(tmp_path), host=host, loopback_only=False)


def test_a_non_loopback_host_needs_loopback_only_false(tmp_path):
    with pytest.raises(ValueError, match=r"host '10\.0\.0\.7' is not a loopback address.*"
                                         r"loopback_only=False \(tfpsx-run --expose\)"):
        LocalCluster("train.py", 1, 1, log_dir=str(tmp_path), host="10.0.0.7")
    LocalCluster("train.py", 1, 1, log_dir=str(tmp_path), host="10.0.0.7", loopback_only=False)


@pytest.mark.timeout(60)
def test_without_the_shim_the_launcher_warns_naming_each_exposed_port(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(loopback, "shim_path", lambda: None)
    script = tmp_path / "noop.py"
    script.write_text("")
    with LocalCluster(str(script), 2, 2, log_dir=str(tmp_path / "logs"),
                      config_mode="env") as c:
        c.start()
        assert set(c.wait(timeout=30).values()) == {0}
    err = capsys.readouterr().err
    assert "listen on every interface of this machine" in err and "was not built" in err
    for port in c.tf_ports():
        assert str(port) in err, (port, err)
    assert len(c.tf_ports()) == 4


@pytest.mark.timeout(90)
def test_tfpsx_run_preloads_the_shim_unless_expose(tmp_path, capsys):
    # Each task writes what it was started with; --expose leaves TF's binding alone and
    # says so, naming the ports.
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''))\n")
    shim = loopback.shim_path()
    for expose in (False, True):
        logs = tmp_path / f"logs{int(expose)}"
        argv = ["--server_num", "1", "--worker_num", "1", "--no_scheduler", "--timeout", "60",
                "--server_grace", "5", "--log_dir", str(logs)]
        assert run.main(argv + ["--expose"] * expose + [str(script)]) == 0
        for name in ("serverlog.0", "workerlog.0"):
            text = (logs / name).read_text()
            assert (f"LD_PRELOAD={shim}" in text) is not expose, (expose, name, text)
        err = capsys.readouterr().err
        assert ("--expose asked for it" in err) is expose, err


@pytest.mark.parametrize("address", ["0.0.0.0:7000", "10.1.2.3:7000", "[::]:7000",
                                     "tfpsx-scheduler:7000"])
def test_the_scheduler_refuses_to_listen_beyond_this_machine_without_a_token(address):
    with pytest.raises(ValueError, match=rf"listen address '{__import__('re').escape(address)}'"
                                         r" \(TFPSX_SCHED_ADDR\) is reachable from other "
                                         r"machines and no TFPSX_TOKEN is set"):
        scheduler.serve(address, 1, 1)
    scheduler.check_listen_address(address, "s3cret")  # a token: accepted
    for local in ("127.0.0.1:7000", "localhost:7000", "[::1]:7000"):
        scheduler.check_listen_address(local, None)


@pytest.mark.timeout(60)
def test_tfpsx_scheduler_exits_2_naming_the_setting_and_binds_nothing():
    (port,) = __import__("portpicker").pick_unused_port(),
    env = dict(os.environ, TFPSX_ROLE="scheduler", TFPSX_SCHED_ADDR=f"0.0.0.0:{port}",
               TFPSX_SERVER_NUM="1", TFPSX_WORKER_NUM="1")
    env.pop("TFPSX_TOKEN", None)
    out = subprocess.run([sys.executable, "-c", "import sys; from tfpsx.control.scheduler "
                          "import main; sys.exit(main())"], env=env, capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 2, out
    assert f"tfpsx-scheduler: scheduler: listen address '0.0.0.0:{port}'" in out.stderr
    assert "Set TFPSX_TOKEN" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_local_jobs_tfdata_service_is_on_loopback_and_started_again(tmp_path,
                                                                        monkeypatch):
    """--data_workers 2: a dispatcher and two data workers, confined like the job's TF
    servers; the training tasks get the dispatcher's address; a service task that exits
    starts again on its address, MAX_SERVICE_RESTARTS times, then the job stops."""
    from tfpsx.errors import ClusterTimeoutError
    from tfpsx.launcher import local

    c = LocalCluster("train.py", 1, 2, log_dir=str(tmp_path), data_workers=2)
    service = [("dispatcher", 0), ("data_worker", 0), ("data_worker", 1)]
    assert c.tasks()[:3] == service
    dispatcher = c.dispatcher_address
    ports = {int(a.rsplit(":", 1)[1]) for a in [dispatcher] + c.data_worker_addresses}
    assert ports <= set(c.tf_ports()) and len(set(c.tf_ports())) == 1 + 2 + 3
    for role, index in c.tasks():
        env = c.task_env(role, index)
        assert ports <= {int(p) for p in env[loopback.PORTS_ENV].split(",")}
        if role in ("worker", "server"):
            assert env["TFPSX_DATA_SERVICE"] == f"grpc://{dispatcher}"
    assert c._service_argv("data_worker", 1)[-2:] == ["--dispatcher", dispatcher]
    with pytest.raises(ValueError, match="data_workers"):
        LocalCluster("train.py", 1, 2, log_dir=str(tmp_path), data_workers=-1)
    # Each exits at once (code 3): started again, then the job stops, naming it.
    monkeypatch.setattr(LocalCluster, "_service_argv",
                        lambda self, role, index: ["-c", "import sys; sys.exit(3)"])
    with LocalCluster("train.py", 1, 1, log_dir=str(tmp_path / "again"), data_workers=1,
                      timeout=60) as job:
        job.start(service[:2])
        restarted = []
        with pytest.raises(ClusterTimeoutError, match=r"(dispatcher|data_worker) 0 of the "
                                                      r"tf\.data service exited 6 times "
                                                      r"\(last code 3") as stopped:
            deadline = time.monotonic() + 50
            while time.monotonic() < deadline:
                restarted += job.supervise()
                time.sleep(0.05)
        role = str(stopped.value).split(" ")[0]
        assert len([t for t, _ in restarted if t == (role, 0)]) == local.MAX_SERVICE_RESTARTS
        assert all(code == 3 for _, code in restarted)
        assert all(p.poll() is not None for p in job.procs.values())
