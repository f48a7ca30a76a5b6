"""The HF reference every layout is held to: plain ``AutoModelForCausalLM`` in this process
(``hf``), or, for the ``-lora`` layouts, the same model with the torch backends' ``LoRALinear``
and the seeded adapters of ``core.models.lora`` (``hf-lora``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

from benchmarks.lib.parity.estimators import estimator_rows_hf
from benchmarks.lib.parity.grpo import grpo_loss_fn, grpo_summary
from benchmarks.lib.parity.measure import measure
from benchmarks.lib.parity.multi_turn import multi_turn_hf
from benchmarks.lib.parity.settings import GRPO_STEPS
from core.losses.router_aux import AUX_METRIC, moe_top_k


class HFReference:
    """Single-process ``AutoModelForCausalLM`` in fp32: the reference every layout is held to.

    ``lora``: ``policy.lora`` settings (``settings.LORA``) -- every targeted linear becomes a
    ``LoRALinear`` with the initial adapters every backend draws, everything else frozen, so
    the AdamW below holds the adapters only, as the backends' optimizers do."""

    def __init__(
        self,
        model_path: str,
        cfg: dict,
        precision: str = "float32",
        lora: dict | None = None,
        keep_reference: bool = True,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        if lora is not None:
            from backends.torch_common.lora import apply_lora
            from core.policy.config import LoRAConfig

            apply_lora(self.model, LoRAConfig(enabled=True, **lora))
        self.cfg = cfg
        # The initial weights, as a Policy's reference model (the multi-turn step's KL term).
        self.reference = copy.deepcopy(self.model) if keep_reference else None
        # bf16: the workers' recipe (bf16 compute over fp32 weights) as CPU autocast does it
        self.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")
        self._opt = None  # one AdamW for every train step (GRPO's, then NLL's), as a Policy has

    def logprobs(self, ids, lengths, model=None):
        """``[0, logp...]``, padding 0; log_softmax in float64 as tests/torch_backends does."""
        import torch

        model = model or self.model
        mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
        model.eval()
        with torch.no_grad(), self.autocast():
            logits = model(input_ids=ids, attention_mask=mask.long()).logits.double()
        lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lp = torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], 1)
        return (lp * mask).float()

    def reference_logprobs(self, ids, lengths):
        """:meth:`logprobs` of the initial weights (``get_reference_policy_logprobs``)."""
        if self.reference is None:
            raise ValueError("HFReference(keep_reference=False) has no reference model")
        return self.logprobs(ids, lengths, self.reference)

    def trainer(self, data, loss_fn=None) -> Callable[[], tuple[float, float, dict]]:
        """One step = full-batch forward, the workers' loss code (``NLLLoss`` by default),
        backward, pre-clipping global norm, clipping and AdamW with the policy section's
        settings; a step returns (loss, grad norm, the loss's metrics)."""
        import torch

        from core.losses import NLLLoss

        loss_fn = loss_fn or NLLLoss()
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        if self._opt is None:
            kwargs = dict(self.cfg["optimizer"]["kwargs"])
            kwargs["betas"] = tuple(kwargs["betas"])
            self._opt = torch.optim.AdamW(params, **kwargs)
        opt = self._opt
        max_norm = self.cfg["max_grad_norm"]

        def step(batch=data):
            ids = batch["input_ids"]
            mask = (torch.arange(ids.shape[1])[None] < batch["input_lengths"][:, None]).long()
            self.model.train()
            opt.zero_grad(set_to_none=True)
            moe = moe_top_k(self.model.config) is not None
            with self.autocast():
                out = self.model(input_ids=ids, attention_mask=mask, **({"output_router_logits": True} if moe else {}))
            loss, metrics = loss_fn(out.logits.float(), batch, None, None)
            if moe:  # the policy's coefficient is the tiny config's: 0, reported only
                metrics = {**metrics, AUX_METRIC: hf_router_aux(out.router_logits, batch, self.model.config)}
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            norm = (
                torch.nn.utils.clip_grad_norm_(params, max_norm)
                if max_norm is not None
                else torch.nn.utils.get_total_norm(grads)
            )
            opt.step()
            return float(loss.detach()), float(norm), {k: float(v) for k, v in metrics.items()}

        return step

    def measure(self, data, other, steps: int, grpo_base=None, grpo_steps: int = GRPO_STEPS, multi_turn=None) -> dict:
        step = self.trainer(data)
        grpo = None if grpo_base is None else (lambda: self.grpo(grpo_base, grpo_steps, multi_turn))
        return measure(self.logprobs, lambda: step()[:2], data, other, steps, grpo)

    def grpo(self, base, steps: int = GRPO_STEPS, multi_turn=None) -> dict:
        """:func:`grpo_policy` in this process: step 0 at the current weights, then the fused
        step computed both ways from the same weights and optimizer state
        (``grpo_fused_separate``: old log-probs from a separate pass, today's path; then, kept,
        ``grpo_fused``); then, given a ``MultiTurnWorkload``, the multi-turn step; then the
        estimator rows."""
        data = dict(base)
        initial = self.logprobs(data["input_ids"], data["input_lengths"])
        data["prev_logprobs"] = data["reference_policy_logprobs"] = initial
        out = {"grpo": self.grpo_steps(data, grpo_loss_fn(), steps)}
        fused = {k: v for k, v in data.items() if k != "prev_logprobs"}
        with self._restored_after():
            separate = {**fused, "prev_logprobs": self.logprobs(data["input_ids"], data["input_lengths"])}
            out["grpo_fused_separate"] = self.grpo_steps(separate, grpo_loss_fn(), 1)
        out["grpo_fused"] = self.grpo_steps(fused, grpo_loss_fn("forward"), 1)
        if multi_turn is not None:
            out.update(multi_turn_hf(self, multi_turn, steps))
        out.update(estimator_rows_hf(self, base, steps))
        return out

    def grpo_steps(self, data: dict, loss_fn, steps: int) -> dict:
        """``steps`` optimizer steps, one per equal slice of ``data``; their summary."""
        step = self.trainer(data, loss_fn)
        gbs = len(data["input_ids"]) // steps
        losses, norms, metrics = [], [], {}
        for g in range(steps):
            loss, norm, m = step({k: v[g * gbs : (g + 1) * gbs] for k, v in data.items()})
            losses.append(loss)
            norms.append(norm)
            for k, v in m.items():
                metrics.setdefault(k, []).append(v)
        return grpo_summary(losses, norms, metrics)

    @contextlib.contextmanager
    def _restored_after(self) -> Iterator[None]:
        """Weights and AdamW state as they were on entry, whatever the body trained."""
        weights = copy.deepcopy(self.model.state_dict())
        opt = copy.deepcopy(self._opt.state_dict()) if self._opt is not None else None
        try:
            yield
        finally:
            self.model.load_state_dict(weights)
            if opt is not None:
                self._opt.load_state_dict(opt)


def hf_router_aux(router_logits, batch, config):
    """The router loss a policy reports (``moe_aux_loss``) from HF's own pieces: HF's
    ``load_balancing_loss_func`` on each sequence's real tokens, averaged over the batch's
    valid sequences (``sample_mask``)."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ids = batch["input_ids"]
    rows, width = ids.shape
    layers = [r.float().reshape(rows, width, -1) for r in router_logits]
    per_row = torch.stack(
        [
            load_balancing_loss_func(tuple(r[b, :n] for r in layers), config.num_experts, config.num_experts_per_tok)
            for b, n in enumerate(batch["input_lengths"].tolist())
        ]
    )
    valid = batch["sample_mask"].float() if "sample_mask" in batch else torch.ones(rows)
    return (per_row * valid).sum() / valid.sum()


def hf_export_logprobs(path: str, data, precision: str = "float32"):
    """Logprobs of an HF export loaded in this process (the ``hf`` cross-load target)."""
    return HFReference(path, {}, precision, keep_reference=False).logprobs(data["input_ids"], data["input_lengths"])
