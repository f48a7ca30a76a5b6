"""Engine side of a refit: check the stream, track what has been loaded, know when the
engine's weights can be trusted.

Transport- and engine-agnostic (no vLLM import) so its rules are unit-tested directly; the
vLLM worker extension feeds it manifests and buckets and asks it before every generate.

The rules:
* the manifest must name exactly the engine's tensors with the engine's shapes and dtype,
  checked before any weight is touched (a refused refit leaves the old weights in place);
* every bucket tensor must be in the manifest, once, with the manifest's shape and dtype,
  checked before the bucket is loaded;
* once a bucket has been loaded the weights are mixed until every manifest tensor has
  arrived: a stream that stops early or fails leaves the engine marked *stale*, and it
  refuses to generate until a complete refit succeeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.refit.manifest import RefitError, RefitManifest, dtype_name


class RefitReceiver:
    def __init__(self, expected: RefitManifest, weights_valid: bool, engine: str = "engine") -> None:
        self.expected = expected
        self.engine = engine
        self.weights_valid = weights_valid
        self.stale_reason: str | None = (
            None if weights_valid else ("it was started with dummy weights and has not been refit yet")
        )
        self.manifest: RefitManifest | None = None
        self.received: set[str] = set()
        self.loaded_any = False
        self.refits_completed = 0
        self.bytes_received = 0

    # ------------------------------------------------------------------ protocol
    def begin(self, info: Mapping[str, Any]) -> None:
        """Accept the manifest of the coming stream, or refuse it with the engine untouched."""
        if self.manifest is not None and self.loaded_any:
            self._mark_stale("a previous refit was abandoned part-way")
        manifest = RefitManifest.from_info(info)
        manifest.check_against(self.expected, self.engine)
        self.manifest, self.received, self.loaded_any = manifest, set(), False

    def check_bucket(self, items: Sequence[tuple[str, Any]]) -> None:
        """Raise before loading if any tensor of the bucket does not belong to the stream."""
        if self.manifest is None:
            raise RefitError(
                "refit bucket received before prepare_refit_info: the engine does not know which tensors to expect"
            )
        in_bucket: set[str] = set()
        for name, tensor in items:
            if name not in self.manifest:
                raise self._fail(f"unknown tensor {name!r}: not in the refit manifest")
            if name in self.received or name in in_bucket:
                raise self._fail(f"tensor {name!r} sent twice in one refit")
            in_bucket.add(name)
            spec = self.manifest[name]
            try:
                shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
            except RefitError as exc:
                raise self._fail(f"{name!r}: {exc}") from None
            if shape != spec.shape:
                raise self._fail(f"{name!r}: bucket shape {list(shape)} but the manifest says {list(spec.shape)}")
            if dtype != spec.dtype:
                raise self._fail(f"{name!r}: bucket dtype {dtype} but the manifest says {spec.dtype}")

    def with_tied_aliases(self, items: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``items`` plus, for a tied tensor the stream leaves out (JAX's export writes no
        ``lm_head.weight`` for tied embeddings, torch's state dict does), the alias carrying
        the same tensor: an engine reloading layer by layer must see every layer's weights,
        and a tied ``lm_head`` left unloaded would keep its dummy values."""
        sent = set(self.manifest.names) if self.manifest is not None else set()
        extra = [
            (alias, tensor)
            for alias, source in self.expected.aliases.items()
            if alias not in sent
            for name, tensor in items
            if name == source
        ]
        return list(items) + extra

    def mark_loaded(self, items: Sequence[tuple[str, Any]]) -> None:
        self.loaded_any = True
        self.weights_valid = False
        self.stale_reason = "a refit is in progress"
        for name, tensor in items:
            self.received.add(name)
            self.bytes_received += int(tensor.numel() * tensor.element_size())

    def finish(self) -> int:
        """Close the stream; raise (engine stale) unless every manifest tensor arrived."""
        if self.manifest is None:
            raise RefitError("finish_refit without prepare_refit_info")
        missing = [n for n in self.manifest.names if n not in self.received]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise self._fail(
                f"incomplete refit stream: {len(missing)} of {len(self.manifest)} tensors never "
                f"arrived ({', '.join(map(repr, missing[:3]))}{more})"
            )
        self.manifest, self.loaded_any = None, False
        self.weights_valid, self.stale_reason = True, None
        self.refits_completed += 1
        return len(self.received)

    def require_valid(self) -> None:
        """Called before generating: stale or dummy weights must not produce rollouts silently."""
        if not self.weights_valid:
            raise RefitError(
                f"the {self.engine} refuses to generate: {self.stale_reason}; run a complete "
                "refit (refit_policy_generation) first"
            )

    def abandon(self, reason: str) -> None:
        """The stream broke off (its sender is gone): stale if anything was loaded."""
        if self.loaded_any:
            self._mark_stale(f"the last refit broke off after loading part of the weights: {reason}")
        self.manifest, self.loaded_any = None, False

    def invalidate(self, reason: str) -> None:
        """The engine no longer serves the policy's weights (an adapter refit failed after the
        base was in place): refuse to generate until a complete refit."""
        self._mark_stale(reason)

    # ------------------------------------------------------------------ internals
    def _fail(self, message: str) -> RefitError:
        if self.loaded_any:
            self._mark_stale(f"the last refit failed after loading part of the weights ({message})")
        self.manifest, self.loaded_any = None, False
        return RefitError(f"refit refused: {message}")

    def _mark_stale(self, reason: str) -> None:
        self.weights_valid = False
        self.stale_reason = reason
