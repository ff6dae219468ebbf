"""Role makers: the ways a process learns its role, rank and cluster (Fleet's shape).

Each one only gathers inputs; validation is :mod:`tfpsx.cluster.sources`' job.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional, Sequence

from tfpsx.cluster import sources as _sources
from tfpsx.cluster.config import ClusterConfig


class RoleMaker:
    """Base class: ``resolve()`` returns a validated :class:`tfpsx.cluster.ClusterConfig`
    (``resolve(collective=True)`` for a collective job: workers only, no servers)."""

    def resolve(self, collective: bool = False) -> ClusterConfig:
        raise NotImplementedError(f"{type(self).__name__} must implement resolve()")


class AutoRoleMaker(RoleMaker):
    """TF_CONFIG if set, else TFPSX_* env (what ``tfpsx.init()`` uses by default)."""

    def __init__(self, env: Optional[Mapping[str, str]] = None):
        self._env = env

    def resolve(self, collective: bool = False):
        return _sources.resolve(self._env, collective=collective)


class TFConfigRoleMaker(RoleMaker):
    """Reads TF_CONFIG (Kubeflow TFJob, TF's own multi-worker setups).

    Args:
      tf_config: a JSON string or dict; defaults to the TF_CONFIG environment variable.
      task_type: overrides ``TF_CONFIG['task']['type']``.
      task_index: overrides ``TF_CONFIG['task']['index']``.
    """

    def __init__(self, tf_config: Any = None, task_type: Optional[str] = None,
                 task_index: Optional[int] = None):
        self._tf_config = tf_config
        self._task_type = task_type
        self._task_index = task_index

    def resolve(self, collective: bool = False):
        config = self._tf_config
        if config is None:
            config = os.environ.get("TF_CONFIG", "")
            if not config.strip():
                raise ValueError("TFConfigRoleMaker: TF_CONFIG is not set; expected a JSON "
                                 'object like {"cluster": {...}, "task": {...}}')
        return _sources.from_tf_config(config, self._task_type, self._task_index,
                                       collective=collective)


class EnvRoleMaker(RoleMaker):
    """Reads TFPSX_ROLE / TFPSX_RANK / TFPSX_*_ENDPOINTS (or the scheduler variables).

    Arguments, when given, override the variable of the same meaning.
    """

    def __init__(self, role: Optional[str] = None, rank: Optional[int] = None,
                 server_endpoints: Any = None, worker_endpoints: Any = None,
                 env: Optional[Mapping[str, str]] = None):
        self._kwargs = dict(role=role, rank=rank, server_endpoints=server_endpoints,
                            worker_endpoints=worker_endpoints)
        self._env = env

    def resolve(self, collective: bool = False):
        return _sources.from_env(self._env, collective=collective, **self._kwargs)


class UserDefinedRoleMaker(RoleMaker):
    """Everything given in Python; the environment is not read.

    Example:
      >>> rm = UserDefinedRoleMaker(role="worker", current_id=0,
      ...                           server_endpoints=["127.0.0.1:6000"],
      ...                           worker_endpoints=["127.0.0.1:6001"])
    """

    def __init__(self, role: str, current_id: int, server_endpoints: Any,
                 worker_endpoints: Any):
        self._args = (role, current_id, server_endpoints, worker_endpoints)

    def resolve(self, collective: bool = False):
        return _sources.from_user(*self._args, collective=collective)


class FlagsRoleMaker(RoleMaker):
    """Reads TF's classic ``--ps_hosts --worker_hosts --job_name --task_index`` flags.

    Args:
      argv: the arguments to read; ``sys.argv[1:]`` by default. Unknown flags are ignored.
    """

    def __init__(self, argv: Optional[Sequence[str]] = None):
        self._argv = argv

    def resolve(self, collective: bool = False):
        return _sources.from_flags(sys.argv[1:] if self._argv is None else self._argv,
                                   collective=collective)
