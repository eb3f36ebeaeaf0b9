"""The project's shape: a wheel installs exactly the three packages, with every layer subpackage."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("topology", "groups", "megatron", "runtime", "tools")
#: Every name ``parallel_state`` offered before the layers (its modules aside, which are internal).
PUBLIC = """
    DEFAULT_ORDER DistributedManager GlobalMemoryBuffer GlobalSymmetricMemoryBuffer LaunchInfo
    ParallelStateAssertionError ParallelStateError ParallelStateTypeError ParallelStateValueError
    ParallelStateWarning RankGenerator TopologyPlan _set_global_symmetric_memory_buffer bridge_megatron
    collective_device create_group create_hierarchical_groups create_hybrid_dp_cp_groups default_embedding_ranks
    default_position_embedding_ranks destroy_global_memory_buffer destroy_global_symmetric_memory_buffer
    destroy_model_parallel detect_launch device_mesh dist_init find_split fsdp_mesh
    generate_masked_orthogonal_rank_groups get_all_ranks get_amax_reduction_group
    get_context_parallel_global_ranks get_context_parallel_group get_context_parallel_rank
    get_context_parallel_world_size get_cp_group get_cp_rank get_cp_world_size
    get_data_modulo_expert_parallel_group get_data_parallel_group get_data_parallel_group_gloo
    get_data_parallel_rank get_data_parallel_src_rank get_data_parallel_world_size get_dp_group
    get_dp_group_gloo get_dp_rank get_dp_world_size get_embedding_group get_expert_data_parallel_group
    get_expert_data_parallel_group_gloo get_expert_data_parallel_rank get_expert_data_parallel_world_size
    get_expert_model_parallel_group get_expert_model_parallel_rank get_expert_model_parallel_src_rank
    get_expert_model_parallel_world_size get_expert_tensor_and_model_parallel_group
    get_expert_tensor_and_model_parallel_rank get_expert_tensor_and_model_parallel_world_size
    get_expert_tensor_model_pipeline_parallel_group get_expert_tensor_parallel_group
    get_expert_tensor_parallel_rank get_expert_tensor_parallel_world_size get_global_memory_buffer
    get_global_symmetric_memory_buffer get_hierarchical_context_parallel_groups
    get_hybrid_data_context_parallel_groups get_inter_distributed_optimizer_instance_group
    get_intra_distributed_optimizer_instance_group get_model_parallel_group get_model_parallel_src_rank
    get_nccl_options get_pipeline_model_parallel_first_rank get_pipeline_model_parallel_group
    get_pipeline_model_parallel_last_rank get_pipeline_model_parallel_next_rank
    get_pipeline_model_parallel_prev_rank get_pipeline_model_parallel_rank
    get_pipeline_model_parallel_world_size get_position_embedding_group get_pp_group get_pp_rank
    get_pp_world_size get_tensor_and_context_parallel_group get_tensor_and_context_parallel_rank
    get_tensor_and_context_parallel_world_size get_tensor_and_data_parallel_group
    get_tensor_model_parallel_group get_tensor_model_parallel_last_rank get_tensor_model_parallel_rank
    get_tensor_model_parallel_ranks get_tensor_model_parallel_src_rank get_tensor_model_parallel_world_size
    get_tp_group get_tp_rank get_tp_world_size get_virtual_pipeline_model_parallel_rank
    get_virtual_pipeline_model_parallel_world_size has_separate_all_gather_group initialize_model_parallel
    is_initialized is_last_rank is_last_tp_cp_rank is_pipeline_first_stage is_pipeline_last_stage
    is_rank_in_embedding_group is_rank_in_position_embedding_group is_torch_min_version is_unitialized
    model_parallel_is_initialized overwrite_nccl_comm_cfgs print_per_rank print_rank_0 register_dist_init_hook
    register_teardown_hook resolve_global_rank resolve_world_size set_data_parallel_rank
    set_expert_model_parallel_rank set_expert_model_parallel_world_size set_expert_tensor_parallel_rank
    set_expert_tensor_parallel_world_size set_pipeline_model_parallel_rank
    set_pipeline_model_parallel_world_size set_tensor_model_parallel_rank set_tensor_model_parallel_world_size
    set_virtual_pipeline_model_parallel_rank set_virtual_pipeline_model_parallel_world_size timedelta
    update_pg_timeout
