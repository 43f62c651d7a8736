"""The run's certificate: every check passes on a sound run, and each fails when the thing it checks is broken (a
wrong attention mask, a stale reference cache, a reference that is the policy itself); a FAIL stops the run with a
clear message unless `--certificate warn`, and the summary holds the checks with their figures."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file, save_file

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.training.loop import train


def config(tmp_path, model_dirs, name, **kw) -> TrainConfig:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_jsonl(data, easy_rows(16, seed=4))
    base = dict(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / name), device="cpu",
                max_steps=2, learning_rate=1e-3, per_device_train_batch_size=4, save_steps=0,
                disable_progress=True)
    return TrainConfig(**{**base, **kw})


def certificate(out) -> dict:
    cert = json.loads((out / "summary.json").read_text())["certificate"]
    return {c["name"]: c for c in cert["checks"]} | {"status": cert["status"], "seconds": cert["seconds"]}


@pytest.mark.parametrize("kw,reference", [({}, "the frozen copy"),
                                          ({"train_type": "lora"}, "adapters switched off"),
                                          ({"precompute_ref_log_probs": True}, "the precomputed table")])
def test_a_sound_run_passes_every_check(tmp_path, model_dirs, kw, reference):
    if kw.get("precompute_ref_log_probs"):
        kw["ref_cache_dir"] = str(tmp_path / "cache")
    train(config(tmp_path, model_dirs, "run", **kw), progress=False)
    c = certificate(tmp_path / "run")
    assert c["status"] == "PASS" and c["seconds"] >= 0
    parts = json.loads((tmp_path / "run" / "summary.json").read_text())["certificate"]["seconds_by_part"]
    assert {"fast_path", "plain_path", "reference_at_start", "reference_apart", "record"} <= set(parts)
    assert abs(sum(parts.values()) - c["seconds"]) < 0.01  # the stages account for the whole cost
    assert c["fast_path"]["status"] == "PASS" and c["fast_path"]["measured"] <= c["fast_path"]["tolerance"] == 1e-4
    assert c["head_float32"]["status"] == "PASS" and c["head_float32"]["measured"] <= 1e-5
    assert c["reference_at_start"]["status"] == "PASS" and reference in c["reference_at_start"]["detail"]
    assert c["reference_apart"]["status"] == "PASS" and c["reference_apart"]["measured"] > 0


def test_a_wrong_mask_fails_the_fast_path(tmp_path, model_dirs, monkeypatch):
    """Rejected tokens that may also see chosen (the packed mask's one rule broken): the packed log-probs leave the
    padded path's, and the run stops before its first update is kept."""
    from fastdpo.model import attention

    plain = attention.dense_mask

    def leaky(batch, window=None):
        mask = plain(batch, window)
        pid = batch.pair_ids
        causal = mask.new_ones(mask.shape[-2:], dtype=bool).tril()
        return mask | ((pid[:, None] == pid[None, :]) & causal)[None, None]

    monkeypatch.setattr(attention, "dense_mask", leaky)
    with pytest.raises(FastDPOError, match="certificate failed.*fast_path: FAIL"):
        train(config(tmp_path, model_dirs, "leaky"), progress=False)
    warned = train(config(tmp_path, model_dirs, "warned", certificate="warn"), progress=False)
    assert warned.summary["certificate"]["status"] == "FAIL"


def test_a_head_that_computes_something_else_fails(tmp_path, model_dirs, monkeypatch):
    """A log-prob head that is off (here: its logit scale by 2 %) gives the packed and the padded path the same
    wrong log-probs, so only the float32 head catches it."""
    from fastdpo.model import seqlogps

    real = seqlogps.token_logps

    def off(hidden, weight, targets, chunk=4096, scale=1.0, softcap=None, kernels=False):
        return real(hidden, weight, targets, chunk, scale * 1.02, softcap, kernels)

    monkeypatch.setattr(seqlogps, "token_logps", off)
    result = train(config(tmp_path, model_dirs, "off", certificate="warn"), progress=False)
    c = {x["name"]: x for x in result.summary["certificate"]["checks"]}
    assert c["fast_path"]["status"] == "PASS"
    assert c["head_float32"]["status"] == "FAIL" and c["head_float32"]["measured"] > 1e-3


def test_the_float32_head_is_log_softmax_in_float32():
    """The plain head the run's is held to, against log_softmax of the full float32 logits, soft-cap and scale
    included, across vocabulary chunks."""
    from fastdpo.training import certificate as cert

    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16, dtype=torch.bfloat16), torch.randn(50, 16, dtype=torch.bfloat16)
    targets = torch.randint(0, 50, (37,))
    old, cert.VOCAB_CHUNK = cert.VOCAB_CHUNK, 7
    try:
        got = cert.float32_token_logps(hidden, weight, targets, scale=0.5, softcap=3.0)
    finally:
        cert.VOCAB_CHUNK = old
    logits = 3.0 * torch.tanh(hidden.float() @ weight.float().T * 0.5 / 3.0)
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_stale_reference_cache_fails(tmp_path, model_dirs):
    """A cached table whose values no longer are the starting model's (edited, or written by other weights under
    the same key) is caught against the live forward."""
    cache = tmp_path / "cache"
    train(config(tmp_path, model_dirs, "first", precompute_ref_log_probs=True, ref_cache_dir=str(cache)),
          progress=False)
    (path,) = cache.glob("*.safetensors")
    table = load_file(str(path))
    table["logps"] = table["logps"] * 1.01
    save_file(table, str(path))
    with pytest.raises(FastDPOError, match="reference_at_start: FAIL.*the precomputed table"):
        train(config(tmp_path, model_dirs, "second", precompute_ref_log_probs=True, ref_cache_dir=str(cache)),
              progress=False)


