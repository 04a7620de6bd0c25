"""Every package's public names import, and each package says exactly what they are."""

from __future__ import annotations

import ast
import graphlib
import importlib
import os
import pathlib

import pytest

PACKAGES = ["shm_broadcast", "device_communicators", "coordinator"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_imports(package: str) -> None:
    module = importlib.import_module(package)
    names = module.__all__
    assert len(names) == len(set(names)), "duplicate names in __all__"
    for name in names:
        assert getattr(module, name) is not None, name
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    assert set(names) <= set(namespace)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_typed(package: str) -> None:
    module = importlib.import_module(package)
    assert os.path.exists(os.path.join(os.path.dirname(module.__file__ or ""), "py.typed"))


def test_coordinator_offers_the_vllm_names() -> None:
    import coordinator

    for name in (
        "GroupCoordinator",
        "GraphCaptureContext",
        "StatelessProcessGroup",
        "init_distributed_environment",
        "initialize_model_parallel",
        "ensure_model_parallel_initialized",
        "model_parallel_is_initialized",
        "get_world_group",
        "get_tp_group",
        "get_pp_group",
        "get_dp_group",
        "get_ep_group",
        "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_rank",
        "get_pipeline_model_parallel_world_size",
        "get_pipeline_model_parallel_rank",
        "graph_capture",
        "destroy_model_parallel",
        "destroy_distributed_environment",
        "in_the_same_node_as",
    ):
        assert name in coordinator.__all__, name
    methods = (
        "all_reduce all_gather all_gatherv reduce_scatter reduce_scatterv gather broadcast "
        "broadcast_object broadcast_object_list broadcast_tensor_dict send_object recv_object "
        "send_tensor_dict recv_tensor_dict send recv barrier graph_capture dispatch combine "
        "create_mq_broadcaster create_single_reader_mq_broadcasters "
        "prepare_communication_buffer_for_model destroy first_rank last_rank is_first_rank "
        "is_last_rank next_rank prev_rank"
    ).split()
    for method in methods:
        assert hasattr(coordinator.GroupCoordinator, method), method


def test_the_wheel_lists_every_package_folder_and_the_benchmarks() -> None:
    """pyproject lists packages by hand (the benchmarks folder installs as
    groupcoord_benchmarks): a new sub-package must be added there or a wheel lacks it."""

    tomllib = pytest.importorskip("tomllib")
    root = pathlib.Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        ".".join(init.parent.relative_to(root).parts)
        for top in ("shm_broadcast", "device_communicators", "coordinator")
        for init in (root / top).rglob("__init__.py")
    }
    listed = set(config["packages"])
    assert listed - {"groupcoord_benchmarks"} == folders
    assert config["package-dir"]["groupcoord_benchmarks"] == "benchmarks"
    from coordinator.cli import bench

    for benchmark in bench.BENCHMARKS:
        assert (pathlib.Path(bench.BENCH_DIR) / benchmark.script).is_file(), benchmark


def _imports_of(path: pathlib.Path, module: str, modules: set[str]) -> set[str]:
    """Every project module ``module`` imports anywhere in its file: at the top,
    inside functions and under ``TYPE_CHECKING`` (type-only imports count)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            subs = {f"{name}.{a.name}" for a in node.names} & modules
            found |= subs or ({name} & modules)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found - {module}


def test_no_module_imports_itself_through_another() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    paths = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            paths[name] = path
    # A package's __init__ re-exports its modules; what matters is module to module.
    graph = {
        m: {d for d in _imports_of(p, m, set(paths)) if paths[d].name != "__init__.py"}
        for m, p in paths.items()
        if p.name != "__init__.py"
    }
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")
