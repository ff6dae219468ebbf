"""Where metrics go: JSON lines, one file per process.

With ``TFPSX_METRICS_DIR`` set (``tfpsx-run`` and ``LocalCluster`` set it to the log
folder), :func:`emit` appends one JSON object per call to
``<dir>/metrics.<role>.<rank>.jsonl``; examples, tests and benchmarks read those files
(:func:`read`) instead of scraping a process's output. Without it, ``emit`` only returns
the record.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, List, Optional

from tfpsx import settings

_lock = threading.Lock()
_identity = {"role": None, "rank": None}


def set_identity(role: Optional[str], rank: Optional[int]) -> None:
    """Names this process's metrics file (the runtime calls it in ``tfpsx.init()``)."""
    _identity.update(role=role, rank=rank)


def path(directory: str, role: Optional[str], rank: Optional[int]) -> str:
    """The metrics file of one process in ``directory``."""
    name = f"{role}.{rank}" if role is not None else f"pid{os.getpid()}"
    return os.path.join(directory, f"metrics.{name}.jsonl")


def emit(event: str, **values: Any) -> Dict[str, Any]:
    """Records ``event`` with ``values`` (JSON-serializable) and returns the record."""
    record = {"event": event, "time": time.time(), "role": _identity["role"],
              "rank": _identity["rank"], **values}
    directory = settings.get("TFPSX_METRICS_DIR")
    if directory:
        line = json.dumps(record) + "\n"
        with _lock:
            os.makedirs(directory, exist_ok=True)
            with open(path(directory, _identity["role"], _identity["rank"]), "a",
                      encoding="utf-8") as f:
                f.write(line)
    return record


def read(directory: str, role: str, rank: int, event: Optional[str] = None
         ) -> List[Dict[str, Any]]:
    """The records one process emitted (only ``event`` ones when given), oldest first."""
    try:
        with open(path(directory, role, rank), encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
    return [r for r in records if event is None or r["event"] == event]