def test_a_reference_that_is_the_policy_fails(tmp_path, model_dirs, monkeypatch):
    """A reference that follows the policy gives the loss ln 2 forever; after the first update its log-probs still
    equal the policy's, and the certificate says so."""
    from fastdpo.dpo.reference import Reference

    @torch.no_grad()
    def same(self, policy, batch, backend, mask=None):
        from fastdpo.model.seqlogps import completion_logps

        return completion_logps(policy, batch, backend, mask, prompt=False)

    monkeypatch.setattr(Reference, "logps", same)
    with pytest.raises(FastDPOError, match="reference_apart: FAIL.*follows the policy"):
        train(config(tmp_path, model_dirs, "self"), progress=False)


def test_the_last_check_waits_for_an_update_that_moves_the_weights(tmp_path, model_dirs):
    """A warm-up from 0 moves nothing at step 1: the check runs at the first update with a learning rate above 0;
    a run that never moves its weights says so instead of failing."""
    result = train(config(tmp_path, model_dirs, "warm", warmup_steps=2, max_steps=3), progress=False)
    c = {x["name"]: x for x in result.summary["certificate"]["checks"]}
    assert c["reference_apart"]["status"] == "PASS"
    result = train(config(tmp_path, model_dirs, "still", learning_rate=0.0), progress=False)
    c = {x["name"]: x for x in result.summary["certificate"]["checks"]}
    assert c["reference_apart"]["status"] == "SKIP" and "moved the weights" in c["reference_apart"]["detail"]


def test_off_writes_no_certificate(tmp_path, model_dirs):
    result = train(config(tmp_path, model_dirs, "off", certificate="off"), progress=False)
    assert "certificate" not in result.summary
    with pytest.raises(FastDPOError, match="--certificate"):
        config(tmp_path, model_dirs, "bad", certificate="maybe").validate()


def test_a_resumed_run_checks_its_first_step_against_the_checkpoint(tmp_path, model_dirs, monkeypatch):
    """A checkpoint records the pairs and log-probs of the step a resume runs first; the resumed run checks both:
    restored as saved, PASS; weights that were not restored as saved, FAIL."""
    from fastdpo.checkpoint import restore

    first = config(tmp_path, model_dirs, "run", max_steps=4, save_steps=2)
    train(first, progress=False)
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "state" / "trainer_state.json").read_text())
    assert len(state["certificate_next"]["indices"]) == 2 and state["certificate_next"]["tokens"] > 0

    resumed = train(TrainConfig(**{**first.to_dict(), "resume_from_checkpoint": str(tmp_path / "run" /
                                                                                      "checkpoint-2")}),
                    progress=False)
    c = {x["name"]: x for x in resumed.summary["certificate"]["checks"]}
    assert c["resumed_step"]["status"] == "PASS" and c["resumed_step"]["measured"] <= 1e-6
    assert c["reference_at_start"]["status"] == "SKIP"

    real = restore.load_weights

    def off_by_a_little(model, path):
        real(model, path)
        with torch.no_grad():
            next(model.parameters()).mul_(1.05)

    monkeypatch.setattr(restore, "load_weights", off_by_a_little)
    with pytest.raises(FastDPOError, match="resumed_step: FAIL"):
        train(TrainConfig(**{**first.to_dict(), "resume_from_checkpoint": str(tmp_path / "run" / "checkpoint-2")}),
              progress=False)


def test_the_certificate_counts_what_its_checks_cost_besides_seconds(tmp_path, model_dirs, monkeypatch):
    """summary.json's certificate says what its checks before the first update cost besides time: the full garbage
    collections that ran inside them (a collection planted in the padded path is counted), and on CUDA the
    allocator's new segments and retries (not on this CPU run)."""
    import gc

    from fastdpo.training import certificate as cert_module

    real = cert_module._plain_sums

    def collecting(s, pairs):
        gc.collect()
        return real(s, pairs)

    monkeypatch.setattr(cert_module, "_plain_sums", collecting)
    train(config(tmp_path, model_dirs, "run"), progress=False)
    costs = json.loads((tmp_path / "run" / "summary.json").read_text())["certificate"]["costs"]
    assert costs["gc_full_collections"] >= 1 and "cuda_alloc_retries" not in costs
