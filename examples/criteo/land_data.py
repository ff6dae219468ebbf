"""Click logs that keep landing: an hourly folder of Criteo-format rows every few seconds,
from make_data.py's planted model, for the online job (docs/criteo.md, "Online").

Each folder ``<out>/h<NNNNN>/`` gets its file(s) written aside and renamed into place,
then its ``_SUCCESS`` marker, last: what ``tfpsx.data.stream`` waits for.

  python examples/criteo/land_data.py --out data/online --hours 20 --every 5 --rows 20000

Started again it goes on after the last hour it finds.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_data  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the folder the job follows")
    p.add_argument("--hours", type=int, default=10, help="folders to land (0: forever)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between folders")
    p.add_argument("--rows", type=int, default=20_000, help="rows a folder")
    p.add_argument("--files", type=int, default=2, help="files a folder")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for name, low in (("hours", 0), ("rows", 1), ("files", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.every < 0:
        p.error(f"--every must be >= 0 seconds, got {args.every}")
    os.makedirs(args.out, exist_ok=True)
    planted = make_data.Planted()
    planted.calibrate(*make_data.draw(np.random.default_rng(10_000), 200_000))
    done = [int(n[1:]) for n in os.listdir(args.out)
            if n.startswith("h") and n[1:].isdigit() and
            os.path.exists(os.path.join(args.out, n, "_SUCCESS"))]
    hour = max(done, default=-1) + 1
    landed = 0
    while args.hours == 0 or landed < args.hours:
        folder = os.path.join(args.out, f"h{hour:05d}")
        os.makedirs(folder, exist_ok=True)
        rng = np.random.default_rng(args.seed * 1_000_003 + hour)
        per_file = -(-args.rows // args.files)
        for i in range(args.files):
            rows = min(per_file, args.rows - i * per_file)
            path = os.path.join(folder, f"train-{i:05d}.txt")
            make_data.write(path + ".tmp", rng, planted, rows)
            os.replace(path + ".tmp", path)
        open(os.path.join(folder, "_SUCCESS"), "w").close()
        print(f"landed {folder} ({args.rows} rows)", flush=True)
        hour, landed = hour + 1, landed + 1
        if args.hours == 0 or landed < args.hours:
            time.sleep(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
