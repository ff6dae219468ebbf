"""The scheduler's journal: its job state on disk, so that a restarted scheduler takes
the job back (``TFPSX_SCHED_STATE``; ``tfpsx-run`` keeps it in its log folder).

The scheduler holds no model state: the servers keep the model and the workers talk to
them directly. What it holds is who is who (role, rank, address and node id of every
node) and who finished or died. That is written here, atomically (a temporary file, then
``os.replace``: a crash mid-write leaves the previous state), at every change. A
scheduler started with the file resumes it: the nodes' heartbeats and calls go on as if
nothing happened, and the job ends when every worker finished or died, as before.
A node that a restarted scheduler does not know (no journal, or a lost one) registers
again with its rank, address and node id.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import List, Optional

VERSION = 1


def _token_hash(token: Optional[str]) -> Optional[str]:
    return None if token is None else hashlib.sha256(token.encode()).hexdigest()


class Journal:
    """The state file at ``path`` of a job of ``server_num`` servers and ``worker_num``
    workers (and the job's token: a journal of another token is refused)."""

    def __init__(self, path: str, server_num: int, worker_num: int, token: Optional[str]):
        self.path = path
        self.server_num, self.worker_num = server_num, worker_num
        self._token = _token_hash(token)

    def save(self, nodes: List[dict]) -> None:
        """Writes the state atomically: the file holds the previous state or this one."""
        state = {"version": VERSION, "server_num": self.server_num,
                 "worker_num": self.worker_num, "token_sha256": self._token, "nodes": nodes}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self) -> Optional[List[dict]]:
        """The nodes of the saved state, or None when there is none.

        Raises:
          ValueError: the file is not a journal of this job (another server or worker
            count, another token, unreadable); the scheduler must not take a job it does
            not know.
        """
        if not os.path.exists(self.path):
            return None
        try:
            with open(self.path) as f:
                state = json.load(f)
            nodes = state["nodes"]
            want = {"version": VERSION, "server_num": self.server_num,
                    "worker_num": self.worker_num, "token_sha256": self._token}
            got = {k: state.get(k) for k in want}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"scheduler state {self.path} (TFPSX_SCHED_STATE) cannot be read: "
                             f"{e}; remove it to start a new job") from e
        if got != want:
            diff = ", ".join(f"{k} {got[k]!r} (expected {want[k]!r})"
                             for k in want if got[k] != want[k])
            raise ValueError(f"scheduler state {self.path} (TFPSX_SCHED_STATE) is another job's: "
                             f"{diff}; remove it to start a new job")
        for node in nodes:
            missing = {"role", "rank", "address", "node_id", "state"} - set(node)
            if missing:
                raise ValueError(f"scheduler state {self.path}: a node lacks {sorted(missing)}; "
                                 "remove it to start a new job")
        return nodes

    def remove(self) -> None:
        """The job ended: nothing to resume."""
        for path in (self.path, f"{self.path}.tmp"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
