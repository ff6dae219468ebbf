"""A local job stays off the network: the bind shim its tasks preload, the launcher's
warning where the shim is missing and its --expose opt-out, and the scheduler's refusal
to listen beyond this machine without a token. Processes here are plain Python (no
TensorFlow): a socket bound as TF's gRPC server binds it (0.0.0.0 and a dual-stack ::)."""

import os
import socket
import subprocess
import sys

import pytest

from tfpsx import cluster
from tfpsx.control import scheduler
from tfpsx.launcher import loopback, run
from tfpsx.launcher.local import LocalCluster

# Binds as gRPC's wildcard listener does (a dual-stack IPv6 socket on ::, and an IPv4
# one on 0.0.0.0), plus one explicit 127.0.0.1 bind; prints the ports; waits for stdin.
_BINDER = r"""
import socket, sys
socks = []
six = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
six.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
six.bind(("::", 0)); socks.append(six)
four = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
four.bind(("0.0.0.0", 0)); socks.append(four)
mine = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
mine.bind(("127.0.0.1", 0)); socks.append(mine)
for s in socks:
    s.listen(4)
print(" ".join(str(s.getsockname()[1]) for s in socks), flush=True)
sys.stdin.read()
"""


def _bind(env):
    proc = subprocess.Popen([sys.executable, "-c", _BINDER], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the binder printed no ports"
        return proc, [int(p) for p in line.split()]
    except BaseException:
        proc.kill()
        raise


def _stop(proc):
    proc.kill()
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_the_shim_moves_wildcard_binds_to_loopback_and_peers_still_connect():
    shim = loopback.shim_path()
    assert shim is not None, "setup.py builds tfpsx/_loopback_bind*.so"
    bare, bare_ports = _bind(dict(os.environ))
    try:
        # Without the shim, what TF does: both wildcard sockets reach every interface.
        seen = loopback.listening(bare_ports)
        assert sorted(loopback.exposed(seen)) == sorted(bare_ports[:2]), seen
    finally:
        _stop(bare)
    proc, ports = _bind(loopback.confine(dict(os.environ, LD_PRELOAD="libm.so.6"), shim))
    try:
        seen = loopback.listening(ports)
        assert sorted(seen) == sorted(ports), seen
        assert loopback.exposed(seen) == {}, seen
        assert seen[ports[0]] == ["::ffff:127.0.0.1"] and seen[ports[1]] == ["127.0.0.1"], seen
        for port in ports:  # a peer on this machine reaches each one on 127.0.0.1
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        _stop(proc)


def test_confine_puts_the_shim_first_and_keeps_the_users_preload():
    env = loopback.confine({"LD_PRELOAD": "/opt/a.so /x/shim.so"}, "/x/shim.so")
    assert env["LD_PRELOAD"] == "/x/shim.so /opt/a.so"
    assert loopback.confine({}, "/x/shim.so")["LD_PRELOAD"] == "/x/shim.so"


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False),
    ("tfpsx-scheduler", False)])
def test_is_loopback(host, expected):
    assert cluster.is_loopback(host) is expected


def test_a_local_cluster_preloads_the_shim_into_every_task(tmp_path):
    c = LocalCluster("train.py", 1, 2, log_dir=str(tmp_path), env={"LD_PRELOAD": "/opt/a.so"})
    shim = loopback.shim_path()
    for role, index in c.tasks():
        assert c.task_env(role, index)["LD_PRELOAD"] == f"{shim} /opt/a.so"
    exposed = LocalCluster("train.py", 1, 2, log_dir=str(tmp_path), loopback_only=False)
    assert all("LD_PRELOAD" not in exposed.task_env(r, i) or
               shim not in exposed.task_env(r, i)["LD_PRELOAD"] for r, i in exposed.tasks())


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