""".split()


def test_every_public_name_of_the_flat_layout_is_still_importable():
    import parallel_state

    missing = [n for n in PUBLIC if not hasattr(parallel_state, n)]
    assert len(PUBLIC) == 131 and not missing, missing


def test_wheel_installs_only_parallel_state_cp_and_scheduler(tmp_path):
    # A copy of the sources, examples included, so the build leaves nothing in the checkout and
    # the examples' absence from the wheel is a choice of the packaging, not of what was copied.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("parallel_state", "cp", "scheduler", "examples"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"parallel_state", "cp", "scheduler"}, top
    for layer in LAYERS:
        assert f"parallel_state/{layer}/__init__.py" in names, layer
    assert not [n for n in names if "demo_dit" in n or "parallel_state_demo" in n]


def test_no_source_text_is_run_in_the_packages():
    import ast

    calls = []
    for package in ("parallel_state", "cp", "scheduler"):
        for path in sorted(glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)):
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                        node.func.id in ("exec", "eval", "compile"):
                    calls.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    # The source that follows the release table is written by a command and checked in
    # (parallel_state/tools/generate.py, tests/test_tools_generate.py), never made from text at import.
    assert calls == []


def _synthesized(cls: object, fn: object) -> bool:
    """Whether ``fn`` is a method the standard library writes for a class from its declared fields
    (a dataclass's ``__init__``, ``__repr__``, ...; a named tuple's ``__new__``): the fields are the source."""
    import dataclasses
    import inspect

    if not inspect.isclass(cls) or fn.__code__.co_filename != "<string>":
        return False
    named_tuple = issubclass(cls, tuple) and hasattr(cls, "_fields")
    return dataclasses.is_dataclass(cls) and fn.__name__.startswith("__") or named_tuple and fn.__name__ == "__new__"


def functions_made_from_text(packages: tuple[str, ...] = ("parallel_state", "cp", "scheduler")) -> list[str]:
    """Every function (and method) defined in a module of ``packages`` whose code is not a def or lambda of a
    file of its package at the line its code names: what the import made from text."""
    import importlib
    import inspect
    import pkgutil

    wrong = []
    for package in packages:
        top = importlib.import_module(package)
        home = os.path.dirname(os.path.abspath(top.__file__))
        modules = [top] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(top.__path__, f"{package}.")
                           if not m.name.endswith("__main__")]
        for module in modules:
            for name, obj in vars(module).items():
                members = [obj] if not inspect.isclass(obj) else [
                    m for attr in vars(obj).values() for m in (getattr(attr, "__func__", attr),
                                                              getattr(attr, "fget", None)) if m is not None]
                for fn in members:
                    fn = inspect.unwrap(fn) if inspect.isfunction(fn) else fn  # a decorator's wrapper: its function
                    if not inspect.isfunction(fn) or not fn.__module__.startswith(package) or \
                            _synthesized(obj, fn):
                        continue
                    code = fn.__code__
                    path = os.path.abspath(code.co_filename)
                    where = f"{module.__name__}.{name} ({code.co_filename}:{code.co_firstlineno})"
                    if not (path.startswith(home + os.sep) and os.path.isfile(path)):
                        wrong.append(where)
                        continue
                    with open(path, encoding="utf-8") as f:
                        lines = f.read().splitlines()
                    # The code's first line is its def (or a decorator, or the line holding its lambda).
                    first = lines[code.co_firstlineno - 1].strip() if code.co_firstlineno <= len(lines) else ""
                    made = f"def {code.co_name}(" in first or first.startswith("@") or \
                        code.co_name == "<lambda>" and "lambda" in first
                    if not made:
                        wrong.append(where)
    return wrong


def test_every_function_is_a_def_in_a_file_of_its_package():
    """Under the release in use (0.16 here; tests/test_megatron_releases.py checks 0.17 to 0.20 in processes
    of their own): grep, go-to-definition and tracebacks find every function where its code says it is."""
    assert functions_made_from_text() == []
