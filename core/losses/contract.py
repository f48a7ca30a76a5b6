"""What a loss declares of the loss contract (``core.interfaces.LogprobLossFunction``), and the
defaults of what it does not: the one place the backends, the driver and the algorithms read it.

``core.losses``' losses declare all of it.  A user loss needs only ``loss_type`` and a
logits-level ``__call__`` (``core.interfaces.LossFunction``); what it leaves out defaults to:

=====================  =========================================================================
member                 default
=====================  =========================================================================
loss_from_logprobs     none: the loss runs on full logits only, where a backend holds them; a
                       layout that does not is refused by name on the driver (``Policy.train``)
old_logprobs           None: it reads no old-policy logprobs
uses_reference         False: the policy keeps no reference weights for it
input_keys             (): nothing checked on the driver beyond the model inputs
check_inputs           the ``input_keys`` must be in the batch
cache_key()            :func:`state_key`: the loss's class and the value of every attribute
=====================  =========================================================================
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import sys
import types
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard, get_args

from pydantic import BaseModel

from core.interfaces import LogprobLossFunction, LossFunction, LossType, OldLogprobsSource


class LossContractError(ValueError):
    """A loss's declaration is malformed, or the loss cannot run where it was sent; the message
    names the loss."""


def has_logprob_path(loss_fn: LossFunction) -> TypeGuard[LogprobLossFunction]:
    """Whether ``loss_fn`` computes its loss from the token logprobs (``loss_from_logprobs``).
    The guard covers that method only: read the rest through :class:`LossContract`."""
    return callable(getattr(loss_fn, "loss_from_logprobs", None))


@dataclass(frozen=True)
class LossContract:
    """The loss contract of one loss object, its declarations and the defaults filled in."""

    name: str  # the loss's class name, for messages
    loss_type: LossType
    from_logprobs: bool
    old_logprobs: OldLogprobsSource | None
    uses_reference: bool
    input_keys: tuple[str, ...]

    @classmethod
    def of(cls, loss_fn: LossFunction) -> LossContract:
        name = type(loss_fn).__name__
        old = getattr(loss_fn, "old_logprobs", None)
        if old is not None and old not in get_args(OldLogprobsSource):
            raise LossContractError(
                f"loss {name}: old_logprobs must be one of {get_args(OldLogprobsSource)} or None, got {old!r}"
            )
        keys = getattr(loss_fn, "input_keys", ())
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise LossContractError(f"loss {name}: input_keys must be a sequence of key names, got {keys!r}")
        return cls(
            name=name,
            loss_type=loss_fn.loss_type,
            from_logprobs=has_logprob_path(loss_fn),
            old_logprobs=old,
            uses_reference=bool(getattr(loss_fn, "uses_reference", False)),
            input_keys=tuple(keys),
        )

    def refuse_logits_only(self, refusal: str | None) -> None:
        """Raise ``LossContractError`` naming the loss when it has no logprob path and the
        backend's layout gives ``refusal`` (``PolicyWorker.logits_loss_refusal``)."""
        if refusal is not None and not self.from_logprobs:
            raise LossContractError(f"loss {self.name} has no loss_from_logprobs: {refusal}")


def check_loss_inputs(loss_fn: LossFunction, data: Mapping[str, Any], vocab_size: int | None) -> None:
    """The loss's own check of a host batch (``check_inputs``), or by default that every key it
    declares reading (``input_keys``) is present."""
    check = getattr(loss_fn, "check_inputs", None)
    if callable(check):
        check(data, vocab_size)
        return
    missing = [k for k in LossContract.of(loss_fn).input_keys if k not in data]
    if missing:
        raise LossContractError(
            f"loss {type(loss_fn).__name__}: data is missing key(s) {missing}; it has {sorted(data.keys())}"
        )


def loss_cache_key(loss_fn: LossFunction) -> Hashable:
    """The loss's ``cache_key()``, or by default :func:`state_key` of it."""
    declared = getattr(loss_fn, "cache_key", None)
    return declared() if callable(declared) else state_key(loss_fn)


