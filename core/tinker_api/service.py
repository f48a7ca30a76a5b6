"""The Tinker API's calls: each checks its request against the registry and the limits (a
refusal is a :class:`RequestError`, raised before any work), then answers or queues a job.

Training calls (``create_model``, ``forward_backward``, ``optim_step``, ``save_weights``,
``load_weights``, ``save_weights_for_sampler``) and ``asample`` answer with a future
(``{"request_id", "model_id"}``); the job's result is what ``retrieve_future`` returns.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tinker import types

from core.reporting import get_logger
from core.tinker_api.config import ServeRunConfig
from core.tinker_api.datums import DatumLimits, ForwardBackwardRequest
from core.tinker_api.errors import RequestError, bad_request, not_found
from core.tinker_api.jobs import FutureStore, Job, JobRunner, Payload
from core.tinker_api.model import (
    ATTENTION_TARGETS,
    MLP_TARGETS,
    ModelSpec,
    ServedModel,
    adam_params_of,
    read_saved_state,
    saved_adam_params,
)
from core.tinker_api.registry import ModelRecord, Registry, SamplerRecord, Session
from core.tinker_api.runtime import PolicyRuntime
from core.tinker_api.sampling import SampleJob, SampleLimits, check_sample_request, run_sample_jobs
from core.tinker_api.wire import sample_response

logger = get_logger(__name__)

#: Checkpoint names (the last part of a ``tinker://`` path): no separators, no leading dot.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TinkerService:
    def __init__(self, cfg: ServeRunConfig, runtime: PolicyRuntime):
        self.cfg = cfg
        self.runtime = runtime
        self.base = runtime.base
        self.registry = Registry()
        self.futures = FutureStore()
        self.runner = JobRunner(self.futures)
        self.checkpoint_root = Path(cfg.serve.checkpoint_dir).resolve()
        gen = runtime.cfg.policy.generation
        length = cfg.policy.max_total_sequence_length
        self.datum_limits = DatumLimits(self.base.vocab_size, length, cfg.serve.max_datums_per_request)
        self.sample_limits = SampleLimits(
            self.base.vocab_size,
            length,
            gen.max_new_tokens if gen is not None else 0,
            cfg.serve.max_samples_per_request,
            self.base.eos_ids,
        )
        self.runner.start()

    # ------------------------------------------------------------------ sessions
    def create_session(self, req: types.CreateSessionRequest) -> dict[str, Any]:
        session_id = uuid.uuid4().hex
        labels = {"tags": list(req.tags), "user_metadata": req.user_metadata or {}, "project_id": req.project_id,
                  "display_name": req.display_name, "sdk_version": req.sdk_version}  # fmt: skip
        with self.registry.lock:
            self.registry.sessions[session_id] = Session(session_id, labels=labels)
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, session_id: str) -> dict[str, Any]:
        with self.registry.lock:
            self.registry.session(session_id, "session_heartbeat").last_seen = _now()
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, reason: str) -> None:
        with self.registry.lock:
            if session_id not in self.registry.sessions:
                raise not_found(f"sessions/{session_id}/finish: unknown session")
            released = self.registry.close(session_id, reason)
        for record in released:
            self._queue(record.model_id, f"release model {record.model_id}", lambda r=record: self._release(r))

    def expire_sessions(self) -> list[str]:
        """Close the sessions whose heartbeat stopped (``serve.session_timeout_s``)."""
        with self.registry.lock:
            expired = self.registry.expired(self.cfg.serve.session_timeout_s)
        for session_id in expired:
            self.finish_session(session_id, f"no heartbeat for {self.cfg.serve.session_timeout_s:g} s")
        return expired

    # ------------------------------------------------------------------ models
    def create_model(self, req: types.CreateModelRequest) -> dict[str, Any]:
        what = "create_model"
        spec = self._model_spec(req.lora_config, what)
        self._check_base_model(req.base_model, what)
        self._check_optimizer(req.optimizer_config, what)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        with self.registry.lock:
            self.registry.session(req.session_id, what)
            self._take_slot(model_id, what)
            record = ModelRecord(model_id, req.session_id, spec, user_metadata=dict(req.user_metadata or {}))
            self.registry.models[model_id] = record

        def build() -> Payload:
            with self._freed_on_failure(record):
                record.served = ServedModel(model_id, spec, self.runtime.build(spec))
            return Payload(json={"model_id": model_id, "type": "create_model"})

        return self._queue(model_id, f"create_model {model_id}", build)

    def get_info(self, req: types.GetInfoRequest) -> dict[str, Any]:
        with self.registry.lock:
            record = self.registry.model(req.model_id, "get_info")
        lora = record.spec.lora_rank
        return {
            "type": "get_info",
            "model_id": req.model_id,
            "model_data": {"arch": "causal_lm", "model_name": self.base.path, "tokenizer_id": self.base.path},
            "is_lora": lora is not None,
            "lora_rank": lora,
            "model_name": self.base.path,
        }

    def forward_backward(self, request: ForwardBackwardRequest) -> dict[str, Any]:
        what = "forward" if request.forward_only else "forward_backward"
        with self.registry.lock:
            record = self.registry.model(request.model_id, what)
            if not request.forward_only:
                record.queued_datums += request.rows.size
        return self._queue(
            record.model_id, f"{what} ({request.loss_fn}, {request.rows.size} datums)",
            lambda: Payload(proto=self._served(record).forward(request)),
        )  # fmt: skip

    def optim_step(self, req: types.OptimStepRequest) -> dict[str, Any]:
        what = "optim_step"
        if not isinstance(req.optim_params, types.AdamParams):
            raise bad_request(f"{what}: only Adam parameters are supported (got {type(req.optim_params).__name__})")
        params = adam_params_of(req.optim_params)
        problems = params.problems()
        if problems:
            raise bad_request(f"{what}: adam_params: " + "; ".join(problems))
        with self.registry.lock:
            record = self.registry.model(req.model_id, what)
            if record.queued_datums == 0:
                raise bad_request(f"{what}: no forward_backward since the last optim_step: there is nothing to apply")
            record.queued_datums = 0
        return self._queue(record.model_id, what, lambda: Payload(json=self._served(record).optim_step(params)))

    def save_weights(self, req: types.SaveWeightsRequest) -> dict[str, Any]:
        what = "save_weights"
        _no_expiry(req.ttl_seconds, what)
        with self.registry.lock:
            record = self.registry.model(req.model_id, what)
        name = self._name(req.path or "", what)
        directory = self._dir(record.model_id, "weights", name)
        if directory.exists() and not req.overwrite:
            raise bad_request(f"{what}: {self._path(record.model_id, 'weights', name)} exists; pass overwrite=True")
        path = self._path(record.model_id, "weights", name)

        def save() -> Payload:
            metadata = {**record.user_metadata, **(req.user_metadata or {})}
            self._served(record).save_state(directory, self.base.name, metadata)
            return Payload(json={"path": path, "type": "save_weights"})

        return self._queue(record.model_id, what, save)

    def load_weights(self, req: types.LoadWeightsRequest) -> dict[str, Any]:
        """A new model from a saved state (``create_training_client_from_state*``), or a live
        model's weights replaced by one (the deprecated ``TrainingClient.load_state*``)."""
        what = "load_weights"
        if req.weights_access_token is not None:
            raise bad_request(f"{what}: weights_access_token: this server has no accounts; leave it unset")
        directory, state = self._saved_state(req.path, what)
        spec = ModelSpec.from_json(state["spec"])
        if req.base_model is not None:
            self._check_base_model(req.base_model, what)
        if req.optimizer_config is not None:
            self._check_optimizer(req.optimizer_config, what)
        with self.registry.lock:
            if req.model_id is not None:
                record = self.registry.model(req.model_id, what)
                if record.spec != spec:
                    raise bad_request(f"{what}: {req.path} holds a model with {spec}, not this one's {record.spec}")
                if record.queued_datums:
                    raise bad_request(f"{what}: forward_backward datums wait for an optim_step; take it (or not) first")
            else:
                if req.session_id is None or req.model_seq_id is None:
                    raise bad_request(f"{what}: give model_id, or session_id with model_seq_id")
                self.registry.session(req.session_id, what)
                model_id = f"{req.session_id}:train:{req.model_seq_id}"
                self._take_slot(model_id, what)
                metadata = {**state.get("user_metadata", {}), **(req.user_metadata or {})}
                record = ModelRecord(model_id, req.session_id, spec, user_metadata=metadata)
                self.registry.models[model_id] = record

        def load() -> Payload:
            if record.served is not None:
                record.served.shutdown()
                record.served = None
            optimizer = str(directory / "optimizer") if req.optimizer else None
            with self._freed_on_failure(record):
                policy = self.runtime.build(spec, str(directory / "weights"), optimizer)
            served = ServedModel(record.model_id, spec, policy, step=int(state["step"]))
            saved = saved_adam_params(state)
            if req.optimizer and saved is not None:  # the restored moments belong to these settings
                policy.set_optimizer_params(saved)
                served.params = saved
            record.served = served
            return Payload(json={"path": req.path, "model_id": record.model_id, "type": "load_weights"})

        return self._queue(record.model_id, what, load)

    def save_weights_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        what = "save_weights_for_sampler"
        _no_expiry(req.ttl_seconds, what)
        if req.kind != "snapshot":
            raise bad_request(f"{what}: kind={req.kind!r} is not supported (snapshot samplers only)")
        with self.registry.lock:
            record = self.registry.model(req.model_id, what)
        name = None if req.path is None else self._name(req.path, what)
        if name is None and req.sampling_session_seq_id is None:
            raise bad_request(f"{what}: give a path (a name) or a sampling_session_seq_id")
        sampler_id = f"{record.session_id}:sample:{req.sampling_session_seq_id}" if name is None else None
        path = None if name is None else self._path(record.model_id, "sampler_weights", name)

        def save() -> Payload:
            served = self._served(record)
            if name is not None:
                served.save_for_sampler(self._dir(record.model_id, "sampler_weights", name))
            sampler = SamplerRecord(sampler_id or "", record.session_id, record.model_id, served.step, path)
            with self.registry.lock:
                if sampler_id is not None:
                    self.registry.samplers[sampler_id] = sampler
                if path is not None:
                    self.registry.sampler_paths[path] = sampler
            body = {"path": path} if path is not None else {"sampling_session_id": sampler_id}
            return Payload(json={**body, "type": "save_weights_for_sampler"})

        return self._queue(record.model_id, what, save)

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, req: types.CreateSamplingSessionRequest) -> dict[str, Any]:
        what = "create_sampling_session"
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        with self.registry.lock:
            self.registry.session(req.session_id, what)
            if req.model_path is not None:
                saved = self.registry.sampler_paths.get(req.model_path)
                if saved is None:
                    raise not_found(f"{what}: no sampler weights at {req.model_path!r} (save_weights_for_sampler)")
                record = SamplerRecord(sampler_id, req.session_id, saved.model_id, saved.step, req.model_path)
            else:
                self._check_base_model(req.base_model, what)
                record = SamplerRecord(sampler_id, req.session_id, None, 0)
            self.registry.samplers[sampler_id] = record
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        with self.registry.lock:
            record = self.registry.sampler(sampler_id, f"samplers/{sampler_id}")
        return {"sampler_id": sampler_id, "base_model": self.base.path, "model_path": record.model_path}

    def sample(self, req: types.SampleRequest) -> dict[str, Any]:
        what = "sample"
        if req.sampling_session_id is None:
            raise bad_request(f"{what}: give a sampling_session_id (create a SamplingClient first)")
        job = check_sample_request(req, self.sample_limits)
        with self.registry.lock:
            sampler = self.registry.sampler(req.sampling_session_id, what)
        request_id = self.futures.new()
        self.runner.submit(
            Job(
                request_id,
                batch_key=("sample", job.greedy),
                run_batch=self._run_samples,
                args=(sampler, job),
                what=what,
            )
        )
        ids = [f"{request_id}:{i}" for i in range(req.num_samples)]
        return {"request_id": request_id, "sample_sequence_ids": ids}

    def _run_samples(self, jobs: Sequence[Job]) -> list[Payload | Exception]:
        """One generate call for the queued sample jobs whose samplers hold the live weights."""
        outcomes: list[Payload | Exception | None] = [None] * len(jobs)
        runnable: list[tuple[int, SampleJob]] = []
        served = None
        for k, job in enumerate(jobs):
            sampler, sample_job = job.args
            try:
                served = self._sampled_model(sampler)
                runnable.append((k, sample_job))
            except RequestError as err:
                outcomes[k] = err
        if runnable and served is not None:
            results = run_sample_jobs(
                served.policy, self.runtime.tokenizer, [j for _, j in runnable], self.base.pad_id, self.base.eos_ids
            )
            for (k, _), (sequences, prompt_lps) in zip(runnable, results, strict=True):
                outcomes[k] = Payload(proto=sample_response(sequences, prompt_lps))
        return [o if o is not None else RuntimeError("sample job not run") for o in outcomes]

    def _sampled_model(self, sampler: SamplerRecord) -> ServedModel:
        """The live model whose weights ``sampler`` samples (RequestError when they moved on)."""
        with self.registry.lock:
            live = self.registry.live
            record = self.registry.models.get(sampler.model_id or live or "")
        served = record.served if record is not None and not record.released else None
        if served is None:
            raise bad_request("no model holds the policy: sampling needs a live training client of this server")
        if served.step != sampler.step:
            which = "the base model" if sampler.model_id is None else f"the weights after step {sampler.step}"
            raise bad_request(
                f"this sampler samples {which}, but model {served.model_id} has taken {served.step} step(s) since "
                "loading them; dualrl serve samples the current weights only: call save_weights_for_sampler "
                "(or save_weights_and_get_sampling_client) again"
            )
        return served

    # ------------------------------------------------------------------ helpers
    def _queue(self, model_id: str, what: str, run: Any) -> dict[str, Any]:
        request_id = self.futures.new()
        self.runner.submit(Job(request_id, run=run, what=what))
        return {"request_id": request_id, "model_id": model_id}

    def _served(self, record: ModelRecord) -> ServedModel:
        if record.served is None:
            raise bad_request(f"model {record.model_id} has no policy (its creation failed; see that request's error)")
        return record.served

    def _release(self, record: ModelRecord) -> Payload:
        if record.served is not None:
            record.served.shutdown()
            record.served = None
        return Payload(json={})

    @contextlib.contextmanager
    def _freed_on_failure(self, record: ModelRecord) -> Iterator[None]:
        """A model whose policy did not start leaves the slot (the job's error says why)."""
        try:
            yield
        except BaseException:
            with self.registry.lock:
                record.released = True
                if self.registry.live == record.model_id:
                    self.registry.live = None
            raise

    def _take_slot(self, model_id: str, what: str) -> None:
        """Reserve the one policy slot for ``model_id`` (the registry's lock held)."""
        live = self.registry.live
        if live is not None:
            owner = self.registry.models[live].session_id
            raise bad_request(
                f"{what}: dualrl serve trains one model at a time and {live} (session {owner}) holds it; close that "
                "session (ServiceClient.close) first, or start another server"
            )
        self.registry.live = model_id

    def _model_spec(self, lora: types.LoraConfig | None, what: str) -> ModelSpec:
        if lora is None:
            return ModelSpec(lora_rank=None)
        if lora.train_unembed:
            raise bad_request(
                f"{what}: lora_config.train_unembed=True: dualrl's LoRA adapts the decoder's linears, not the "
                "unembedding (lm_head); pass train_unembed=False"
            )
        targets = (ATTENTION_TARGETS if lora.train_attn else ()) + (MLP_TARGETS if lora.train_mlp else ())
        if not targets or lora.rank < 1:
            raise bad_request(f"{what}: lora_config needs rank >= 1 and train_attn or train_mlp (got {lora})")
        seed = lora.seed if lora.seed is not None else secrets.randbelow(2**31)
        return ModelSpec(lora.rank, targets, seed)

    def _check_base_model(self, requested: str | None, what: str) -> None:
        if not self.base.matches(requested):
            raise bad_request(
                f"{what}: base_model {requested!r}: this server trains {self.base.name!r} ({self.base.path}); start "
                "dualrl serve with policy.model_name set to the model you want"
            )

    @staticmethod
    def _check_optimizer(optimizer: Any, what: str) -> None:
        if getattr(optimizer, "type", "adamw") != "adamw":
            raise bad_request(f"{what}: optimizer_config type {optimizer.type!r} is not supported (adamw only)")

    def _name(self, name: str, what: str) -> str:
        if not NAME.match(name):
            raise bad_request(f"{what}: path {name!r} must be a name of letters, digits, '.', '_' or '-'")
        return name

    def _dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.checkpoint_root / model_id.replace(":", "_") / kind / name

    @staticmethod
    def _path(model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def _saved_state(self, path: str, what: str) -> tuple[Path, dict[str, Any]]:
        parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] != "weights" or not NAME.match(parts[2]):
            raise bad_request(f"{what}: {path!r} is not a tinker://<model_id>/weights/<name> path of save_state")
        directory = self._dir(parts[0], "weights", parts[2])
        try:
            state = read_saved_state(directory)
        except (OSError, ValueError):
            raise not_found(f"{what}: no saved state at {path!r} (looked in {directory})") from None
        if state.get("base_model") != self.base.name:
            raise bad_request(f"{what}: {path} is a state of {state.get('base_model')!r}, not of {self.base.name!r}")
        return directory, state

    def shutdown(self) -> None:
        """Finish the queued jobs, release every model and the cluster."""
        with self.registry.lock:
            for session_id in list(self.registry.sessions):
                for record in self.registry.close(session_id, "server shut down"):
                    self._queue(record.model_id, f"release model {record.model_id}", lambda r=record: self._release(r))
        self.runner.stop()
        self.runtime.shutdown()


def _no_expiry(ttl_seconds: int | None, what: str) -> None:
    if ttl_seconds is not None:
        raise bad_request(
            f"{what}: ttl_seconds={ttl_seconds}: checkpoints of dualrl serve do not expire; leave it unset"
        )


def _now() -> float:
    import time

    return time.monotonic()
