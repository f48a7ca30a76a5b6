"""Mesh / logical-axis sharding and the optax mirror of the torch optimizer + scheduler.

CPU only: tests/conftest.py asks XLA for 8 virtual host devices before jax is imported.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from backends.jax_pjit.optim import (
    build_optax,
    build_schedule,
    get_learning_rate,
    init_optimizer_state,
    optimizer_state_shardings,
    set_learning_rate,
)
from backends.jax_pjit.sharding import (
    activation_constraint,
    check_divisible,
    logical_to_mesh_spec,
    logical_to_sharding,
    make_mesh,
    shard_host_batch,
    tree_shardings,
)
from backends.torch_common.optim import build_optimizer, build_scheduler
from tests.torch_backends.conftest import policy_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")


def _cfg(fsdp, tp, backend="jax_pjit"):
    """The test policy section (no model is loaded: make_mesh reads the layout only)."""
    cfg = policy_config(Path("unused-model"), backend)
    cfg["parallel"].update(fsdp_size=fsdp, tensor_parallel_size=tp)
    return cfg


@pytest.fixture(scope="module")
def mesh42():
    return make_mesh(_cfg(4, 2))


# =========================================================================== mesh
@pytest.mark.parametrize(
    "fsdp, tp, n_dev, expect",
    [(8, 1, 8, (8, 1)), (4, 2, 8, (4, 2)), (-1, 2, 8, (4, 2)), (-1, 1, 8, (8, 1)), (1, 2, 2, (1, 2))],
)
def test_make_mesh_sizes(fsdp, tp, n_dev, expect):
    devices = jax.devices()[:n_dev]
    mesh = make_mesh(_cfg(fsdp, tp), devices=devices)
    assert mesh.axis_names == ("fsdp", "cp", "tp")  # cp always present (size 1 here)
    assert (mesh.shape["fsdp"], mesh.shape["tp"]) == expect and mesh.shape["cp"] == 1
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    assert set(mesh.devices.flat) == set(devices)


def test_make_mesh_defaults_to_all_devices():
    mesh = make_mesh(_cfg(-1, 2))
    assert mesh.size == jax.device_count() == 8


@pytest.mark.parametrize(
    "fsdp, tp, field",
    [(3, 2, "policy.parallel.fsdp_size"), (-1, 3, "policy.parallel.tensor_parallel_size"), (4, 4, "fsdp_size")],
)
def test_make_mesh_bad_sizes_name_the_field(fsdp, tp, field):
    with pytest.raises(ValueError, match=field):
        make_mesh(_cfg(fsdp, tp))


def test_make_mesh_rejects_other_backend():
    with pytest.raises(ValueError, match="policy.backend"):
        make_mesh(_cfg(-1, 1, backend="torch_fsdp"))


# ================================================================= logical -> specs
@pytest.mark.parametrize(
    "axes, spec",
    [
        (("vocab", "embed"), P("tp", "fsdp")),
        (("embed", "mlp"), P("fsdp", "tp")),
        (("mlp", "embed"), P("tp", "fsdp")),
        (("embed", "heads", "head_dim"), P("fsdp", "tp", None)),
        (("embed", "kv_heads", "head_dim"), P("fsdp", "tp", None)),
        (("norm",), P(None)),
        ((), P()),
        (("batch", "seq", "act_vocab"), P("fsdp", "cp", "tp")),  # seq -> cp (context parallel)
        (("not_a_rule", None), P(None, None)),
        # one mesh axis per spec: the first dimension keeps it, later ones are replicated
        (("mlp", "vocab"), P("tp", None)),
        (("embed", "embed", "heads"), P("fsdp", None, "tp")),
    ],
)
def test_logical_to_mesh_spec(axes, spec):
    assert logical_to_mesh_spec(axes) == spec


def test_custom_rules_multi_axis():
    rules = (("batch", ("fsdp", "tp")), ("embed", "tp"))
    assert logical_to_mesh_spec(("batch", "embed"), rules) == P(("fsdp", "tp"), None)
    assert logical_to_mesh_spec(("embed", "batch"), rules) == P("tp", "fsdp")


def test_logical_to_sharding_and_replicated(mesh42):
    sh = logical_to_sharding(("embed", "mlp"), mesh42)
    assert isinstance(sh, NamedSharding) and sh.mesh == mesh42 and sh.spec == P("fsdp", "tp")
    assert logical_to_sharding(None, mesh42).spec == P()


def test_tree_shardings_place_params(mesh42):
    axes = {
        "embed": ("vocab", "embed"),
        "layers": [
            {"wq": ("embed", "heads", "head_dim"), "w_up": ("embed", "mlp"), "norm": ("norm",)},
        ],
        "scale": (),
        "frozen": None,
    }
    shapes = {
        "embed": (32, 16),
        "layers": [{"wq": (16, 4, 8), "w_up": (16, 24), "norm": (16,)}],
        "scale": (),
        "frozen": (3, 5),
    }
    check_divisible(shapes, axes, mesh42)  # all fit 4 x 2
    shardings = tree_shardings(axes, mesh42)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.standard_normal(s).astype(np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    placed = jax.device_put(params, shardings)
    assert placed["embed"].sharding.spec == P("tp", "fsdp")
    assert placed["embed"].addressable_shards[0].data.shape == (16, 4)
    wq = placed["layers"][0]["wq"]
    assert wq.sharding.spec == P("fsdp", "tp", None)
    assert wq.addressable_shards[0].data.shape == (4, 2, 8)
    assert placed["layers"][0]["w_up"].sharding.spec == P("fsdp", "tp")
    assert placed["layers"][0]["norm"].sharding.spec == P(None)
    assert placed["scale"].sharding.spec == P()
    assert placed["frozen"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(wq), params["layers"][0]["wq"])


def test_check_divisible_names_param_dim_and_sizes(mesh42):
    axes = {"layers": [{"wq": ("embed", "heads", "head_dim")}], "emb": ("vocab", "embed")}
    shapes = {
        "layers": [{"wq": jax.ShapeDtypeStruct((16, 3, 4), jnp.float32)}],
        "emb": jax.ShapeDtypeStruct((32, 16), jnp.float32),
    }
    with pytest.raises(ValueError) as err:
        check_divisible(shapes, axes, mesh42)
    msg = str(err.value)
    assert "layers/0/wq" in msg and "dim 1" in msg and "'heads'" in msg
    assert "size 3" in msg and "'tp'" in msg and "size 2" in msg
    assert "emb" not in msg.replace("embed", "")  # only the offending parameter is listed
    # fsdp over the embed dim: 10 % 4
    with pytest.raises(ValueError, match=r"w: dim 0 \('embed'\) has size 10.*'fsdp' of size 4"):
        check_divisible({"w": (10, 8)}, {"w": ("embed", "mlp")}, mesh42)
    with pytest.raises(ValueError, match="2 dims but logical axes"):
        check_divisible({"w": (16, 8)}, {"w": ("embed",)}, mesh42)


def test_activation_constraint(mesh42):
    constrain = activation_constraint(mesh42)

    @jax.jit
    def f(x):
        return constrain(x * 2.0, ("batch", "seq", "act_mlp"))

    out = f(jnp.ones((8, 5, 6)))
    assert out.sharding.spec == P("fsdp", None, "tp")
    np.testing.assert_array_equal(np.asarray(out), 2.0)
    # batch 3 does not divide fsdp=4: replicated instead of a trace error (lenient default)
    out = jax.jit(lambda x: constrain(x, ("batch", "act_mlp")))(jnp.ones((3, 6)))
    assert out.sharding.spec in (P(None, "tp"), P(None, "tp", None))
    strict = activation_constraint(mesh42, strict=True)
    with pytest.raises(ValueError, match="not divisible"):
        jax.jit(lambda x: strict(x, ("batch", "act_mlp")))(jnp.ones((3, 6)))
    with pytest.raises(ValueError, match="logical axes"):
        constrain(jnp.ones((2, 2)), ("batch",))


def test_shard_host_batch(mesh42):
    ids = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
    arr = shard_host_batch(ids, mesh42)
    assert arr.sharding.spec == P("fsdp", None) and arr.addressable_shards[0].data.shape == (2, 6)
    np.testing.assert_array_equal(np.asarray(arr), ids)
    lengths = shard_host_batch(torch.arange(8), mesh42)  # [B] with the default ("batch", "seq")
    assert lengths.sharding.spec == P("fsdp") and lengths.dtype in (jnp.int32, jnp.int64)
    np.testing.assert_array_equal(np.asarray(lengths), np.arange(8))
    bf = torch.randn(4, 3, dtype=torch.bfloat16)
    arr = shard_host_batch(bf, mesh42, ("batch",))
    assert arr.dtype == jnp.bfloat16 and arr.sharding.spec == P("fsdp", None)
    np.testing.assert_array_equal(np.asarray(arr.astype(jnp.float32)), bf.float().numpy())
    with pytest.raises(ValueError, match="size 6 is not divisible by mesh axis fsdp of size 4"):
        shard_host_batch(np.zeros((6, 2)), mesh42)


# ======================================================================= schedules
_TORCH = "torch.optim.lr_scheduler."


def _lin(start, end, total):
    return {"name": _TORCH + "LinearLR", "kwargs": {"start_factor": start, "end_factor": end, "total_iters": total}}


def _const(factor, total):
    return {"name": _TORCH + "ConstantLR", "kwargs": {"factor": factor, "total_iters": total}}


SCHEDULES = {
    "default_warmup_then_constant": [_lin(0.1, 1.0, 10), _const(1.0, 10_000_000_000), {"milestones": [10]}],
    "warmup_then_half_constant": [_lin(0.2, 1.0, 5), _const(0.5, 4), {"milestones": [7]}],
    "constant_then_decay": [_const(0.5, 3), _lin(0.5, 0.1, 6), {"milestones": [4]}],
    "three_chained": [_lin(0.25, 1.0, 4), _const(0.3, 2), _lin(1.0, 0.2, 5), {"milestones": [3, 9]}],
    "milestone_zero": [_const(0.5, 2), _lin(0.4, 1.0, 3), {"milestones": [0]}],
    "single_linear": [_lin(0.25, 1.0, 8)],
    "single_constant": [_const(0.3, 6)],
    "single_with_ignored_milestones": [_lin(0.5, 1.0, 3), {"milestones": [2]}],
    "none": None,
    "empty": [],
}


def _torch_lrs(entries, base_lr, n_steps):
    """torch's lr for train() calls 0..n_steps-1 (scheduler stepped after each call)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = build_scheduler(entries, opt)
        lrs = []
        for _ in range(n_steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return lrs


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_matches_torch(name):
    entries, base_lr, n = SCHEDULES[name], 3e-4, 25
    expected = _torch_lrs(entries, base_lr, n)
    fn = build_schedule(entries, base_lr)
    got = [fn(i) for i in range(n)]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    # through build_optax: same function, and the state starts at schedule_fn(0)
    tx, schedule_fn = build_optax({"name": "torch.optim.AdamW", "kwargs": {"lr": base_lr}}, entries, 1.0)
    assert [schedule_fn(i) for i in range(n)] == got
    state = tx.init({"w": jnp.zeros(2)})
    np.testing.assert_allclose(get_learning_rate(state), expected[0], rtol=1e-6)


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"policy.scheduler\[0\].name"):
        build_schedule([{"name": _TORCH + "CosineAnnealingLR", "kwargs": {"T_max": 10}}], 1e-3)
    with pytest.raises(ValueError, match="milestones"):
        build_schedule([_lin(0.1, 1.0, 3), _const(1.0, 5)], 1e-3)
    with pytest.raises(ValueError, match=r"policy.scheduler\[1\].kwargs"):
        build_schedule(
            [_lin(0.1, 1.0, 3), {"name": _TORCH + "ConstantLR", "kwargs": {"gamma": 2}}, {"milestones": [3]}], 1e-3
        )
    with pytest.raises(ValueError, match="start_factor"):
        build_schedule([_lin(0.0, 1.0, 3)], 1e-3)


