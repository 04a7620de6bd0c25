"""vLLM 0.33's engine-facing API (tests/data/vllm_0_33_api.md, extracted from vLLM's
sources) checked against our modules, and the compatibility table made from it.

Each contract name is classified:

* ``same``: ours takes the same parameters, in the same order, with the same
  defaults (literal defaults compared by value);
* ``extension``: the same, plus keyword-only parameters of ours (a positional
  vLLM call can never bind to them);
* ``not supported``: ours exists and raises ``NotSupportedError.by_groupcoord``
  (``device_communicators.errors.unsupported``) with the reason;
* ``missing`` or ``differs``: a contract break (the test fails).

``python tests/vllm_contract.py --write`` regenerates docs/vllm_compat.md; the
test fails when the file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CONTRACT = os.path.join(HERE, "data", "vllm_0_33_api.md")
TABLE = os.path.join(HERE, "..", "docs", "vllm_compat.md")

MODULES = {
    "vllm/distributed/parallel_state.py": "coordinator.parallel_state",
    "vllm/distributed/communication_op.py": "coordinator.communication_op",
    "vllm/distributed/utils.py": "coordinator.utils",
    "vllm/distributed/device_communicators/shm_broadcast.py": "shm_broadcast",
}
DEVICE_PREFIX = "vllm/distributed/device_communicators/"

# Why a name that is present behaves differently from vLLM on purpose.
NOTES = {
    "parallel_state.init_distributed_environment": "timeout also takes seconds",
    "parallel_state.initialize_model_parallel": (
        "DP size and EP (vLLM's config) are keyword-only: data_parallel_size, "
        "enable_expert_parallel; ends with a world barrier"
    ),
    "parallel_state.get_ep_group": "built always (DP x PCP x TP); all2all only with EP on",
    "parallel_state.get_eplb_group": "the EP group itself",
    "utils.get_pp_indices": "partition= replaces VLLM_PP_LAYER_PARTITION",
    "utils.stateless_init_torch_distributed_process_group": "backend 'gloo' only",
    "base_device_communicator.All2AllManagerBase.__init__": (
        "talks through the device communicator registered for cpu_group (or communicator=)"
    ),
    "base_device_communicator.All2AllManagerBase.set_num_sms": "checked; no SM-resident kernels",
    "base_device_communicator.All2AllManagerBase.max_sms_used": "None: uses no SMs",
    "custom_all_reduce.CustomAllreduce.__init__": (
        "all-gather/reduce-scatter limits accepted; those go to NCCL"
    ),
    "custom_all_reduce.CustomAllreduce.should_custom_all_gather": "False: no such kernel, NCCL",
    "custom_all_reduce.CustomAllreduce.custom_all_gather": "None: no such kernel, NCCL",
    "custom_all_reduce.CustomAllreduce.should_custom_reduce_scatter": "False: no such kernel, NCCL",
    "custom_all_reduce.CustomAllreduce.should_mnnvl_multimem_reduce_scatter": "False: no MNNVL",
    "custom_all_reduce.CustomAllreduce.custom_reduce_scatter": "None: no such kernel, NCCL",
    "custom_all_reduce.CustomAllreduce.free_shared_buffer": "also closes the peers' mappings",
    "shm_broadcast.SpinCondition": "works; our MessageQueue sleeps on a futex in the ring instead",
    "shm_broadcast.MessageQueue.acquire_write": "local readers only (raw bytes in the ring)",
    "all2all.AgRsAll2AllManager": "AllGatherReduceScatterAll2AllManager",
    "parallel_state.get_etp_group": (
        "the ranks sharding expert weights: the EP group with EP off, the rank alone with EP on"
    ),
    "parallel_state.get_engram_dp_group": "this rank's DP peers on its node; None when alone",
    "parallel_state.suspend_device_comms": (
        "frees NCCL communicators and shm all-reduce segments; collectives run on "
        "torch.distributed until resume"
    ),
    "parallel_state.checkpoint_prepare_distributed_state": (
        "suspend + all2all buffers released, per group"
    ),
    "base_device_communicator.All2AllManagerBase.query_active_mask": (
        "1 = dead (pid gone, this host) or masked"
    ),
    "base_device_communicator.All2AllManagerBase.query_fault": (
        "a rank died since the last clean_buffers()"
    ),
    "base_device_communicator.All2AllManagerBase.mask_remote_ranks": (
        "dispatch/combine stay on this rank"
    ),
    "base_device_communicator.All2AllManagerBase.stage_ep_size": (
        "nothing to stage: a manager is built for its (standby) group's size"
    ),
    "base_device_communicator.All2AllManagerBase.commit_ep_size": (
        "nothing to switch: a manager is built for its (standby) group's size"
    ),
    "pynccl.defer_comm_warmup_on_rocm": "False: CUDA only, warm-up at construction",
}


@dataclasses.dataclass
class Entry:
    module: str  # ours, e.g. "coordinator.parallel_state"
    owner: str | None  # class name, or None for a module-level name
    name: str
    kind: str  # "function", "method", "field", "class"
    params: str = ""  # vLLM's parameter text (no self)
    tags: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        short = self.module.rsplit(".", 1)[-1]
        return f"{short}.{self.owner}.{self.name}" if self.owner else f"{short}.{self.name}"


def parse_contract(path: str = CONTRACT) -> list[Entry]:
    entries: list[Entry] = []
    module: str | None = None
    owner: str | None = None
    for line in open(path, encoding="utf-8"):
        if line.startswith("## "):
            source = line[3:].strip()
            if source.startswith(DEVICE_PREFIX) and source not in MODULES:
                module = "device_communicators." + source[len(DEVICE_PREFIX) : -3]
            else:
                module = MODULES[source]
            owner = None
            continue
        match = re.match(r"^(\s*)- (class |field )?`(.*)`(.*)$", line.rstrip("\n"))
        if match is None or module is None:
            continue
        indent, prefix, body, tail = match.groups()
        tags = tuple(re.findall(r"\[(\w+)\]", tail))
        if prefix == "class ":
            owner = body.split("(", 1)[0]
            entries.append(Entry(module, None, owner, "class"))
        elif prefix == "field ":
            entries.append(Entry(module, owner, body.split(":", 1)[0].strip(), "field"))
        else:
            name, params = body.split("(", 1)
            params = params[: _closing(params)]
            in_class = bool(indent)
            if not in_class:
                owner = None
            entries.append(
                Entry(
                    module,
                    owner if in_class else None,
                    name,
                    "method" if in_class else "function",
                    params,
                    tags,
                )
            )
    return entries


def _closing(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i
            depth -= 1
    raise ValueError(f"unbalanced parameters: {text}")


@dataclasses.dataclass
class Param:
    name: str
    kind: str  # "positional", "keyword", "var"
    default: str | None  # source text of the default, or None


def parse_params(text: str) -> list[Param]:
    out: list[Param] = []
    keyword_only = False
    for part in _split_top(text):
        part = part.strip()
        if not part or part == "self" or part == "cls":
            continue
        if part == "*":
            keyword_only = True
            continue
        if part.startswith("*"):
            out.append(Param(part.lstrip("*").split(":")[0].strip(), "var", None))
            keyword_only = True
            continue
        name_part, _, default = part.partition("=")
        name = name_part.split(":")[0].strip()
        out.append(
            Param(name, "keyword" if keyword_only else "positional", default.strip() or None)
        )
    return out


def _split_top(text: str) -> list[str]:
    parts, depth, quote, current = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    parts.append(current)
    return parts


def _literal(text: str) -> Any:
    """The value of a literal default (numbers, strings, None, simple arithmetic)."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    if not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise ValueError(text)
    return eval(compile(tree, "<default>", "eval"), {"__builtins__": {}})  # noqa: S307


