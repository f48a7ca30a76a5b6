"""One generic validator for the ``TypedDict`` schemas plus the semantic checks.

:func:`validate_typed` walks a plain ``dict`` against a ``TypedDict`` (or any annotation
built from ``Literal``, ``Optional``/``X | None``, ``Union``, ``list[...]``,
``dict[str, ...]``, nested ``TypedDict``s, ``Any`` and the scalars) and returns a list of
error strings.  Each string starts with the dotted path of the field (``policy.
dtensor_cfg.tensor_parallel_size``, ``policy.scheduler[2].milestones``) and says what is
wrong.  The ``validate_*_config`` functions add the checks a type cannot express
(divisibility, positivity, cross-field rules) and raise a single :class:`ConfigError`
that lists every problem, one per line, so a YAML file can be fixed in one go.

Type rules: ``bool`` is not an ``int`` (``True`` is rejected where an int is expected);
an ``int`` is accepted where a ``float`` is expected; ``None`` is accepted only where the
annotation allows it.

Only the standard library is imported here (and :mod:`core.parallel_dims`, itself pure
Python), so loss functions can call :func:`validate_loss_config` in their constructors.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from core.config.schema import (
    BACKENDS,
    ClippedPGLossConfig,
    ClusterConfig,
    DPOLossConfig,
    MasterConfig,
    PolicyConfig,
)
from core.parallel_dims import ParallelDims

__all__ = [
    "ConfigError",
    "validate_typed",
    "check_section",
    "validate_policy_config",
    "validate_loss_config",
    "validate_master_config",
]

_Handler = Callable[[Any, str], "list[str]"]


class ConfigError(ValueError):
    """An invalid configuration.  ``errors`` holds one message per problem; ``str()`` of
    the exception is those messages, one per line (each starting with a dotted path)."""

    def __init__(self, errors: str | Sequence[str]):
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


# =============================================================================
# the generic walker
# =============================================================================
def validate_typed(
    value: Any,
    schema: Any,
    path: str = "",
    *,
    handlers: Mapping[Any, _Handler] | None = None,
) -> list[str]:
    """Errors of ``value`` against the annotation ``schema``; empty when it conforms.

    ``path`` is the dotted name of ``value`` used as prefix of every message ("" for the
    root).  ``handlers`` maps a schema (e.g. a ``TypedDict`` class) to a function
    ``(value, path) -> list[str]`` used instead of the generic walk wherever that schema
    occurs -- this is how the ``validate_*`` functions hook their semantic checks in.
    """
    errors: list[str] = []
    _walk(value, schema, path, errors, handlers or {})
    return errors


def check_section(value: Any, schema: Any, path: str = "") -> Any:
    """:func:`validate_typed`, raising :class:`ConfigError` on any error; returns ``value``."""
    errors = validate_typed(value, schema, path)
    if errors:
        raise ConfigError(errors)
    return value


def _walk(value: Any, tp: Any, path: str, errors: list[str], handlers: Mapping[Any, _Handler]) -> None:
    tp = _strip(tp)
    if handlers and _hashable(tp) and tp in handlers:
        errors.extend(handlers[tp](value, path))
        return
    if tp is Any or tp is object:
        return
    if tp is None or tp is type(None):
        if value is not None:
            errors.append(f"{_label(path)}: expected None, got {_got(value)}")
        return
    if _is_typeddict(tp):
        _walk_typeddict(value, tp, path, errors, handlers)
        return
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if not any(_literal_eq(value, c) for c in choices):
            errors.append(f"{_label(path)}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
        return
    if origin is Union or origin is types.UnionType:
        _walk_union(value, tp, path, errors, handlers)
        return
    if origin in (list, tuple, Sequence, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{_label(path)}: expected {_describe(tp)}, got {_got(value)}")
            return
        args = get_args(tp)
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                errors.append(f"{_label(path)}: expected {len(args)} items, got {len(value)} ({_short(value)})")
                return
            for i, (item, item_tp) in enumerate(zip(value, args, strict=True)):
                _walk(item, item_tp, f"{path}[{i}]", errors, handlers)
            return
        item_tp = args[0] if args else Any
        for i, item in enumerate(value):
            _walk(item, item_tp, f"{path}[{i}]", errors, handlers)
        return
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            errors.append(f"{_label(path)}: expected {_describe(tp)}, got {_got(value)}")
            return
        key_tp, val_tp = get_args(tp) or (Any, Any)
        for k, v in value.items():
            kerr = validate_typed(k, key_tp, path)
            if kerr:
                errors.append(f"{_label(path)}: key {k!r} is not a {_describe(key_tp)}")
                continue
            _walk(v, val_tp, _join(path, k), errors, handlers)
        return
    if isinstance(tp, type):
        if not _scalar_ok(value, tp):
            errors.append(f"{_label(path)}: expected {_describe(tp)}, got {_got(value)}")
        return
    raise TypeError(f"validate_typed: unsupported annotation {tp!r} at {_label(path)}")


def _walk_typeddict(value: Any, td: type, path: str, errors: list[str], handlers) -> None:
    if not isinstance(value, Mapping):
        errors.append(f"{_label(path)}: expected a mapping ({td.__name__}), got {_got(value)}")
        return
    hints = _hints(td)
    for key in value:
        if key in hints:
            continue
        if not isinstance(key, str):
            errors.append(f"{_label(path)}: keys must be strings, got {key!r}")
            continue
        close = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.6)
        if close:
            hint = f"did you mean '{close[0]}'?"
        else:
            hint = "known keys: " + ", ".join(hints)
        errors.append(f"{_join(path, key)}: unknown key ({hint})")
    required = td.__required_keys__
    for key, ann in hints.items():
        if key in value:
            _walk(value[key], ann, _join(path, key), errors, handlers)
        elif key in required:
            errors.append(f"{_join(path, key)}: missing required key")


def _walk_union(value: Any, tp: Any, path: str, errors: list[str], handlers) -> None:
    members = [_strip(m) for m in get_args(tp)]
    if any(not validate_typed(value, m, path) for m in members):
        return
    # Nothing matched: explain against the member whose shape fits the value best, so a
    # list gets item-level messages and a mapping gets key-level ones.
    fits = [m for m in members if _kind_fits(value, m)]
    if len(fits) > 1 and isinstance(value, Mapping):
        tds = [m for m in fits if _is_typeddict(m)]
        if tds:
            fits = [max(tds, key=lambda m: len(set(value) & set(_hints(m))))]
    if len(fits) == 1:
        _walk(value, fits[0], path, errors, handlers)
        return
    errors.append(f"{_label(path)}: expected {_describe(tp)}, got {_got(value)}")


# ----------------------------------------------------------------------------- helpers
def _strip(tp: Any) -> Any:
    """Remove ``Required``/``NotRequired``/``Annotated`` wrappers."""
    while True:
        origin = get_origin(tp)
        name = getattr(origin, "_name", None) or getattr(origin, "__name__", None)
        if origin is typing.Annotated or name in ("Required", "NotRequired", "ReadOnly"):
            tp = get_args(tp)[0]
            continue
        return tp


def _is_typeddict(tp: Any) -> bool:
    return (
        isinstance(tp, type)
        and issubclass(tp, dict)
        and hasattr(tp, "__required_keys__")
        and hasattr(tp, "__annotations__")
    )


@functools.cache
def _hints(td: type) -> dict[str, Any]:
    return typing.get_type_hints(td, include_extras=True)


def _hashable(tp: Any) -> bool:
    try:
        hash(tp)
    except TypeError:
        return False
    return True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalar_ok(value: Any, tp: type) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return _is_int(value)
    if tp is float:
        return _is_num(value)
    return isinstance(value, tp)


def _literal_eq(value: Any, choice: Any) -> bool:
    return type(value) is type(choice) and value == choice


def _kind_fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` has the right *shape* for ``tp`` (ignoring its contents)."""
    tp = _strip(tp)
    if tp is Any or tp is object:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = get_origin(tp)
    if _is_typeddict(tp) or origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        return isinstance(value, Mapping)
    if origin in (list, tuple, Sequence, typing.Sequence) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is Literal:
        return any(type(value) is type(c) for c in get_args(tp))
    if origin is Union or origin is types.UnionType:
        return any(_kind_fits(value, m) for m in get_args(tp))
    if isinstance(tp, type):
        return _scalar_ok(value, tp)
    return False


