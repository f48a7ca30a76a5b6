"""A vocabulary that tensor parallelism does not divide (301 over tp=2): the DTensor backend
pads its training copy (embedding, lm_head) with zero rows, masks the padded logits and
never lets the padding out (HF export, refit, the generate replica keep [301, H]).

One policy per layout serves every check of that layout, in order (logprobs on fresh
weights, the full-logits loss path in eval mode, two AdamW steps against a single-process
HF reference on the unpadded model, export, reference swap, HF generate, DCP).  The
layouts: tp=2 on an untied Llama, tp=2 + sequence parallel on a tied Qwen2 (q/k/v bias),
and tp=1 dp=2 padded only because ``make_vocab_size_divisible_by=64`` asks for it.
The refit into vLLM is tests/generation/test_refit_padded_vocab.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from core.config.validate import ConfigError, validate_policy_config
from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.policy.preflight import check_tensor_parallel_fits
from core.testing.tiny_models import PAD_ID, random_batch, tiny_config, tiny_tokenizer
from tests.torch_backends.conftest import SEQ, hf_logprobs, pg_batch, policy_config
from tests.torch_backends.test_torch_policy import PG_CFG

V = 301  # odd: no tp > 1 divides it

# (model, tp, sequence_parallel, make_vocab_size_divisible_by, padded size, train micro batch)
LAYOUTS = [
    pytest.param(("llama", 2, False, 1, 302, 2), id="tp2-llama"),
    pytest.param(("qwen2_tied", 2, True, 1, 302, 1), id="tp2-sp-qwen2-tied"),
    pytest.param(("llama", 1, False, 64, 320, 2), id="dp2-divisible-by-64"),
]


def save_v301_model(base: str, path, tie: bool = False, seed: int = 0):
    """The named tiny model (``core.testing.tiny_models``) with a 301-token vocabulary."""
    cfg = tiny_config(base)
    cfg.vocab_size = V
    cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.02)  # exercise Qwen2's q/k/v bias (HF inits it to 0)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def v301_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v301")
    return {
        "llama": save_v301_model("llama", root / "llama"),
        "qwen2_tied": save_v301_model("qwen2", root / "qwen2_tied", tie=True),
    }


def _ids_301(ids: torch.Tensor) -> torch.Tensor:
    """Valid positions get ids over the whole [4, 301), the shard edges (150 | 151 on tp=2)
    and the last real id 300 included; padding stays PAD_ID."""
    g = torch.Generator().manual_seed(int(ids.sum()))
    out = torch.where(ids == PAD_ID, ids, torch.randint(4, V, ids.shape, generator=g))
    out[0, 1:5] = torch.tensor([150, 151, 300, 299])  # row 0 has the full length
    return out


def _ragged(batch: int, seed: int) -> BatchedDataDict:
    ids, lens = random_batch(batch, SEQ, V, seed=seed)
    return BatchedDataDict(input_ids=_ids_301(ids), input_lengths=lens)


def _pg_batch(batch: int, seed: int) -> BatchedDataDict:
    data = pg_batch(batch, seed)
    data["input_ids"] = _ids_301(data["input_ids"])
    return data


class FullLogitsPG:
    """ClippedPG computed from the full logits (no ``loss_from_logprobs``): the worker's
    full-logits path, which must hand the loss exactly the original V columns."""

    def __init__(self, cfg):
        self.inner = ClippedPGLossFn(cfg)
        self.loss_type = self.inner.loss_type

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        if logits.shape[-1] != V:
            raise AssertionError(f"the loss saw {logits.shape[-1]} vocab columns, not {V}")
        return self.inner(logits, data, global_valid_seqs, global_valid_toks)


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request, ray_session, v301_dirs, tokenizer):
    model, tp, sp, multiple, padded, mbs = request.param
    cfg = policy_config(
        v301_dirs[model],
        "torch_dtensor",
        tp=tp,
        sp=sp,
        train_micro_batch_size=mbs,
        make_vocab_size_divisible_by=multiple,
    )
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    yield {
        "policy": policy,
        "cfg": cfg,
        "model_dir": v301_dirs[model],
        "padded": padded,
        "tied": model == "qwen2_tied",
        "state": {},
    }
    policy.shutdown()
    cluster.shutdown()


def _hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _max_err(a, b) -> float:
    return float((a - b).abs().max())


def test_get_logprobs_match_hf(layout):
    data = _ragged(5, seed=1)
    out = layout["policy"].get_logprobs(data)["logprobs"]
    ref = hf_logprobs(_hf(layout["model_dir"]), data["input_ids"], data["input_lengths"])
    assert out.shape == (5, SEQ) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    print(f"logprobs max |err| vs HF: {_max_err(out, ref):.2e}")


def test_full_logits_loss_sees_the_original_vocab(layout):
    """eval mode: the full-logits path ([..., :301] of the gathered logits) and the
    vocab-parallel kernel path give the single-process loss."""
    data = _pg_batch(4, seed=3)
    kernel = float(layout["policy"].train(data, ClippedPGLossFn(PG_CFG), eval_mode=True)["loss"][0])
    full = float(layout["policy"].train(data, FullLogitsPG(PG_CFG), eval_mode=True)["loss"][0])
    ref = _reference_adamw(layout["model_dir"], layout["cfg"], [data], steps=False)[0][0]
    assert math.isclose(kernel, ref, rel_tol=1e-5, abs_tol=1e-6), (kernel, ref)
    assert math.isclose(full, ref, rel_tol=1e-5, abs_tol=1e-6), (full, ref)


def test_two_adamw_steps_match_single_process(layout):
    """Step 1 through the vocab-parallel kernel, step 2 through the full-logits path; the
    reference is plain single-process HF on the unpadded model (tp=1, dp=1)."""
    policy, cfg = layout["policy"], layout["cfg"]
    batches = [_pg_batch(4, seed=10 + i) for i in range(2)]
    ours = [policy.train(batches[0], ClippedPGLossFn(PG_CFG)), policy.train(batches[1], FullLogitsPG(PG_CFG))]
    ref_losses, ref_norms, ref_model = _reference_adamw(layout["model_dir"], cfg, batches)
    errs = []
    for step, (r, loss, norm) in enumerate(zip(ours, ref_losses, ref_norms, strict=True)):
        tol = 1e-5 if step == 0 else 1e-4
        assert math.isclose(float(r["loss"][0]), loss, rel_tol=tol, abs_tol=tol / 10), (step, r["loss"], loss)
        assert math.isclose(float(r["grad_norm"][0]), norm, rel_tol=tol), (step, r["grad_norm"], norm)
        errs.append((abs(float(r["loss"][0]) - loss) / abs(loss), abs(float(r["grad_norm"][0]) - norm) / norm))
    probe = _ragged(4, seed=20)
    after = policy.get_logprobs(probe)["logprobs"]
    expected = hf_logprobs(ref_model, probe["input_ids"], probe["input_lengths"])
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-4)
    print(f"rel err (loss, grad_norm) per step: {errs}; logprobs after: {_max_err(after, expected):.2e}")
    layout["state"]["probe"], layout["state"]["after"] = probe, after


def test_hf_export_has_the_original_vocab(layout, tmp_path):
    policy = layout["policy"]
    policy.save_hf_checkpoint(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == V
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    hidden = config["hidden_size"]
    assert shapes["model.embed_tokens.weight"] == (V, hidden)
    if layout["tied"]:
        assert config["tie_word_embeddings"] and shapes.get("lm_head.weight", (V, hidden)) == (V, hidden)
    else:
        assert shapes["lm_head.weight"] == (V, hidden)
    exported = _hf(tmp_path)
    if layout["tied"]:
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
    probe = layout["state"]["probe"]
    expected = hf_logprobs(exported, probe["input_ids"], probe["input_lengths"])
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], expected, rtol=0, atol=1e-5)
    print(f"export vs policy logprobs max |err|: {_max_err(policy.get_logprobs(probe)['logprobs'], expected):.2e}")
    layout["state"]["export"] = tmp_path
    # The refit manifest (vLLM side checks it against its own config) has HF shapes too.
    info = policy.prepare_refit_info()
    assert tuple(info["model.embed_tokens.weight"][0]) == (V, hidden)
    if layout["tied"]:  # a tied lm_head is not sent: the engine's receiver loads it from the embedding
        assert "lm_head.weight" not in info
    else:
        assert tuple(info["lm_head.weight"][0]) == (V, hidden)


def test_reference_swap_and_generate(layout):
    policy = layout["policy"]
    data = _ragged(4, seed=30)
    ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    initial = hf_logprobs(_hf(layout["model_dir"]), data["input_ids"], data["input_lengths"])
    torch.testing.assert_close(ref, initial, rtol=0, atol=1e-5)
    assert (policy.get_logprobs(data)["logprobs"] - ref).abs().max() > 1e-3  # the policy did move

    # HF generate on the (unpadded) replica: the greedy tokens of the exported model.
    from tests.generation.conftest import generated_rows, hf_greedy

    prompts = _ragged(3, seed=31)
    out = policy.generate(prompts, greedy=True)
    assert generated_rows(out, prompts) == hf_greedy(
        _hf(layout["state"]["export"]), prompts, layout["cfg"]["generation"]["max_new_tokens"]
    )


def test_padded_rows_stay_zero_and_dcp_roundtrip(layout, tmp_path):
    """The DCP checkpoint holds the padded training copy: its padded rows are exactly zero
    after training (no gradient, AdamW's decay of 0 is 0); loading it back restores the state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    policy, padded = layout["policy"], layout["padded"]
    policy.save_checkpoint(str(tmp_path / "weights"))
    dcp_to_torch_save(tmp_path / "weights", tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    names = ["model.embed_tokens.weight"] + ([] if layout["tied"] else ["lm_head.weight"])
    for name in names:
        assert state[name].shape[0] == padded, (name, state[name].shape)
        assert torch.count_nonzero(state[name][V:]) == 0, name
        assert torch.count_nonzero(state[name][:V]) > 0, name

    probe, saved = layout["state"]["probe"], policy.get_logprobs(layout["state"]["probe"])["logprobs"]
    policy.train(_pg_batch(4, seed=50), ClippedPGLossFn(PG_CFG))
    assert _max_err(policy.get_logprobs(probe)["logprobs"], saved) > 1e-4
    policy._all("load_checkpoint", str(tmp_path / "weights"))  # same layout
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], saved, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- config / preflight


def test_make_vocab_size_divisible_by_is_checked(v301_dirs):
    cfg = policy_config(v301_dirs["llama"], "torch_fsdp", make_vocab_size_divisible_by=64)
    with pytest.raises(
        ConfigError,
        match=r"policy.make_vocab_size_divisible_by: 64: the torch_fsdp \(FSDP1\) "
        "backend has no tensor parallelism",
    ):
        validate_policy_config(cfg)
    for bad in (0, -8):
        with pytest.raises(ConfigError, match=r"make_vocab_size_divisible_by: must be > 0"):
            validate_policy_config(policy_config(v301_dirs["llama"], "torch_dtensor", make_vocab_size_divisible_by=bad))
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by"):
        validate_policy_config(policy_config(v301_dirs["llama"], "torch_dtensor", make_vocab_size_divisible_by="8"))
    validate_policy_config(policy_config(v301_dirs["llama"], "torch_fsdp", make_vocab_size_divisible_by=1))
    validate_policy_config(policy_config(v301_dirs["llama"], "torch_dtensor", make_vocab_size_divisible_by=64))


def test_tp_no_longer_needs_to_divide_the_vocab():
    cfg = tiny_config("llama")
    cfg.vocab_size = V
    check_tensor_parallel_fits(cfg, 2, "policy.dtensor_cfg.tensor_parallel_size")
    cfg.num_key_value_heads = 3
    cfg.num_attention_heads = 3
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=3, num_key_value_heads=3"):
        check_tensor_parallel_fits(cfg, 2, "policy.dtensor_cfg.tensor_parallel_size")


def test_pad_vocab_in_process():
    """The padding helpers on one process: zero rows, ties kept, config untouched, padded
    logits at the dtype's lowest with zero gradient into the padded rows, export cut back."""
    from backends.torch_dtensor.vocab_padding import OriginalVocabLoss, mask_padded_logits, pad_vocab_, unpad_rows

    for tie in (False, True):
        cfg = tiny_config("llama")
        cfg.vocab_size, cfg.tie_word_embeddings = V, tie
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        before = model.get_input_embeddings().weight.detach().clone()
        assert pad_vocab_(model, 304) is not None
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert emb.weight.shape == head.weight.shape == (304, 64) and model.config.vocab_size == V
        assert (head.weight is emb.weight) == tie
        assert torch.equal(emb.weight[:V], before) and torch.count_nonzero(emb.weight[V:]) == 0
        ids = torch.randint(0, V, (2, 5))
        logits = model(input_ids=ids).logits
        assert logits.shape[-1] == 304 and (logits[..., V:] == torch.finfo(logits.dtype).min).all()
        torch.log_softmax(logits, -1).gather(-1, ids[..., None]).sum().backward()
        assert torch.count_nonzero(head.weight.grad[V:]) == 0 and torch.count_nonzero(emb.weight.grad[V:]) == 0
        assert unpad_rows(emb.weight, (V, 64)).shape == (V, 64)
    with pytest.raises(ValueError, match="config vocab_size=301 but the input embedding has 304 rows"):
        pad_vocab_(model, 304)  # already padded
    assert pad_vocab_(AutoModelForCausalLM.from_config(cfg), V) is None  # nothing to pad: no hook
    with pytest.raises(ValueError, match=r"does not fit its HF shape \(301, 32\)"):
        unpad_rows(torch.zeros(304, 64), (V, 32))
    plain = torch.zeros(1, 2, 304)
    assert (mask_padded_logits(plain, V)[..., V:] < -1e38).all() and mask_padded_logits(plain[..., :V], V) is not None
    seen = []
    wrapped = OriginalVocabLoss(lambda logits, *rest: seen.append(logits.shape) or (logits.sum(), {}), V)
    wrapped(plain, None, None, None)
    assert seen == [(1, 2, V)] and not hasattr(wrapped, "loss_from_logprobs")


# ----------------------------------------------------------------------------- reference


def _reference_adamw(model_dir, cfg, batches, steps: bool = True):
    """Plain single-process torch on the unpadded model: AdamW + LinearLR + global-norm
    clipping, one step per batch -> (losses, grad norms, model)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss_fn = ClippedPGLossFn(PG_CFG)
    kw = cfg["optimizer"]["kwargs"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=kw["lr"], weight_decay=kw["weight_decay"], betas=tuple(kw["betas"]), eps=kw["eps"]
    )
    sched = torch.optim.lr_scheduler.LinearLR(opt, **cfg["scheduler"][0]["kwargs"])
    losses, norms = [], []
    for data in batches:
        opt.zero_grad()
        mask = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
        logits = model(input_ids=data["input_ids"], attention_mask=mask).logits
        loss = loss_fn(logits, data, None, None)[0]
        losses.append(float(loss.detach()))
        if not steps:
            continue
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])))
        opt.step()
        sched.step()
    return losses, norms, model.eval()
