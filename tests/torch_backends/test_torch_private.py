"""The private torch APIs behind ``backends/torch_common/torch_private.py`` against the installed
torch: each symbol exists and has the signature the wrapper calls; the FSDP1 internals work on
two gloo ranks.  A failure names the torch version and the symbol: a torch upgrade changed a
private API the FSDP1 / DTensor / compile paths use, and torch_private.py is the one place to adapt.

No other backend module may reach into torch's privates (checked here too).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from core.testing.gloo_ranks import init_gloo, run_ranks

REPO = Path(__file__).resolve().parents[2]
TORCH = torch.__version__

#: (module, attribute path, the parameter names the wrapper relies on; None: not a function).
SYMBOLS = [
    ("torch.distributed.fsdp._runtime_utils", "_reshard", ["state", "handle", "free_unsharded_flat_param"]),
    ("torch.distributed.fsdp._flat_param", "HandleShardingStrategy.SHARD_GRAD_OP", None),
    ("torch.distributed.fsdp._flat_param", "FlatParamHandle.needs_unshard", ["self"]),
    ("torch.distributed.fsdp._flat_param", "FlatParamHandle.uses_sharded_strategy", None),
    ("torch.distributed.fsdp._flat_param", "ParamInfo", None),
    ("torch.distributed.fsdp._flat_param", "SharedParamInfo", None),
    ("torch.distributed.fsdp._common_utils", "FSDP_WRAPPED_MODULE", None),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", ["self", "mesh_dim_name"]),
    ("torch.distributed.tensor.experimental._attention", "set_rotate_method", ["rotate_method"]),
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor.trigger_wait", ["self"]),
    ("torch.distributed.tensor._redistribute", "redistribute_local_tensor", None),  # the logger's module
]


def _resolve(module: str, path: str):
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"torch {TORCH}: module {module} is gone ({err}); adapt backends/torch_common/torch_private.py")
    for part in path.split("."):
        if not hasattr(obj, part):
            pytest.fail(f"torch {TORCH}: {module}.{path} is gone ({part!r} missing); adapt torch_private.py")
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


@pytest.mark.parametrize("module, path, params", SYMBOLS, ids=[f"{m}.{p}" for m, p, _ in SYMBOLS])
def test_each_private_symbol_exists_with_the_signature_used(module, path, params):
    obj = _resolve(module, path)
    if params is not None:
        have = list(inspect.signature(obj).parameters)
        assert have[: len(params)] == params, f"torch {TORCH}: {module}.{path}{inspect.signature(obj)}; uses {params}"


def test_onednn_linear_op_has_the_schema_called():
    from backends.torch_common.torch_private import has_onednn_linear_op, onednn_linear

    schema = torch.ops.mkldnn._linear_pointwise.default._schema
    assert [a.name for a in schema.arguments] == ["X", "W", "B", "attr", "scalars", "algorithm"], f"torch {TORCH}"
    if has_onednn_linear_op():
        x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
        torch.testing.assert_close(onednn_linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_the_records_the_wrappers_read():
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE
    from torch.distributed.fsdp._flat_param import ParamInfo, SharedParamInfo

    from backends.torch_common import torch_private

    for record in (ParamInfo, SharedParamInfo):
        assert record._fields[:3] == ("param_name", "module", "module_name"), f"torch {TORCH}: {record._fields}"
    assert torch_private.FSDP_WRAPPED_MODULE == FSDP_WRAPPED_MODULE == "_fsdp_wrapped_module", f"torch {TORCH}"


def test_the_compiled_call_module_compile_installs():
    from backends.torch_common.torch_private import compiled_call, set_compiled_call

    layer = torch.nn.Linear(3, 3)
    assert compiled_call(layer) is None, f"torch {TORCH}: nn.Module._compiled_call_impl before compile()"
    layer.compile(backend="eager")
    compiled = compiled_call(layer)
    assert compiled is not None, f"torch {TORCH}: nn.Module.compile() no longer sets _compiled_call_impl"
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    set_compiled_call(layer, wrapped)
    x = torch.ones(2, 3)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)) and calls == [1]


def _private_uses(path: Path) -> list[str]:
    """Imports of a private torch module, and private attributes read off anything but
    ``self`` / ``cls`` / ``super()`` (a torch object's, here), in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if any(n.split(".")[0] == "torch" and any(p.startswith("_") for p in n.split(".")) for n in names):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: import {names}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls")
            parent = isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
            if not (own or parent):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_torch_backend_module_but_torch_private_reaches_into_torch_privates():
    roots = [REPO / "backends" / name for name in ("torch_common", "torch_fsdp", "torch_dtensor")]
    files = [p for root in roots for p in sorted(root.rglob("*.py")) if p.name != "torch_private.py"]
    assert [use for path in files for use in _private_uses(path)] == []


# ----------------------------------------------------------------------------- FSDP1 on two ranks
def _fsdp1_rank(rank, world, port, results):
    try:
        init_gloo(rank, world, port)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        from backends.torch_common import torch_private as tp

        torch.manual_seed(0)
        inner = torch.nn.Linear(4, 4)
        cpu = torch.device("cpu")  # explicit: FSDP1 only runs on CPU when told so
        model = FSDP(
            torch.nn.Sequential(FSDP(inner, use_orig_params=True, device_id=cpu), torch.nn.Linear(4, 2)),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            use_orig_params=True,
            device_id=cpu,
        )
        handles = tp.flat_param_handles(model)
        strategies = [h._sharding_strategy for h in handles]
        with tp.handles_kept_gathered(handles):
            during = [h._sharding_strategy.name for h in handles]
            model(torch.ones(2, 4))  # SHARD_GRAD_OP: every unit stays gathered after forward
        restored = [h._sharding_strategy for h in handles] == strategies
        gathered = [not h.needs_unshard() for h in handles]
        tp.reshard_gathered(model)
        resharded = [h.needs_unshard() for h in handles]
        records = [(name, attr) for unit in FSDP.fsdp_modules(model) for name, _, attr in tp.unit_weight_records(unit)]
        report = {"handles": len(handles), "sharded": all(h.uses_sharded_strategy for h in handles)}
        report |= {"during": during, "restored": restored, "gathered": gathered, "resharded": resharded}
        results.put((rank, report | {"records": sorted(records)}))
    except BaseException as err:  # the parent reports a rank's failure with its message
        import traceback

        results.put((rank, {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}))


def test_the_fsdp1_internals_on_two_gloo_ranks():
    reports = run_ranks(_fsdp1_rank, 2)
    for rank, report in reports.items():
        assert "error" not in report, f"torch {TORCH}, rank {rank}: {report['error']}"
        assert report["handles"] == 2 and report["sharded"], report
        assert report["during"] == ["SHARD_GRAD_OP"] * 2 and report["restored"], report
        assert report["gathered"] == [True, True] and report["resharded"] == [True, True], report
        assert report["records"] == [("", "bias"), ("", "weight"), ("1", "bias"), ("1", "weight")], report