def _ours(entry: Entry) -> Any:
    module = importlib.import_module(entry.module)
    if entry.owner is None:
        return getattr(module, entry.name)
    owner = getattr(module, entry.owner)
    return inspect.getattr_static(owner, entry.name)


def classify(entry: Entry) -> tuple[str, str]:
    """(status, note) for one contract entry."""
    try:
        ours = _ours(entry)
    except AttributeError:
        if entry.kind == "field":
            return _field(entry)
        return "missing", f"no {entry.name} in {entry.module}"
    why = getattr(ours, "__groupcoord_unsupported__", None)
    if why is None and isinstance(ours, (staticmethod, classmethod)):
        why = getattr(ours.__func__, "__groupcoord_unsupported__", None)
    if why is not None:
        return "not supported", why
    if entry.kind in ("class", "field"):
        return "same", ""
    if "property" in entry.tags:
        return ("same", "") if isinstance(ours, property) else ("differs", "not a property")
    for tag, kind in (("staticmethod", staticmethod), ("classmethod", classmethod)):
        if tag in entry.tags and not isinstance(ours, kind):
            return "differs", f"not a {tag}"
    function = ours.__func__ if isinstance(ours, (staticmethod, classmethod)) else ours
    if isinstance(function, property) or not callable(function):
        return "differs", f"{type(ours).__name__}, not a function"
    return _compare(parse_params(entry.params), function, entry)


def _field(entry: Entry) -> tuple[str, str]:
    owner = getattr(importlib.import_module(entry.module), entry.owner or "", None)
    if owner is None:
        return "missing", f"no {entry.owner} in {entry.module}"
    for cls in inspect.getmro(owner):
        if entry.name in getattr(cls, "__annotations__", {}):
            return "same", ""
        try:
            if f"self.{entry.name} " in inspect.getsource(
                cls
            ) or f"self.{entry.name}:" in inspect.getsource(cls):
                return "same", ""
        except (OSError, TypeError):
            continue
    return "missing", f"{entry.owner} has no attribute {entry.name}"