# ================================================================ optimizer parity
def _make_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"emb": (16, 8), "w_up": (8, 12), "bias": (12,), "norm": (8,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _grads(params, n_steps, scale, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
        for _ in range(n_steps)
    ]


def _run_torch(opt_cfg, sched_cfg, max_grad_norm, params, grads_seq):
    names = sorted(params)
    tparams = {k: torch.nn.Parameter(torch.from_numpy(params[k].copy())) for k in names}
    opt = build_optimizer(opt_cfg, [tparams[k] for k in names])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = build_scheduler(sched_cfg, opt)
        lrs, norms = [], []
        for grads in grads_seq:  # one train() call = one optimizer step here
            for k in names:
                tparams[k].grad = torch.from_numpy(grads[k].copy())
            limit = max_grad_norm if max_grad_norm is not None else float("inf")
            norms.append(float(torch.nn.utils.clip_grad_norm_([tparams[k] for k in names], limit)))
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return {k: tparams[k].detach().numpy() for k in names}, lrs, norms


def _run_jax(opt_cfg, sched_cfg, max_grad_norm, params, grads_seq, shardings=None):
    tx, schedule_fn = build_optax(opt_cfg, sched_cfg, max_grad_norm)
    p = jax.tree.map(jnp.asarray, params)
    if shardings is not None:
        p = jax.device_put(p, shardings)
        state = init_optimizer_state(tx, p, shardings)
    else:
        state = tx.init(p)

    @jax.jit
    def step(p, state, g):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    lrs = []
    for train_step, grads in enumerate(grads_seq):
        state = set_learning_rate(state, schedule_fn(train_step))  # start of train()
        lrs.append(get_learning_rate(state))
        g = jax.tree.map(jnp.asarray, grads)
        if shardings is not None:
            g = jax.device_put(g, shardings)
        p, state = step(p, state, g)
    return p, state, lrs


WARMUP = [_lin(0.5, 1.0, 2), _const(1.0, 10**10), {"milestones": [2]}]

OPT_CASES = {
    "adamw_wd_clip": (
        {
            "name": "torch.optim.AdamW",
            "kwargs": {
                "lr": 1e-2,
                "weight_decay": 0.1,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "foreach": False,
                "fused": False,
            },
        },
        1.0,
    ),
    "adamw_no_clip": ({"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-3, "betas": [0.8, 0.95], "eps": 1e-6}}, None),
    "adamw_clip_inactive": ({"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.01}}, 1e6),
    "adamw_amsgrad": ({"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "amsgrad": True}}, 1.0),
    "adam_l2": ({"name": "torch.optim.Adam", "kwargs": {"lr": 1e-2, "weight_decay": 0.05}}, 2.0),
    "adam_decoupled": (
        {"name": "torch.optim.Adam", "kwargs": {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True}},
        2.0,
    ),
    "sgd_plain": ({"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}, None),
    "sgd_momentum_wd_clip": (
        {"name": "torch.optim.SGD", "kwargs": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}},
        1.0,
    ),
    "sgd_nesterov_maximize": (
        {"name": "torch.optim.SGD", "kwargs": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}},
        1.0,
    ),
}


@pytest.mark.parametrize("case", sorted(OPT_CASES))
def test_optimizer_matches_torch(case):
    opt_cfg, max_grad_norm = OPT_CASES[case]
    params = _make_params()
    grads_seq = _grads(params, 3, scale=2.0)  # global norm ~45: clipping at 1.0 / 2.0 is active
    ref, ref_lrs, norms = _run_torch(opt_cfg, WARMUP, max_grad_norm, params, grads_seq)
    if max_grad_norm is not None and max_grad_norm < 10:
        assert min(norms) > max_grad_norm  # the clip really scaled the gradients
    got, _, lrs = _run_jax(opt_cfg, WARMUP, max_grad_norm, params, grads_seq)
    np.testing.assert_allclose(lrs, ref_lrs, rtol=1e-7)
    for k in params:
        assert not np.allclose(ref[k], params[k])  # the parameters moved
        np.testing.assert_allclose(np.asarray(got[k]), ref[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_adamw_parity_sharded_with_state_shardings(mesh42):
    """Same parity on a 4x2 mesh; Adam moments carry the params' shardings, scalars replicated."""
    opt_cfg, max_grad_norm = OPT_CASES["adamw_wd_clip"]
    params = _make_params()
    axes = {"emb": ("vocab", "embed"), "w_up": ("embed", "mlp"), "bias": ("mlp",), "norm": ("norm",)}
    check_divisible(params, axes, mesh42)
    shardings = tree_shardings(axes, mesh42)
    grads_seq = _grads(params, 3, scale=2.0)
    ref, _, _ = _run_torch(opt_cfg, WARMUP, max_grad_norm, params, grads_seq)
    got, state, _ = _run_jax(opt_cfg, WARMUP, max_grad_norm, params, grads_seq, shardings=shardings)
    for k in params:
        assert got[k].sharding.is_equivalent_to(shardings[k], got[k].ndim)  # P(None,) ~ P()
        np.testing.assert_allclose(np.asarray(got[k]), ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    adam = [s for s in jax.tree.leaves(state.inner_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
    assert len(adam) == 1
    for k in params:
        assert adam[0].mu[k].sharding.is_equivalent_to(shardings[k], params[k].ndim)
        assert adam[0].nu[k].sharding.is_equivalent_to(shardings[k], params[k].ndim)
    assert adam[0].mu["emb"].sharding.spec == P("tp", "fsdp")
    assert adam[0].count.sharding.spec == P()
    assert state.hyperparams["learning_rate"].sharding.spec == P()


def test_optimizer_state_shardings_from_eval_shape(mesh42):
    tx, _ = build_optax({"name": "torch.optim.SGD", "kwargs": {"lr": 0.1, "momentum": 0.9}}, None, 1.0)
    params = {"a": jnp.zeros((8, 4)), "b": jnp.zeros((6,))}
    shardings = {"a": NamedSharding(mesh42, P("fsdp", "tp")), "b": NamedSharding(mesh42, P(None))}
    shapes = jax.eval_shape(tx.init, params)
    sh = optimizer_state_shardings(shapes, shardings)
    flat = jax.tree.leaves(sh)
    assert all(isinstance(s, NamedSharding) for s in flat)
    assert len(flat) == len(jax.tree.leaves(shapes))
    specs = sorted(str(s.spec) for s in flat)
    assert specs.count(str(P("fsdp", "tp"))) == 1  # the momentum buffer of "a"
    assert specs.count(str(P(None))) == 1  # the momentum buffer of "b"


def test_unsupported_optimizer_and_kwargs():
    with pytest.raises(ValueError, match="policy.optimizer.name"):
        build_optax({"name": "torch.optim.RMSprop", "kwargs": {"lr": 1e-3}}, None, 1.0)
    with pytest.raises(ValueError, match="policy.optimizer.kwargs.*'foo'"):
        build_optax({"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3, "foo": 1}}, None, 1.0)
    with pytest.raises(ValueError, match="nesterov"):
        build_optax({"name": "torch.optim.SGD", "kwargs": {"lr": 1e-3, "nesterov": True}}, None, None)
    with pytest.raises(ValueError, match="max_grad_norm"):
        build_optax({"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}}, None, 0.0)
    # torch-only kernel flags are accepted and ignored
    build_optax({"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3, "foreach": True, "fused": True}}, None, None)


def test_set_learning_rate_keeps_sharding_and_does_not_retrace(mesh42):
    tx, schedule_fn = build_optax({"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}}, [_lin(0.5, 1.0, 2)], None)
    shardings = {"w": NamedSharding(mesh42, P("fsdp", None))}
    params = jax.device_put({"w": jnp.ones((8, 2))}, shardings)
    state = init_optimizer_state(tx, params, shardings)
    traces = []

    @jax.jit
    def step(p, s):
        traces.append(1)
        u, s = tx.update({"w": jnp.ones_like(p["w"])}, s, p)
        return optax.apply_updates(p, u), s

    for n in range(3):
        state = set_learning_rate(state, schedule_fn(n))
        before = np.asarray(params["w"])
        params, state = step(params, state)
        np.testing.assert_allclose(before - np.asarray(params["w"]), schedule_fn(n), rtol=1e-6)
        assert state.hyperparams["learning_rate"].sharding.spec == P()
    assert len(traces) == 1
