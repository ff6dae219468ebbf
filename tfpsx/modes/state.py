"""The variables each mode's protocol keeps on PS 0, declared once for both front-ends.

A :class:`State` is one int64 variable (a scalar, or one entry per worker): its name,
which is graph mode's variable name (its checkpoint key) and Keras's shared resource
name alike, its shape, and whether a checkpoint holds it. :data:`MODE_STATE` lists what
each mode may create. A front-end supplies a :class:`StateFactory` (how it makes a
variable on PS 0 that the chief initializes to zeros and the others wait for, and a
variable of this worker's own) and never names a protocol variable itself; a test
builds every mode in both front-ends and checks they create exactly these.

The names are graph mode's of before this module (``tfpsx_sync_step``...), so the
checkpoints written before keep restoring; Keras's were ``tfpsx/keras/...`` and live on
the servers only (a Keras checkpoint holds the model and the tables, not the protocol).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Protocol, Tuple


@dataclass(frozen=True)
class State:
    """One protocol variable on PS 0: int64 zeros when the job starts.

    Attributes:
      name: graph mode's variable name (and checkpoint key); Keras's shared name.
      per_worker: one entry per worker of the job (else a scalar).
      checkpointed: a checkpoint holds it (graph mode: a global variable the chief
        initializes or restores; else the chief initializes it when a session starts).
      what: what it holds.
    """
    name: str
    per_worker: bool
    checkpointed: bool
    what: str

    def shape(self, workers: int) -> List[int]:
        return [workers] if self.per_worker else []


SYNC_STEP = State("tfpsx_sync_step", False, True, "sync: the steps applied so far")
SYNC_PUSHED = State("tfpsx_sync_pushed", True, True,
                    "sync: per worker, 1 + the step it last pushed gradients for (0: none "
                    "yet; DONE: it left)")
WORKER_CLOCKS = State("tfpsx_worker_clocks", True, True,
                      "bounded staleness: per worker, the steps it trained (DONE: it left)")
HYBRID_PORTS = State("tfpsx_hybrid_ports", True, False,
                     "hybrid: per worker, the port of its dense all-reduce server (0: not "
                     "yet); made only when TFPSX_DENSE_ENDPOINTS does not give them")

GEO_TABLE_CHOICE = State("tfpsx_geo_table_choice", False, False,
                         "GEO with geo_table_choice='auto': bit i set, the job's i-th table "
                         "(in the order the tables are built) runs rounds, else it trains "
                         "async; the chief decides (tfpsx.modes.geo.choice)")

# sync's own variable on each worker (not shared): the step it trains, its pushes' stamp.
SYNC_LOCAL_STEP = "tfpsx_sync_local_step"

MODE_STATE: Dict[str, Tuple[State, ...]] = {
    "async": (),
    # (its rounds move the model's own rows and weights; GEO_TABLE_CHOICE only where
    # geo_table_choice="auto" has tables to choose for: the rule for many workers)
    "geo": (),
    "sync": (SYNC_STEP, SYNC_PUSHED),
    "staleness": (WORKER_CLOCKS,),
    "collective": (),  # (no servers)
    "hybrid": (HYBRID_PORTS,),  # (plus its tables' mode's: async or GEO, none)
}


def states_of(mode: str) -> Tuple[State, ...]:
    """The protocol variables ``mode`` may create on PS 0.

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in MODE_STATE:
        raise ValueError(f"unknown mode {mode!r}: expected one of {sorted(MODE_STATE)}")
    return MODE_STATE[mode]


class StateFactory(Protocol):
    """How a front-end makes the protocol's variables."""

    def shared(self, state: State, workers: int):
        """``state`` on PS 0, int64 zeros of ``state.shape(workers)``: the chief
        initializes it (or a checkpoint restores it), the others wait for it."""

    def local(self, name: str, initial):
        """A non-trainable variable of this worker, named ``name``, starting at
        ``initial()`` (called where the front-end creates its variables)."""
