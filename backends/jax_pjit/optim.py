"""The policy config's torch optimizer / scheduler, reproduced with optax.

``policy.optimizer`` names a *torch* optimizer (``{name: "torch.optim.AdamW", kwargs}``) and
``policy.scheduler`` a list of torch LR schedulers (plus a ``{milestones: [...]}`` entry
meaning ``SequentialLR``); :func:`build_optax` gives the optax transformation that performs
the same update as torch (fp32 results equal to ~1e-6) and the torch learning-rate sequence
as a function.

Update, in torch's order:

1. ``max_grad_norm`` clipping exactly like ``torch.nn.utils.clip_grad_norm_``: the global L2
   norm over all gradients, every gradient times ``min(1, max_norm / (norm + 1e-6))``
   (optax's own ``clip_by_global_norm`` has no ``1e-6`` and only scales above the limit).
2. ``maximize=True``: the gradient is negated (torch does it inside the optimizer).
3. The optimizer:

   * ``torch.optim.AdamW`` -- decoupled decay ``p <- p - lr * wd * p`` plus the Adam step
     ``lr * m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1 - b1^t)``,
     ``v_hat = v / (1 - b2^t)`` (eps *outside* the square root, as in torch; torch writes it
     ``sqrt(v) / sqrt(1 - b2^t) + eps``, the same number).  Both terms use the parameter
     before the step, as torch does.  ``amsgrad`` keeps the running max of ``v`` as torch.
   * ``torch.optim.Adam`` -- L2 decay added to the gradient (``g + wd * p``) before the
     moments; ``decoupled_weight_decay=True`` makes it AdamW.
   * ``torch.optim.SGD`` -- ``g + wd * p``; momentum buffer ``b = g`` at the first step, then
     ``b = momentum * b + (1 - dampening) * g``; ``nesterov`` uses ``g + momentum * b``.

   ``foreach``, ``fused``, ``capturable``, ``differentiable`` only choose torch kernels: they
   are accepted and ignored.  Any other kwarg is a ``ValueError`` naming it.

Learning-rate schedule -- how the worker drives it
--------------------------------------------------
The torch workers step their scheduler **once per non-eval ``train()`` call** (however many
global batches / optimizer steps the call holds).  So the schedule here is a plain host
function ``schedule_fn(n) -> float``: the learning rate after ``n`` scheduler steps, i.e.
the one the ``(n+1)``-th ``train()`` call uses.  The transformation is wrapped in
``optax.inject_hyperparams``: the learning rate is an array in the optimizer state
(``opt_state.hyperparams["learning_rate"]``), read by the jitted update, initialised to
``schedule_fn(0)``.  The worker keeps its own counter ``train_step`` (checkpointed, like the
torch scheduler state) and does::

    # at the start of every non-eval train() call
    opt_state = set_learning_rate(opt_state, schedule_fn(train_step))
    ... one tx.update per global batch ...
    train_step += 1                      # after the call, like scheduler.step()
    result["lr"] = schedule_fn(train_step)  # torch reports the lr *after* stepping

Nothing in the jitted step changes when the lr changes (it is data, not a constant).

Sharding: :func:`optimizer_state_shardings` gives every optimizer-state leaf that mirrors a
parameter (``mu``, ``nu``, momentum) that parameter's sharding and replicates the rest
(step counts, the learning rate); :func:`init_optimizer_state` builds the state with them.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from core.policy.config import OptimizerConfig, SchedulerEntry, scheduler_chain

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "build_optax",
    "build_schedule",
    "clip_by_global_norm_torch",
    "global_grad_norm",
    "scale_by_torch_adam",
    "torch_sgd_momentum",
    "set_learning_rate",
    "get_learning_rate",
    "optimizer_state_shardings",
    "init_optimizer_state",
]

_ADAM = "torch.optim.Adam"
_ADAMW = "torch.optim.AdamW"
_SGD = "torch.optim.SGD"
SUPPORTED_OPTIMIZERS = (_ADAMW, _ADAM, _SGD)

_LINEAR = "torch.optim.lr_scheduler.LinearLR"
_CONSTANT = "torch.optim.lr_scheduler.ConstantLR"
SUPPORTED_SCHEDULERS = (_LINEAR, _CONSTANT)

#: torch kernel-selection flags: no effect on the math, ignored here.
_TORCH_ONLY_FLAGS = ("foreach", "fused", "capturable", "differentiable")

# torch defaults (torch 2.x signatures), per optimizer.
_DEFAULTS: dict[str, dict[str, Any]] = {
    _ADAMW: dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False),
    _ADAM: dict(
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        maximize=False,
        decoupled_weight_decay=False,
    ),
    _SGD: dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
}


# ------------------------------------------------------------------------------ clipping
def global_grad_norm(grads: Any) -> jax.Array:
    """The L2 norm over all leaves of ``grads``, accumulated in fp32 (torch's total norm)."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))


def clip_by_global_norm_torch(max_norm: float) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``: scale every gradient by
    ``min(1, max_norm / (total_norm + 1e-6))``."""

    def update_fn(updates, state, params=None):
        del params
        coef = jnp.minimum(max_norm / (global_grad_norm(updates) + 1e-6), 1.0)
        return jax.tree.map(lambda g: (g * coef).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ----------------------------------------------------------------------------- optimizers
class ScaleByTorchAdamState(NamedTuple):
    # ``count`` shadows tuple.count (as in optax's own states); it names the field in saved
    # optimizer states, so it stays.
    count: jax.Array  # type: ignore[assignment]
    mu: Any
    nu: Any
    nu_max: Any  # running max of nu (amsgrad); an empty tuple without amsgrad


def scale_by_torch_adam(b1: float, b2: float, eps: float, amsgrad: bool = False) -> optax.GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` with torch's bias correction and
    ``amsgrad`` (max over the raw second moments, then bias-corrected with the current step)."""

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return ScaleByTorchAdamState(
            count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros(), nu_max=zeros() if amsgrad else ()
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mu = jax.tree.map(lambda g, m: b1 * m + (1.0 - b1) * g, updates, state.mu)
        nu = jax.tree.map(lambda g, v: b2 * v + (1.0 - b2) * (g * g), updates, state.nu)
        nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu) if amsgrad else ()
        t = count.astype(jnp.float32)
        bc1 = _one_minus_pow(b1, t)
        bc2_sqrt = jnp.sqrt(_one_minus_pow(b2, t))
        second = nu_max if amsgrad else nu
        out = jax.tree.map(
            lambda g, m, v: ((m / bc1) / (jnp.sqrt(v) / bc2_sqrt + eps)).astype(g.dtype), updates, mu, second
        )
        return out, ScaleByTorchAdamState(count=count, mu=mu, nu=nu, nu_max=nu_max)

    return optax.GradientTransformation(init_fn, update_fn)


def _one_minus_pow(b: float, t: jax.Array) -> jax.Array:
    """``1 - b**t`` accurate in fp32: torch computes the bias corrections in float64, and
    the naive fp32 ``1 - 0.999**1`` is off by 1.3e-5 relative (0.999 is not exact in fp32),
    so it is computed as ``-expm1(t * log(b))`` with ``log(b)`` taken in float64."""
    log_b = math.log(b) if b > 0 else -math.inf
    return -jnp.expm1(t * jnp.float32(log_b))


class TorchSGDMomentumState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as above
    buf: Any


def torch_sgd_momentum(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> optax.GradientTransformation:
    """torch SGD's momentum buffer: ``b = g`` on the first step (no dampening), then
    ``b = momentum * b + (1 - dampening) * g``; the direction is ``b`` or, with nesterov,
    ``g + momentum * b``."""

    def init_fn(params):
        return TorchSGDMomentumState(count=jnp.zeros([], jnp.int32), buf=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        buf = jax.tree.map(
            lambda g, b: jnp.where(first, g, momentum * b + (1.0 - dampening) * g).astype(b.dtype), updates, state.buf
        )
        out = jax.tree.map(lambda g, b: g + momentum * b, updates, buf) if nesterov else buf
        return out, TorchSGDMomentumState(count=optax.safe_increment(state.count), buf=buf)

    return optax.GradientTransformation(init_fn, update_fn)


def _optimizer_kwargs(optimizer_cfg: OptimizerConfig) -> tuple[str, dict[str, Any]]:
    name = optimizer_cfg.name
    if name not in _DEFAULTS:
        raise ValueError(
            f"policy.optimizer.name: {name!r} is not supported by the jax_pjit backend; "
            f"choose one of {list(SUPPORTED_OPTIMIZERS)}"
        )
    given = dict(optimizer_cfg.kwargs)
    for flag in _TORCH_ONLY_FLAGS:
        given.pop(flag, None)
    unknown = sorted(set(given) - set(_DEFAULTS[name]))
    if unknown:
        raise ValueError(
            f"policy.optimizer.kwargs: {unknown} not supported for {name} by the jax_pjit backend "
            f"(supported: {sorted(_DEFAULTS[name])} and the ignored torch-only flags {list(_TORCH_ONLY_FLAGS)})"
        )
    kw = {**_DEFAULTS[name], **given}
    for key in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        if key in kw:
            value = kw[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"policy.optimizer.kwargs.{key} must be a number, got {value!r}")
            if value < 0:
                raise ValueError(f"policy.optimizer.kwargs.{key} must be >= 0, got {value!r}")
            kw[key] = float(value)
    if "betas" in kw:
        betas = tuple(kw["betas"])
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"policy.optimizer.kwargs.betas must be two numbers in [0, 1), got {kw['betas']!r}")
        kw["betas"] = tuple(float(b) for b in betas)
    if name == _SGD and kw["nesterov"] and (kw["momentum"] <= 0 or kw["dampening"] != 0):
        raise ValueError("policy.optimizer.kwargs.nesterov requires momentum > 0 and dampening = 0 (as torch)")
    return name, kw


def _optimizer_chain(name: str, kw: Mapping[str, Any], learning_rate: Any, max_grad_norm: float | None):
    parts: list[optax.GradientTransformation] = []
    if max_grad_norm is not None:
        parts.append(clip_by_global_norm_torch(float(max_grad_norm)))
    if kw["maximize"]:
        parts.append(optax.scale(-1.0))
    wd = kw["weight_decay"]
    if name in (_ADAM, _ADAMW):
        decoupled = name == _ADAMW or kw.get("decoupled_weight_decay", False)
        b1, b2 = kw["betas"]
        if wd and not decoupled:
            parts.append(optax.add_decayed_weights(wd))  # L2: g + wd * p
        parts.append(scale_by_torch_adam(b1, b2, kw["eps"], kw["amsgrad"]))
        if wd and decoupled:
            parts.append(optax.add_decayed_weights(wd))  # lr * (adam + wd * p)
    else:  # SGD
        if wd:
            parts.append(optax.add_decayed_weights(wd))
        if kw["momentum"]:
            parts.append(torch_sgd_momentum(kw["momentum"], kw["dampening"], kw["nesterov"]))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


# ----------------------------------------------------------------------------- schedules
def _number(entry_path: str, kwargs: Mapping[str, Any], key: str, default: float) -> float:
    value = kwargs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{entry_path}.kwargs.{key} must be a number, got {value!r}")
    return value


def _factor_fn(i: int, entry: SchedulerEntry) -> Callable[[int], float]:
    """``local_step -> lr / base_lr`` of one scheduler entry (torch's closed forms)."""
    where = f"policy.scheduler[{i}]"
    name = entry.name
    kwargs = dict(entry.kwargs)
    if name == _LINEAR:
        allowed = {"start_factor", "end_factor", "total_iters"}
    elif name == _CONSTANT:
        allowed = {"factor", "total_iters"}
    else:
        raise ValueError(
            f"{where}.name: {name!r} is not supported by the jax_pjit backend; "
            f"choose among {list(SUPPORTED_SCHEDULERS)} (and a {{milestones: [...]}} entry)"
        )
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"{where}.kwargs: {unknown} not supported for {name} (supported: {sorted(allowed)})")
    total = kwargs.get("total_iters", 5)
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        # total_iters=0 is ill-defined in torch (LinearLR's closed form divides by it;
        # ConstantLR's value would depend on its position in a SequentialLR).
        raise ValueError(f"{where}.kwargs.total_iters must be an integer >= 1, got {total!r}")
    if name == _LINEAR:
        start = _number(where, kwargs, "start_factor", 1.0 / 3)
        end = _number(where, kwargs, "end_factor", 1.0)
        if not 0.0 < start <= 1.0:
            raise ValueError(f"{where}.kwargs.start_factor must be in (0, 1], got {start!r}")
        if not 0.0 <= end <= 1.0:
            raise ValueError(f"{where}.kwargs.end_factor must be in [0, 1], got {end!r}")
        return lambda t: start + (end - start) * min(total, t) / total
    factor = _number(where, kwargs, "factor", 1.0 / 3)
    if not 0.0 < factor <= 1.0:
        # torch's recursive ConstantLR divides by factor when total_iters is reached.
        raise ValueError(f"{where}.kwargs.factor must be in (0, 1], got {factor!r}")
    return lambda t: factor + (t >= total) * (1.0 - factor)


def build_schedule(
    scheduler_cfg: Sequence[SchedulerEntry | Mapping[str, Any]] | None, base_lr: float
) -> Callable[[int], float]:
    """``n -> lr`` after ``n`` steps of the torch scheduler ``policy.scheduler`` describes.

    * ``None`` / ``[]``: constant ``base_lr`` (the torch backends' ``LambdaLR(lambda _: 1.0)``).
    * one scheduler: its closed form (a ``milestones`` entry is then ignored, as in
      ``backends.torch_common.optim.build_scheduler``).
    * several + ``{milestones: [m_1, ...]}``: ``SequentialLR``.  At step ``n`` scheduler
      ``k = #{m_j <= n}`` runs at local step ``n - m_k`` (``m_0 = 0``): torch restarts the
      next scheduler with ``step(0)`` at its milestone (its closed form at 0), so e.g. a
      ``ConstantLR(factor=0.5)`` after a warm-up starts again at ``0.5 * base_lr``.

    torch computes LinearLR/ConstantLR recursively (``lr *= ratio``); the closed forms used
    here equal those sequences up to float64 rounding (~1e-16 relative).
    """
    base_lr = float(base_lr)
    entries = list(scheduler_cfg or [])
    if not entries:
        return lambda n: base_lr
    chain, milestones = scheduler_chain(entries)
    factors = [_factor_fn(i, entry) for i, entry in chain]
    if len(factors) == 1:
        only = factors[0]
        return lambda n: base_lr * only(_check_step(n))
    starts = [0, *milestones]

    def schedule(n: int) -> float:
        n = _check_step(n)
        k = bisect_right(milestones, n)
        return base_lr * factors[k](n - starts[k])

    return schedule


def _check_step(n: Any) -> int:
    n = int(n)
    if n < 0:
        raise ValueError(f"schedule step must be >= 0, got {n}")
    return n


# ------------------------------------------------------------------------------- public
def build_optax(
    optimizer_cfg: OptimizerConfig | Mapping[str, Any],
    scheduler_cfg: Sequence[SchedulerEntry | Mapping[str, Any]] | None,
    max_grad_norm: float | None,
) -> tuple[optax.GradientTransformationExtraArgs, Callable[[int], float]]:
    """``(tx, schedule_fn)`` for ``policy.optimizer``, ``policy.scheduler``, ``policy.max_grad_norm``.

    ``tx`` is wrapped in ``optax.inject_hyperparams``: its state carries the learning rate
    (``hyperparams["learning_rate"]``, fp32, initialised to ``schedule_fn(0)``), which the
    worker sets once per ``train()`` call with :func:`set_learning_rate` -- see the module
    docstring.  ``schedule_fn(n)`` is the torch learning rate after ``n`` scheduler steps.
    """
    name, kw = _optimizer_kwargs(OptimizerConfig.coerce(optimizer_cfg, "policy.optimizer"))
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
            raise ValueError(f"policy.max_grad_norm must be > 0 (or null for no clipping), got {max_grad_norm!r}")
        if math.isinf(max_grad_norm):
            max_grad_norm = None
    schedule_fn = build_schedule(scheduler_cfg, kw["lr"])

    def factory(learning_rate):
        return _optimizer_chain(name, kw, learning_rate, max_grad_norm)

    tx = optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(learning_rate=schedule_fn(0))
    return tx, schedule_fn


def set_learning_rate(opt_state: Any, lr: float) -> Any:
    """A copy of ``opt_state`` (from :func:`build_optax`'s ``tx``) using learning rate ``lr``;
    the new value keeps the sharding of the old one."""
    if not hasattr(opt_state, "hyperparams") or "learning_rate" not in opt_state.hyperparams:
        raise TypeError("set_learning_rate: expected the state of build_optax's transformation")
    old = opt_state.hyperparams["learning_rate"]
    new = jnp.asarray(lr, dtype=getattr(old, "dtype", jnp.float32))
    sharding = getattr(old, "sharding", None)
    if sharding is not None:
        new = jax.device_put(new, sharding)
    return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": new})


def get_learning_rate(opt_state: Any) -> float:
    """The learning rate the next ``tx.update`` will use."""
    return float(opt_state.hyperparams["learning_rate"])


# ------------------------------------------------------------------------------ sharding
def optimizer_state_shardings(opt_state_shapes: Any, param_shardings: Any, mesh: Any = None) -> Any:
    """Shardings for an optimizer state: each sub-tree with the parameters' tree structure
    (Adam's ``mu``/``nu``, SGD's momentum) gets the parameters' shardings leaf by leaf;
    every other leaf (step counts, the injected learning rate) is replicated.

    ``opt_state_shapes`` is typically ``jax.eval_shape(tx.init, params)``.  A mirrored leaf
    whose rank does not match its parameter's spec (a factored statistic) is replicated.
    ``mesh`` defaults to the mesh of the first parameter sharding.
    """
    sharding_leaves, param_def = jax.tree.flatten(
        param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    if mesh is None:
        if not sharding_leaves:
            raise ValueError("optimizer_state_shardings: no parameter shardings to take the mesh from")
        mesh = sharding_leaves[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    # jaxlib ships no type stub for PyTreeDef (jax's alias of it does not resolve), hence the
    # ignores on its methods and its ``==``.  len(sharding_leaves) is param_def.num_leaves.
    single_leaf = len(sharding_leaves) == 1 and param_def == jax.tree.structure(0)  # type: ignore[operator]

    def mirrors_params(node: Any) -> bool:
        if single_leaf:
            return False  # a single-array "tree" would match every leaf: handled per leaf below
        try:
            return jax.tree.structure(node) == param_def  # type: ignore[operator]
        except Exception:  # noqa: BLE001
            return False

    def assign(node: Any) -> Any:
        if mirrors_params(node):
            leaves = param_def.flatten_up_to(node)  # type: ignore[attr-defined]
            out = [sh if _fits(leaf, sh) else replicated for leaf, sh in zip(leaves, sharding_leaves, strict=True)]
            return jax.tree.unflatten(param_def, out)
        if single_leaf:
            sh = sharding_leaves[0]
            return sh if _fits(node, sh) and getattr(node, "ndim", 0) > 0 else replicated
        return replicated

    return jax.tree.map(assign, opt_state_shapes, is_leaf=mirrors_params)


def _fits(leaf: Any, sharding: Any) -> bool:
    shape = getattr(leaf, "shape", None)
    if shape is None or not isinstance(sharding, NamedSharding):
        return shape is not None
    spec = tuple(sharding.spec)
    if len(spec) > len(shape):
        return False
    for size, axes in zip(shape, spec, strict=True):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if size % math.prod(sharding.mesh.shape[a] for a in axes) != 0:
            return False
    return True


def init_optimizer_state(tx: optax.GradientTransformation, params: Any, param_shardings: Any) -> Any:
    """``tx.init(params)`` laid out with :func:`optimizer_state_shardings` (one jitted init)."""
    shapes = jax.eval_shape(tx.init, params)
    shardings = optimizer_state_shardings(shapes, param_shardings)
    return jax.jit(tx.init, out_shardings=shardings)(params)