def state_key(obj: Any) -> Hashable:
    """A key of ``obj``'s class and state, equal for two objects exactly when they hold the same
    values: scalars and enums as they are, configs (pydantic) by their fields, containers and
    plain objects element by element, arrays (torch, numpy, jax) by dtype, shape and bytes, and
    anything else (a callable, an object with its own pickling) by the digest of its pickled
    bytes -- the bytes a worker's copy is rebuilt from.  Two losses that differ in any setting,
    a tensor or a callable included, never get one key; copies of one loss get the same key
    unless a part of it pickles differently each time (a torch tensor inside such an opaque
    object does), which costs a recompile, never a wrong result."""
    return _frozen(obj, set())


_SCALARS = (bool, int, complex, str, bytes, type(None), enum.Enum)


def _frozen(value: Any, seen: set[int]) -> Hashable:
    if isinstance(value, float):  # by its bits: NaN equals NaN, -0.0 is not 0.0
        return ("float", value.hex())
    if isinstance(value, _SCALARS):
        return (type(value).__qualname__, value)
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if _is_array(value):
        return _array_key(value)
    if id(value) in seen:  # a reference cycle: its state is already in the key above
        return ("cycle", type(value).__qualname__)
    seen = seen | {id(value)}
    if isinstance(value, BaseModel):
        return ("config", _qualified(value), _frozen(value.model_dump(mode="python"), seen))
    if isinstance(value, Mapping):
        items = sorted(((repr(k), _frozen(k, seen), _frozen(v, seen)) for k, v in value.items()), key=lambda i: i[0])
        return ("mapping", type(value).__qualname__, tuple((k, v) for _, k, v in items))
    if isinstance(value, (list, tuple)):
        return ("sequence", type(value).__qualname__, tuple(_frozen(v, seen) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((_frozen(v, seen) for v in value), key=repr)))
    if _plain_state(value):
        return ("object", _qualified(value), _frozen(vars(value), seen))
    return ("pickled", _qualified(value), _pickled_digest(value))


def _qualified(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain_state(value: Any) -> bool:
    """An object whose state is its ``__dict__`` (no custom pickling, no slots; not a function,
    whose code is its behaviour, nor a module)."""
    cls = type(value)
    return (
        hasattr(value, "__dict__")
        and not inspect.isroutine(value)
        and not isinstance(value, types.ModuleType)
        and cls.__reduce_ex__ is object.__reduce_ex__
        and cls.__reduce__ is object.__reduce__
        and getattr(cls, "__getstate__", object.__getstate__) is object.__getstate__
        and not hasattr(cls, "__slots__")
    )


def _is_array(value: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    return hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape")


def _array_key(value: Any) -> Hashable:
    import numpy as np

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        dtype, shape = str(value.dtype), tuple(value.shape)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    else:
        array = np.asarray(value)
        dtype, shape, raw = str(array.dtype), tuple(array.shape), np.ascontiguousarray(array).tobytes()
    return ("array", type(value).__qualname__, dtype, shape, hashlib.sha256(raw).hexdigest())


def _pickled_digest(value: Any) -> str:
    import cloudpickle  # Ray's serialiser: the same bytes a worker's copy is rebuilt from

    return hashlib.sha256(cloudpickle.dumps(value)).hexdigest()


class DeclaredLoss:
    """Base of ``core.losses``' losses: the contract members every one of them declares alike.

    A subclass sets ``check`` (a ``core.losses.checks.LossInputChecker``: its keys are the
    loss's ``input_keys``) and ``loss_type``, and overrides ``old_logprobs`` /
    ``uses_reference`` where it reads them."""

    check: Any  # LossInputChecker (core.losses.checks imports nothing from here)
    loss_type: LossType
    old_logprobs: OldLogprobsSource | None = None

    @property
    def uses_reference(self) -> bool:
        return False

    @property
    def input_keys(self) -> tuple[str, ...]:
        return self.check.required_keys()

    def check_inputs(self, data: Mapping[str, Any], vocab_size: int | None) -> None:
        self.check.check_shapes(None, data)
        self.check.check_values(data, vocab_size)

    def cache_key(self) -> Hashable:
        """By value (:func:`state_key`): every setting, the config's fields included."""
        return state_key(self)