def _describe(tp: Any) -> str:
    tp = _strip(tp)
    if tp is Any or tp is object:
        return "anything"
    if tp is None or tp is type(None):
        return "None"
    if _is_typeddict(tp):
        return f"a mapping ({tp.__name__})"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    if origin is Union or origin is types.UnionType:
        return " or ".join(_describe(m) for m in get_args(tp))
    if origin in (list, tuple, Sequence, typing.Sequence) or tp in (list, tuple):
        args = get_args(tp)
        return f"a list of {_describe(args[0])}" if args and args[0] is not Any else "a list"
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        return "a mapping"
    if isinstance(tp, type):
        return tp.__name__
    return repr(tp)


def _short(value: Any, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _got(value: Any) -> str:
    if value is None:
        return "None"
    return f"{type(value).__name__} ({_short(value)})"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _label(path: str) -> str:
    return path or "<config>"


# =============================================================================
# semantic checks
# =============================================================================
class _Checker:
    """Collects semantic errors for one section; every accessor ignores values of the
    wrong type (the type walk has already reported those)."""

    def __init__(self, cfg: Any, path: str):
        self.cfg = cfg if isinstance(cfg, Mapping) else {}
        self.path = path
        self.errors: list[str] = []

    def p(self, *keys: str) -> str:
        out = self.path
        for k in keys:
            out = _join(out, k)
        return out

    def sub(self, key: str) -> Mapping[str, Any]:
        v = self.cfg.get(key)
        return v if isinstance(v, Mapping) else {}

    @staticmethod
    def int_of(d: Mapping[str, Any], key: str) -> int | None:
        v = d.get(key)
        return v if _is_int(v) else None

    @staticmethod
    def num_of(d: Mapping[str, Any], key: str) -> float | None:
        v = d.get(key)
        return v if _is_num(v) else None

    def err(self, path: str, msg: str) -> None:
        self.errors.append(f"{path}: {msg}")

    def positive(self, d: Mapping[str, Any], key: str, *prefix: str) -> None:
        v = self.num_of(d, key)
        if v is not None and v <= 0:
            self.err(self.p(*prefix, key), f"must be > 0, got {v!r}")

    def non_negative(self, d: Mapping[str, Any], key: str, *prefix: str) -> None:
        v = self.num_of(d, key)
        if v is not None and v < 0:
            self.err(self.p(*prefix, key), f"must be >= 0, got {v!r}")


# ----------------------------------------------------------------------------- policy
def _policy_errors(cfg: Any, world_size: int | None, path: str) -> list[str]:
    errors: list[str] = []
    walk_cfg = cfg
    backend = cfg.get("backend") if isinstance(cfg, Mapping) else None
    if isinstance(backend, str) and backend not in BACKENDS:
        errors.append(
            f"{_join(path, 'backend')}: unknown backend {backend!r}; choose one of "
            + ", ".join(repr(b) for b in BACKENDS)
        )
        walk_cfg = {**cfg, "backend": BACKENDS[0]}  # reported above; don't report it twice
    errors.extend(validate_typed(walk_cfg, PolicyConfig, path))
    if isinstance(cfg, Mapping):
        errors.extend(_policy_semantics(cfg, world_size, path))
    return errors


def _policy_semantics(cfg: Mapping[str, Any], world_size: int | None, path: str) -> list[str]:
    c = _Checker(cfg, path)
    for key in (
        "train_global_batch_size",
        "train_micro_batch_size",
        "logprob_batch_size",
        "generation_batch_size",
        "max_total_sequence_length",
        "make_sequence_length_divisible_by",
        "make_vocab_size_divisible_by",
        "refit_buffer_size_gb",
    ):
        c.positive(cfg, key)
    vocab_multiple = c.int_of(cfg, "make_vocab_size_divisible_by")
    if cfg.get("backend") == "torch_fsdp" and vocab_multiple is not None and vocab_multiple > 1:
        c.err(
            c.p("make_vocab_size_divisible_by"),
            f"{vocab_multiple}: the torch_fsdp (FSDP1) backend has no tensor parallelism and does not "
            "pad the vocabulary; set it to 1 (torch_dtensor and jax_pjit pad)",
        )
    mgn = c.num_of(cfg, "max_grad_norm")
    if mgn is not None and mgn <= 0:
        c.err(c.p("max_grad_norm"), f"must be > 0 (or null for no clipping), got {mgn!r}")

    # ---- parallel layout -> data-parallel size
    dp = _check_parallel(c, cfg, world_size)

    # ---- batch divisibility
    gbs, mbs = c.int_of(cfg, "train_global_batch_size"), c.int_of(cfg, "train_micro_batch_size")
    if gbs is not None and mbs is not None and gbs > 0 and mbs > 0:
        if dp is not None:
            if gbs % (mbs * dp) != 0:
                c.err(
                    c.p("train_global_batch_size"),
                    f"{gbs} is not divisible by train_micro_batch_size ({mbs}) x "
                    f"data parallel size ({dp}) = {mbs * dp}",
                )
        elif gbs % mbs != 0:
            c.err(
                c.p("train_global_batch_size"),
                f"{gbs} is not divisible by train_micro_batch_size ({mbs})",
            )

    # ---- dynamic batching / sequence packing
    db = c.sub("dynamic_batching")
    for key in ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"):
        c.positive(db, key, "dynamic_batching")
    if db.get("enabled") is True:
        for key in ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"):
            if key not in db:
                c.err(c.p("dynamic_batching", key), "required when dynamic_batching.enabled is true")
    sp = c.sub("sequence_packing")
    for key in ("train_mb_tokens", "logprob_mb_tokens"):
        c.positive(sp, key, "sequence_packing")
    if sp.get("enabled") is True:
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            if key not in sp:
                c.err(c.p("sequence_packing", key), "required when sequence_packing.enabled is true")
        if db.get("enabled") is True:
            c.err(
                c.p("sequence_packing", "enabled"),
                "sequence packing and dynamic batching cannot both be enabled",
            )
        limit = c.int_of(cfg, "max_total_sequence_length")
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = c.int_of(sp, key)
            if budget is not None and limit is not None and 0 < budget < limit:
                c.err(
                    c.p("sequence_packing", key),
                    f"{budget} is smaller than max_total_sequence_length ({limit}): a sequence of the "
                    "allowed length would fit no packed row",
                )
    _check_sequence_multiple(c, cfg)

    # ---- scheduler chain
    _check_scheduler(c, cfg.get("scheduler"))

    _check_missing_features(c, cfg)
    gen = c.sub("generation")
    if gen:
        _check_sampling(c, gen)
        _check_vllm(c, cfg, gen)
    return c.errors


def _check_missing_features(c: _Checker, cfg: Mapping[str, Any]) -> None:
    """Switches the schema accepts (NeMo RL has them, policy.yaml lists them) for features
    dualrl does not have: on, they would be silently ignored, so they are refused by name."""
    vllm = c.sub("generation").get("vllm_cfg")
    if isinstance(vllm, Mapping) and vllm.get("async_engine") is True:
        c.err(
            c.p("generation", "vllm_cfg", "async_engine"),
            "True: dualrl has no async vLLM engine (every engine is a synchronous vllm.LLM); "
            "set it to false or remove it",
        )


def _check_sampling(c: _Checker, gen: Mapping[str, Any]) -> None:
    """What every engine (HF, JAX, vLLM) would refuse at the first generate call."""
    c.positive(gen, "max_new_tokens", "generation")
    temperature = c.num_of(gen, "temperature")
    if temperature is not None and temperature <= 0:
        # Logprobs divide the logits by it; greedy decoding is a per-call switch (greedy=True).
        c.err(
            c.p("generation", "temperature"),
            f"must be > 0, got {temperature!r}: logprobs are computed at this temperature; greedy "
            "decoding is asked for per call (greedy=True, e.g. validation), not with temperature 0",
        )
    top_p = c.num_of(gen, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        c.err(c.p("generation", "top_p"), f"must be in (0, 1], got {top_p!r}")
    top_k = c.int_of(gen, "top_k")
    if top_k == 0:
        c.err(
            c.p("generation", "top_k"),
            "0: use -1 or null for no top-k filtering (-1 means off; "
            "0 is probably a typo), or a positive number of tokens",
        )
    elif top_k is not None and top_k < -1:
        c.err(
            c.p("generation", "top_k"),
            f"{top_k}: must be a positive number of tokens, or -1 / null for no top-k filtering",
        )
    for key in ("stop_token_ids", "pad_token_id"):
        ids = gen.get(key)
        for i, token in enumerate(ids if isinstance(ids, list) else [ids]):
            if _is_int(token) and token < 0:
                where = c.p("generation", key) + (f"[{i}]" if isinstance(ids, list) else "")
                c.err(where, f"{token}: token ids are >= 0")
    if gen.get("backend") == "hf" and gen.get("model_name") is not None:
        c.err(
            c.p("generation", "model_name"),
            f"{gen['model_name']!r}: not used by generation.backend 'hf' (the policy's workers generate "
            "with their own weights); remove it",
        )


def _check_vllm(c: _Checker, cfg: Mapping[str, Any], gen: Mapping[str, Any]) -> None:
    vllm = gen.get("vllm_cfg")
    if gen.get("backend") == "vllm" and "vllm_cfg" not in gen:
        c.err(c.p("generation", "vllm_cfg"), "required when generation.backend is 'vllm'")
    if not isinstance(vllm, Mapping):
        return
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "max_model_len"):
        c.positive(vllm, key, "generation", "vllm_cfg")
    gmu = c.num_of(vllm, "gpu_memory_utilization")
    if gmu is not None and not 0 < gmu <= 1:
        c.err(c.p("generation", "vllm_cfg", "gpu_memory_utilization"), f"must be in (0, 1], got {gmu!r}")
    max_len, total = c.int_of(vllm, "max_model_len"), c.int_of(cfg, "max_total_sequence_length")
    if gen.get("backend") == "vllm" and max_len is not None and total is not None and 0 < max_len < total:
        # The engine refuses (VllmGeneration) or truncates what the policy would train on.
        c.err(
            c.p("generation", "vllm_cfg", "max_model_len"),
            f"{max_len} is below policy.max_total_sequence_length ({total}): a rollout of the allowed "
            "length would not fit the engine; set it to at least that",
        )


def _check_sequence_multiple(c: _Checker, cfg: Mapping[str, Any]) -> None:
    """Context parallelism splits every row into 2 x cp chunks (each further split over tp
    with sequence parallelism): make_sequence_length_divisible_by must say so."""
    if cfg.get("backend") != "torch_dtensor":
        return
    dt = c.sub("dtensor_cfg")
    cp, tp = c.int_of(dt, "context_parallel_size"), c.int_of(dt, "tensor_parallel_size")
    multiple = c.int_of(cfg, "make_sequence_length_divisible_by")
    if cp is None or cp <= 1 or tp is None or tp < 1:
        return
    need = 2 * cp * (tp if dt.get("sequence_parallel") is True and tp > 1 else 1)
    have = 1 if multiple is None else multiple
    if have % need:
        how = f"2 x context_parallel_size ({cp})" + (
            f" x tensor_parallel_size ({tp}) with sequence_parallel" if need != 2 * cp else ""
        )
        c.err(
            c.p("make_sequence_length_divisible_by"),
            f"{have} is not a multiple of {how} = {need}: context parallelism splits every row into "
            f"2 x cp load-balanced chunks; set it to {need} (or a multiple)",
        )


def _check_parallel(c: _Checker, cfg: Mapping[str, Any], world_size: int | None) -> int | None:
    """Check the parallel sizes (positivity always, fit with world_size for the active
    backend); return the data-parallel size when world_size is known and all is well."""
    ok = True
    dt, jx = c.sub("dtensor_cfg"), c.sub("jax_cfg")
    for key in ("tensor_parallel_size", "context_parallel_size"):
        v = c.int_of(dt, key)
        if v is not None and v < 1:
            c.err(c.p("dtensor_cfg", key), f"must be >= 1, got {v}")
            ok = False
    for key in ("tensor_parallel_size", "context_parallel_size"):
        v = c.int_of(jx, key)
        if v is not None and v < 1:
            c.err(c.p("jax_cfg", key), f"must be >= 1, got {v}")
            ok = False
    v = c.int_of(jx, "fsdp_size")
    if v is not None and v < 1 and v != -1:
        c.err(c.p("jax_cfg", "fsdp_size"), f"must be >= 1, or -1 to use the remaining devices, got {v}")
        ok = False
    if world_size is None or not ok:
        return None

    backend = cfg.get("backend")
    ws = world_size
    if backend == "torch_dtensor":
        tp, cp = c.int_of(dt, "tensor_parallel_size"), c.int_of(dt, "context_parallel_size")
        if tp is None or cp is None or not _tp_cp_divide(c, "dtensor_cfg", tp, cp, ws):
            return None
    elif backend == "jax_pjit":
        fsdp, tp = c.int_of(jx, "fsdp_size"), c.int_of(jx, "tensor_parallel_size")
        cp = c.int_of(jx, "context_parallel_size") if "context_parallel_size" in jx else 1
        if fsdp is None or tp is None or cp is None or not _tp_cp_divide(c, "jax_cfg", tp, cp, ws):
            return None
        if fsdp != -1 and fsdp * cp * tp != ws:
            sizes = f"fsdp_size ({fsdp}) x " + (f"context_parallel_size ({cp}) x " if cp != 1 else "")
            c.err(
                c.p("jax_cfg", "fsdp_size"),
                f"{sizes}tensor_parallel_size ({tp}) = {fsdp * cp * tp} does not "
                f"equal the world size ({ws}); use -1 to fill in",
            )
            return None
    elif backend != "torch_fsdp":
        return None  # unknown backend: reported elsewhere
    try:
        return ParallelDims.from_policy_config(cfg, ws).dp
    except (ValueError, KeyError, TypeError) as e:  # pragma: no cover - checked above
        c.err(c.path or "<config>", str(e))
        return None


def _tp_cp_divide(c: _Checker, section: str, tp: int, cp: int, ws: int) -> bool:
    """tp, then tp x cp, must divide the world size; the error names the field at fault."""
    if ws % tp != 0:
        c.err(
            c.p(section, "tensor_parallel_size"), f"tensor_parallel_size ({tp}) does not divide the world size ({ws})"
        )
        return False
    if ws % (tp * cp) != 0:
        c.err(
            c.p(section, "context_parallel_size"),
            f"tensor_parallel_size ({tp}) x context_parallel_size ({cp}) = {tp * cp} "
            f"does not divide the world size ({ws})",
        )
        return False
    return True


def _check_scheduler(c: _Checker, sched: Any) -> None:
    if not isinstance(sched, (list, tuple)):
        return
    n_sched = sum(1 for e in sched if isinstance(e, Mapping) and "name" in e)
    ms_idx = [i for i, e in enumerate(sched) if isinstance(e, Mapping) and "milestones" in e]
    if n_sched == 0:
        # [] reads like "no schedule" but is easily a list whose entries were lost in a merge
        # (lists replace); null is the one spelling of a constant learning rate.
        what = "[]" if not sched else "only a milestones entry"
        c.err(
            c.p("scheduler"),
            f"{what}: no scheduler to run; use null for a constant learning rate, "
            "or list the schedulers (e.g. torch.optim.lr_scheduler.LinearLR)",
        )
        return
    if len(ms_idx) > 1:
        c.err(
            c.p("scheduler"),
            f"at most one milestones entry allowed, found {len(ms_idx)} (at indices {', '.join(map(str, ms_idx))})",
        )
        return
    if n_sched <= 1:
        return
    if not ms_idx:
        c.err(
            c.p("scheduler"),
            f"{n_sched} schedulers are chained with SequentialLR and need a "
            f"'milestones' entry with {n_sched - 1} step(s)",
        )
        return
    i = ms_idx[0]
    ms = sched[i].get("milestones")
    if not isinstance(ms, (list, tuple)) or not all(_is_int(m) for m in ms):
        return  # type error already reported
    mpath = f"{c.p('scheduler')}[{i}].milestones"
    if len(ms) != n_sched - 1:
        c.err(mpath, f"expected {n_sched - 1} milestone(s) for {n_sched} schedulers, got {len(ms)} ({list(ms)})")
    if any(b <= a for a, b in itertools.pairwise(ms)):
        c.err(mpath, f"must be strictly increasing, got {list(ms)}")
    if ms and ms[0] < 0:
        c.err(mpath, f"must be >= 0, got {list(ms)}")


# ----------------------------------------------------------------------------- losses
def _clipped_pg_semantics(cfg: Mapping[str, Any], path: str) -> list[str]:
    c = _Checker(cfg, path)
    c.non_negative(cfg, "reference_policy_kl_penalty")
    c.non_negative(cfg, "ratio_clip_min")
    c.non_negative(cfg, "ratio_clip_max")
    clip_c = c.num_of(cfg, "ratio_clip_c")
    if clip_c is not None and clip_c <= 1:
        c.err(c.p("ratio_clip_c"), f"must be > 1 (or null to disable dual clipping), got {clip_c!r}")
    for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
        c.positive(cfg, key)

    tis = c.num_of(cfg, "truncated_importance_sampling_ratio")
    tis_min = c.num_of(cfg, "truncated_importance_sampling_ratio_min")
    tis_type = cfg.get("truncated_importance_sampling_type", "tis")
    c.positive(cfg, "truncated_importance_sampling_ratio")
    c.non_negative(cfg, "truncated_importance_sampling_ratio_min")
    if tis is not None:
        if cfg.get("use_importance_sampling_correction") is False:
            c.err(
                c.p("truncated_importance_sampling_ratio"),
                f"is set ({tis!r}) but use_importance_sampling_correction is false; "
                "truncation only applies to the importance-sampling correction",
            )
        if tis_type in ("icepop", "seq-mask-tis"):
            if cfg.get("truncated_importance_sampling_ratio_min") is None:
                c.err(
                    c.p("truncated_importance_sampling_ratio_min"),
                    f"required when truncated_importance_sampling_type is {tis_type!r}",
                )
            elif tis_min is not None and tis_min > tis:
                c.err(
                    c.p("truncated_importance_sampling_ratio_min"),
                    f"{tis_min!r} is greater than truncated_importance_sampling_ratio ({tis!r})",
                )
    if cfg.get("sequence_level_importance_ratios") is True and cfg.get("token_level_loss") is True:
        c.err(
            c.p("sequence_level_importance_ratios"),
            "requires token_level_loss: false (GSPO's sequence-level ratios need a sequence-level loss)",
        )
    return c.errors


def _dpo_semantics(cfg: Mapping[str, Any], path: str) -> list[str]:
    c = _Checker(cfg, path)
    for key in ("reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight"):
        c.non_negative(cfg, key)
    return c.errors


_LOSS_SEMANTICS: dict[Any, Callable[[Mapping[str, Any], str], list[str]]] = {
    ClippedPGLossConfig: _clipped_pg_semantics,
    DPOLossConfig: _dpo_semantics,
}


def _loss_errors(cfg: Any, schema: Any, path: str) -> list[str]:
    errors = validate_typed(cfg, schema, path)
    semantic = _LOSS_SEMANTICS.get(schema)
    if semantic is not None and isinstance(cfg, Mapping):
        errors.extend(semantic(cfg, path))
    return errors


def _cluster_errors(cfg: Any, path: str) -> list[str]:
    errors = validate_typed(cfg, ClusterConfig, path)
    if isinstance(cfg, Mapping):
        c = _Checker(cfg, path)
        for key in ("gpus_per_node", "num_nodes"):
            v = c.int_of(cfg, key)
            if v is not None and v < 1:
                c.err(c.p(key), f"must be >= 1, got {v}")
        errors.extend(c.errors)
    return errors


# =============================================================================
# public entry points
# =============================================================================
def validate_policy_config(cfg: Any, world_size: int | None = None, *, path: str = "policy") -> PolicyConfig:
    """Type-check and semantically check a policy section; returns it unchanged.

    With ``world_size`` the parallel sizes of the chosen backend must fit it and
    ``train_global_batch_size`` must be divisible by ``train_micro_batch_size x dp``.
    """
    if world_size is not None and (not _is_int(world_size) or world_size < 1):
        raise ValueError(f"validate_policy_config: world_size must be a positive int, got {world_size!r}")
    errors = _policy_errors(cfg, world_size, path)
    if errors:
        raise ConfigError(errors)
    return cfg


def validate_loss_config(cfg: Any, schema: Any, path: str = "loss_fn") -> Any:
    """Check a loss section against ``schema`` (e.g. ``ClippedPGLossConfig`` or
    ``DPOLossConfig``) plus that loss's semantic rules; returns ``cfg`` unchanged."""
    errors = _loss_errors(cfg, schema, path)
    if errors:
        raise ConfigError(errors)
    return cfg


def validate_master_config(cfg: Any) -> MasterConfig:
    """Check a whole config; the world size is ``cluster.gpus_per_node * cluster.num_nodes``.
    It is also checked against its model's vocabulary and the optimizer / scheduler classes it
    names (:mod:`core.config.external_checks`).  Returns ``cfg`` unchanged."""
    world_size = None
    cluster = cfg.get("cluster") if isinstance(cfg, Mapping) else None
    if isinstance(cluster, Mapping):
        g, n = cluster.get("gpus_per_node"), cluster.get("num_nodes")
        if _is_int(g) and _is_int(n) and g > 0 and n > 0:
            world_size = g * n
    from core.config.external_checks import external_errors  # reads model configs, imports classes
    from core.config.run_checks import cross_section_errors, section_handlers  # it builds on this module

    handlers: dict[Any, _Handler] = {
        PolicyConfig: lambda v, p: _policy_errors(v, world_size, p),
        ClusterConfig: _cluster_errors,
        ClippedPGLossConfig: lambda v, p: _loss_errors(v, ClippedPGLossConfig, p),
        **section_handlers(),
    }
    errors = validate_typed(cfg, MasterConfig, "", handlers=handlers)
    if not errors and isinstance(cfg, Mapping):
        errors = cross_section_errors(cfg)
    if isinstance(cfg, Mapping):  # each of its rules reads only values of the right type
        errors += external_errors(cfg)
    if errors:
        raise ConfigError(errors)
    return cfg
