"""The group of workers a mode waits on: a per-worker vector on PS 0 (sync's pushed
steps, bounded staleness's clocks) where a worker whose training ended is marked
:data:`DONE`, so nobody waits for it again (a dead one is named by the heartbeat
watch instead)."""

from __future__ import annotations

DONE = 2 ** 62  # a finished worker's entry: never the slowest, never waited for
