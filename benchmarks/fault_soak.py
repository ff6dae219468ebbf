"""Fault soak: a job under `tfpsx-run --max_restarts` while a random role is SIGKILLed
every ``--every`` seconds for ``--minutes``, against the same job undisturbed.

The job (benchmarks/_soak_job.py): 1 scheduler, ``--servers`` parameter servers and
``--workers`` workers, async, a DynamicTable and a dense layer, incremental
checkpoints every ``--save_steps`` global steps (a full one every 5). Each kill picks,
uniformly, one of: a server, the chief, a non-chief worker, the scheduler (by PID, among
the launcher's own children). The launcher restarts the whole job after a server or the
chief (the chief resumes from its last checkpoint), a non-chief worker in place, and the
scheduler on its address. Reported: kills by role, restarts, the wall time of both runs,
and the final eval loss of both. Target (issue 12): the soaked job finishes and its loss
is within 2% of the undisturbed run's.

  python benchmarks/fault_soak.py [--minutes 10] [--every 30] [--steps 15000]
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

import tfpsx

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_soak_job.py")
ROLES = ("server", "chief", "worker", "scheduler")


def launch(work: str, args, tag: str):
    logs, ckpt = os.path.join(work, tag, "logs"), os.path.join(work, tag, "ckpt")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFPSX_HEARTBEAT_INTERVAL="1")
    cmd = [sys.executable, "-m", "tfpsx.launcher.run", "--log_dir", logs,
           "--server_num", str(args.servers), "--worker_num", str(args.workers),
           "--max_restarts", "1000", "--timeout", str(args.timeout), JOB,
           "--checkpoint_dir", ckpt, "--steps", str(args.steps),
           "--save_steps", str(args.save_steps), "--step_delay", str(args.step_delay)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=work)
    return proc, logs


def role_of(p: psutil.Process):
    try:
        env, cmd = p.environ(), " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "tfpsx.control.scheduler" in cmd:
        return "scheduler"
    role = env.get("TFPSX_ROLE")
    if role == "server":
        return "server"
    if role == "worker":
        return "chief" if env.get("TFPSX_RANK") == "0" else "worker"
    return None


def finish(proc, what: str, deadline: float):
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"{what}: the launcher ran past its deadline; killed it\n{err[-3000:]}")
    return out, err


def final(logs: str):
    records = tfpsx.metrics.read(logs, "worker", 0, "soak")
    if not records:
        raise RuntimeError(f"no final 'soak' record from the chief in {logs}")
    return records[-1]


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0, help="how long to keep killing")
    p.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=15000, help="global steps of the job")
    p.add_argument("--save_steps", type=int, default=500)
    p.add_argument("--step_delay", type=float, default=0.05,
                   help="seconds each worker sleeps per step: the job lasts ~8 min undisturbed")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="tfpsx-soak-")
    result = {"minutes": args.minutes, "every_s": args.every, "servers": args.servers,
              "workers": args.workers, "steps": args.steps}
    try:
        start = time.monotonic()
        proc, logs = launch(work, args, "undisturbed")
        out, err = finish(proc, "undisturbed run", start + args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the undisturbed run failed ({proc.returncode}):\n{err[-3000:]}")
        calm = final(logs)
        result["undisturbed"] = {"seconds": round(time.monotonic() - start, 1), **calm}
        print(f"undisturbed: {result['undisturbed']}", flush=True)

        start = time.monotonic()
        proc, logs = launch(work, args, "soak")
        kills = []
        stop_killing = start + 60 * args.minutes
        next_kill = start + args.every
        while proc.poll() is None and time.monotonic() < stop_killing:
            time.sleep(0.5)
            if time.monotonic() < next_kill:
                continue
            next_kill += args.every
            role = rng.choice(ROLES)
            victims = [c for c in psutil.Process(proc.pid).children(recursive=True)
                       if role_of(c) == role]
            if not victims:
                kills.append({"at_s": round(time.monotonic() - start, 1), "role": role,
                              "pid": None})  # between incarnations: nothing to kill
                continue
            victim = rng.choice(victims)
            try:
                victim.kill()
            except psutil.NoSuchProcess:
                continue
            kills.append({"at_s": round(time.monotonic() - start, 1), "role": role,
                          "pid": victim.pid})
            print(f"soak: killed {role} (pid {victim.pid}) at {kills[-1]['at_s']} s", flush=True)
        out, err = finish(proc, "soaked run", start + args.timeout)
        restarts = re.findall(r"tfpsx-run: (.*?) exited with code -9.*?; (restarting the job|"
                              r"starting it again in place|restarting it on)", err)
        result["soak"] = {"seconds": round(time.monotonic() - start, 1),
                          "exit_code": proc.returncode, "kills": kills,
                          "kills_by_role": {r: sum(k["role"] == r and k["pid"] is not None
                                                   for k in kills) for r in ROLES},
                          "restarts": len(restarts)}
        if proc.returncode != 0:
            raise RuntimeError(f"the soaked run failed ({proc.returncode}):\n{err[-5000:]}")
        result["soak"].update(final(logs))
        calm_loss, soak_loss = result["undisturbed"]["eval_loss"], result["soak"]["eval_loss"]
        result["loss_ratio"] = round(soak_loss / calm_loss, 4)
        result["within_2_percent"] = abs(soak_loss / calm_loss - 1) <= 0.02
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"kills: {result['soak']['kills_by_role']} ({result['soak']['restarts']} restarts by "
          f"the launcher); undisturbed {result['undisturbed']['seconds']} s, soaked "
          f"{result['soak']['seconds']} s")
    print(f"eval loss: undisturbed {calm_loss:.4f}, soaked {soak_loss:.4f} "
          f"(ratio {result['loss_ratio']}); target within 2%: "
          f"{'met' if result['within_2_percent'] else 'NOT met'}")
    print(json.dumps(result))
    return 0 if result["within_2_percent"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
