"""The cluster layer: what a resolved cluster is and where it comes from.

* :mod:`~tfpsx.cluster.config`: :class:`ClusterConfig` (role, rank, endpoints, TF job
  names) and endpoint parsing;
* :mod:`~tfpsx.cluster.sources`: the one resolver of TF_CONFIG, ``TFPSX_*`` variables,
  classic flags and Python arguments, where every input is validated;
* :mod:`~tfpsx.cluster.role_maker`: Fleet's role makers, which only pick a source.

A config whose ranks a scheduler is still to assign has ``needs_scheduler`` set; the
control layer (:mod:`tfpsx.control`) completes it.
"""

from tfpsx.cluster.config import (CHIEF, CLUSTER_ENV_VARS, DATA_WORKER, DISPATCHER,
                                  ENV_DATA_SERVICE, ENV_RANK, ENV_ROLE, ENV_SCHED_ADDR,
                                  ENV_SERVER_ENDPOINTS, ENV_SERVER_NUM, ENV_TOKEN,
                                  ENV_WORKER_ENDPOINTS, ENV_WORKER_NUM, EVALUATOR, ROLES,
                                  SCHEDULER, SERVER, TF_CONFIG_JOBS, WORKER, ClusterConfig,
                                  SchedulerInfo, is_loopback, parse_endpoint,
                                  parse_endpoint_list)
from tfpsx.cluster.role_maker import (AutoRoleMaker, EnvRoleMaker, FlagsRoleMaker, RoleMaker,
                                      TFConfigRoleMaker, UserDefinedRoleMaker)
from tfpsx.cluster.sources import from_env, from_flags, from_tf_config, from_user, resolve

__all__ = [
    "ClusterConfig", "SchedulerInfo", "resolve", "from_env", "from_flags", "from_tf_config",
    "from_user", "is_loopback", "parse_endpoint", "parse_endpoint_list", "RoleMaker",
    "AutoRoleMaker", "TFConfigRoleMaker", "EnvRoleMaker", "UserDefinedRoleMaker", "FlagsRoleMaker",
    "SERVER", "WORKER", "SCHEDULER", "EVALUATOR", "CHIEF", "ROLES", "TF_CONFIG_JOBS",
    "ENV_ROLE", "ENV_RANK", "ENV_SERVER_ENDPOINTS", "ENV_WORKER_ENDPOINTS", "ENV_SCHED_ADDR",
    "ENV_SERVER_NUM", "ENV_WORKER_NUM", "ENV_TOKEN", "CLUSTER_ENV_VARS", "DISPATCHER",
    "DATA_WORKER", "ENV_DATA_SERVICE",
]
