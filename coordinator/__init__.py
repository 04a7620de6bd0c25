"""GroupCoordinator, parallel state and the groupcoord command line."""

from __future__ import annotations

from . import comm
from .comm import (
    Comm,
    ReduceOp,
    Work,
    WorkStatus,
    comm_from_group,
    comm_from_process_group,
    new_comm,
)
from .errors import AlreadyInitializedError, NotInitializedError
from .group_coordinator import GraphCaptureContext, GroupCoordinator, get_device_communicator_cls
from .parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    get_dp_group,
    get_ep_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    graph_capture,
    in_the_same_node_as,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .stateless_group import StatelessProcessGroup

__all__ = [
    "AlreadyInitializedError",
    "Comm",
    "ReduceOp",
    "Work",
    "WorkStatus",
    "comm",
    "comm_from_group",
    "comm_from_process_group",
    "new_comm",
    "GraphCaptureContext",
    "GroupCoordinator",
    "NotInitializedError",
    "StatelessProcessGroup",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "ensure_model_parallel_initialized",
    "get_device_communicator_cls",
    "get_dp_group",
    "get_ep_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "graph_capture",
    "in_the_same_node_as",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]