def _compare(theirs: list[Param], function: Any, entry: Entry) -> tuple[str, str]:
    signature = inspect.signature(function)
    ours = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    positional = [p for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in ours}
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in ours)
    their_positional = [p for p in theirs if p.kind == "positional"]
    problems = []
    for i, param in enumerate(their_positional):
        if i >= len(positional) or positional[i].name != param.name:
            got = positional[i].name if i < len(positional) else "nothing"
            problems.append(f"parameter {i + 1} is {got}, vLLM's is {param.name}")
            continue
        problems += _default_problem(param, positional[i])
    if len(positional) > len(their_positional):
        extra = [p.name for p in positional[len(their_positional) :]]
        problems.append(f"extra positional parameters {extra} (make them keyword-only)")
    for param in theirs:
        if param.kind == "keyword":
            if param.name not in by_name and not has_var_kw:
                problems.append(f"no keyword parameter {param.name}")
            elif param.name in by_name:
                problems += _default_problem(param, by_name[param.name])
        if param.kind == "var" and not any(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ours
        ):
            problems.append(f"no *{param.name}")
    if problems:
        return "differs", "; ".join(problems)
    theirs_names = {p.name for p in theirs}
    extras = [p.name for p in ours if p.kind == p.KEYWORD_ONLY and p.name not in theirs_names]
    note = NOTES.get(entry.label, "")
    if extras:
        added = "adds keyword-only " + ", ".join(extras)
        return "extension", f"{added}; {note}" if note else added
    return "same", note


def _default_problem(theirs: Param, ours: inspect.Parameter) -> list[str]:
    if (theirs.default is None) != (ours.default is inspect.Parameter.empty):
        want = "a default" if theirs.default is not None else "no default"
        return [f"{theirs.name}: vLLM has {want}"]
    if theirs.default is None:
        return []
    try:
        value = _literal(theirs.default)
    except (ValueError, SyntaxError):
        return []  # a name or call (e.g. ReduceOp.SUM): not compared by value
    if value != ours.default or type(value) is not type(ours.default):
        return [f"{theirs.name}: default {ours.default!r}, vLLM's {theirs.default}"]
    return []


def render_table(rows: list[tuple[Entry, str, str]]) -> str:
    counts: dict[str, int] = {}
    for _, status, _ in rows:
        counts[status] = counts.get(status, 0) + 1
    lines = [
        "# vLLM 0.33 compatibility",
        "",
        "Every public name of vLLM 0.33's engine-facing distributed API (the contract,",
        "`tests/data/vllm_0_33_api.md`) and its status here. Generated by",
        "`python tests/vllm_contract.py --write`; `tests/test_vllm_contract.py` fails when",
        "a name is missing, differs, or this page is stale.",
        "",
        "Module map: `vllm.distributed.X` -> `coordinator.X`,",
        "`vllm.distributed.device_communicators.X` -> `device_communicators.X`,",
        "`...device_communicators.shm_broadcast` -> `shm_broadcast`.",
        "",
        "- **same**: same parameters, order and defaults;",
        "- **extension**: the same plus keyword-only parameters of ours;",
        "- **not supported**: present, raises `NotSupportedError` (a `NotImplementedError`)",
        '  saying "... is not supported by groupcoord: why";',
        "- **open gap**: missing or different today, listed in",
        "  `tests/data/vllm_0_33_open_gaps.txt`: work still to do.",
        "",
        "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".",
        "",
    ]
    module = None
    for entry, status, note in rows:
        if entry.module != module:
            module = entry.module
            lines += ["", f"## `{module}`", "", "| name | status | note |", "|---|---|---|"]
        name = f"{entry.owner}.{entry.name}" if entry.owner else entry.name
        lines.append(f"| `{name}` | {status} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def check_all() -> list[tuple[Entry, str, str]]:
    rows = []
    for entry in parse_contract():
        status, note = classify(entry)
        if status in ("missing", "differs") and entry.label in KNOWN_GAPS:
            status, note = "open gap", f"{status}: {note}"
        rows.append((entry, status, note))
    return rows


def _known_gaps() -> set[str]:
    path = os.path.join(HERE, "data", "vllm_0_33_open_gaps.txt")
    return {line.strip() for line in open(path, encoding="utf-8") if line.strip()}


# Contract names not yet matched (issue 10 stays open while this list is not empty).
KNOWN_GAPS = _known_gaps()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    rows = check_all()
    if "--gaps" in sys.argv:  # rewrite the open-gap list from what fails now
        KNOWN_GAPS.clear()
        failing = [e.label for e in parse_contract() if classify(e)[0] in ("missing", "differs")]
        with open(os.path.join(HERE, "data", "vllm_0_33_open_gaps.txt"), "w") as f:
            f.write("".join(f"{label}\n" for label in failing))
        KNOWN_GAPS.update(failing)
        rows = check_all()
    if "--write" in sys.argv:
        with open(TABLE, "w", encoding="utf-8") as f:
            f.write(render_table(rows))
    for entry, status, note in rows:
        if status in ("missing", "differs") or "-v" in sys.argv:
            print(f"{status:>13}  {entry.label}: {note}")
