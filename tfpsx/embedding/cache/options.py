"""A worker cache's options and its eviction policies."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union


class EvictionPolicy:
    """Which cached rows go first when a lookup finds the cache over its size. The C++
    core ranks the rows (``TfpsxHashTableCacheVictims``) by look-up count or by the step
    of the last look-up; a policy says which."""
    name = "policy"
    by_step = False

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))

    def __repr__(self):
        return f"tfpsx.embedding.{type(self).__name__}()"


class LFU(EvictionPolicy):
    """Least frequently looked up first (the default)."""
    name, by_step = "lfu", False


class LRU(EvictionPolicy):
    """Least recently looked up first."""
    name, by_step = "lru", True


POLICIES: Dict[str, EvictionPolicy] = {p.name: p for p in (LFU(), LRU())}


def eviction_policy(spec: Union[str, EvictionPolicy], what: str = "cache") -> EvictionPolicy:
    """The policy of ``spec``: an :class:`EvictionPolicy` or its name ("lfu", "lru")."""
    if isinstance(spec, EvictionPolicy):
        return spec
    if isinstance(spec, str) and spec in POLICIES:
        return POLICIES[spec]
    raise ValueError(f"{what}: cache_policy must be one of {list(POLICIES)} or a "
                     f"tfpsx.embedding.LFU() / LRU(), got {spec!r}")


def _count(value, what: str, name: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: {name} must be an int >= 1 ({meaning}), got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """A table's cache: ``size`` rows, eviction ``policy``, sync every ``flush_steps``,
    a miss admitted at its ``admit_after``-th recent sighting."""
    size: int
    policy: EvictionPolicy = LFU()
    flush_steps: int = 100
    admit_after: int = 1

    def __post_init__(self):
        # a policy's name ("lfu", "lru") is taken as the policy
        object.__setattr__(self, "policy", eviction_policy(self.policy))

    @classmethod
    def parse(cls, table: str, cache_size, cache_policy, flush_steps,
              admit_after=1) -> Optional["CacheOptions"]:
        """The options of ``DynamicTable(cache_size=..., cache_policy=...,
        flush_steps=..., cache_admit_after=...)``, or None without a cache; a bad value is
        a ValueError naming it."""
        what = f"DynamicTable {table!r}"
        if cache_size is None:
            return None
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"{what}: cache_size must be None (no cache) or an int >= 1 (rows "
                             f"cached on the worker), got {cache_size!r}")
        policy = eviction_policy(cache_policy, what)
        _count(flush_steps, what, "flush_steps",
               "updates between two syncs of the cache with the PS")
        _count(admit_after, what, "cache_admit_after",
               "a missed row enters the cache at its K-th recent sighting; 1: at once")
        return cls(cache_size, policy, flush_steps, admit_after)
