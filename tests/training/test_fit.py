"""`--gradient_checkpointing fit`, the default: activation bytes measured by region from one probe forward, each
policy's share of them, and the choice of the fastest policy (or a token budget) that fits a memory limit."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from fastdpo.config import RunPlan
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed
from fastdpo.model.memory import apply_checkpointing
from fastdpo.model.seqlogps import completion_logps
from fastdpo.training.fit import (
    ActivationBytes,
    GradBytes,
    backward_peak,
    choose_fit,
    fit_checkpointing,
    grad_bytes,
    largest_micro_batch,
    measure_activations,
)

GIB = 2**30


def tiny(layers=3):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    prepare_packed(model, Backend("dense"))
    return model


def saved_bytes(model, backend, tokens):
    """All bytes autograd keeps for one forward with grad under the model's current checkpointing (weights not
    counted, storages once)."""
    from model_helpers import saved_bytes as kept

    n = tokens
    pair = TokenizedPair(prompt=[5] * (n // 2), chosen=[6] * (n // 4), rejected=[7] * (n - n // 2 - n // 4), index=0)
    batch = make_batch([pair], backend, 0, torch.device("cpu"))
    model.train()
    return kept(model, lambda: completion_logps(model, batch, backend, build_mask(batch, backend)))


def test_regions_add_up_to_what_autograd_keeps_and_policies_keep_less():
    model, backend = tiny(), Backend("dense")
    act = measure_activations(model, backend, 0, torch.device("cpu"), tokens=256)
    assert act.mlp > 0 and act.layer > 0 and act.outside > 0 and act.layers == 3
    assert act.layer_input == 64 * 4  # hidden size x float32
    total = saved_bytes(model, backend, 256)
    assert act.per_token("none") * 256 == pytest.approx(total, rel=1e-6)
    assert act.per_token("none") > act.per_token("ffn") > act.per_token("full")


@pytest.mark.parametrize("policy", ["ffn", "full", "keep:1", "keep:2"])
def test_a_policy_estimate_bounds_what_autograd_keeps_under_it(policy):
    """What the checkpointed model really keeps (outer saves only: checkpointing keeps its inputs by reference) is
    below the estimate, and the estimate is not loose by more than the per-layer inputs and one layer's tensors."""
    model, backend = tiny(), Backend("dense")
    act = measure_activations(model, backend, 0, torch.device("cpu"), tokens=256)
    apply_checkpointing(model, policy)
    kept = saved_bytes(model, backend, 256) / 256
    slack = act.layers * act.layer_input + (act.mlp + act.layer) / act.layers
    assert kept <= act.per_token(policy) * 1.001
    assert kept >= act.per_token(policy) - slack


def pairs(*lengths):
    return [TokenizedPair(prompt=[5] * (n // 2), chosen=[6] * (n // 4), rejected=[7] * (n - n // 2 - n // 4), index=i)
            for i, n in enumerate(lengths)]


def test_the_planned_largest_micro_batch_is_the_largest_the_steps_form():
    """The run's steps cut as training cuts them: consecutive groups, budget bins, ranks' shares; never more than
    the largest any order could form."""
    from fastdpo.parallel.split import rank_micro_batches
    from fastdpo.training.fit import largest_planned_micro_batch

    ps = pairs(100, 900, 300, 700, 500, 200, 800, 400)
    steps = [ps[:4], ps[4:]]  # the two longest (900, 800) never share a step
    assert largest_planned_micro_batch(steps, 2, 0) == 1200  # (800, 400) in the second step; 900 + 800 never meet
    assert largest_planned_micro_batch(steps, 4, 0) == 2000  # each step whole: 100+900+300+700, 500+200+800+400
    assert largest_planned_micro_batch(steps, 4, 0) < largest_micro_batch(ps, 4, 0) == 2900
    assert largest_planned_micro_batch(steps, 4, 1000) == 1000  # bins under the budget
    assert largest_planned_micro_batch(steps, 4, 600) == 900  # a pair longer than the budget: its own micro-batch
    for budget in (0, 1000):  # two ranks: each rank's micro-batches are within the planned bound
        bound = largest_planned_micro_batch(steps, 2, budget, world=2)
        formed = [sum(p.num_tokens for p in g) for step in steps for rank in range(2)
                  for g in rank_micro_batches(step, rank, 2, budget, 2)]
        assert max(formed) == bound


def test_the_plan_follows_the_trainer_s_steps_over_epochs(tmp_path, model_dirs):
    """The tensor plan over the run's seeded order equals the largest micro-batch of the steps `Trainer.next_pairs`
    takes (2.5 shuffled epochs with a short last step each), and bounds it under a budget and over ranks."""
    from train_helpers import two_step_config

    from fastdpo.training.fit import largest_planned_micro_batch, planned_largest_micro_batch
    from fastdpo.training.trainer import Trainer

    trainer = Trainer(two_step_config(tmp_path, model_dirs("qwen3"), "steps", num_train_epochs=2.5, max_steps=0,
                                      shuffle=True, per_device_train_batch_size=3, gradient_accumulation_steps=2))
    s, cfg = trainer.s, trainer.cfg
    assert len(s.pairs) % trainer.pairs_per_step  # a short last step in each epoch
    taken = []
    for step in range(s.total_steps):
        trainer.global_step = step
        taken.append(trainer.next_pairs())

    def plan(budget, world):
        return planned_largest_micro_batch(s.pairs, trainer.pairs_per_step, 3, budget, world, cfg.seed, cfg.shuffle,
                                           s.total_steps, s.steps_per_epoch)

    exact = largest_planned_micro_batch(taken, 3, 0)
    assert plan(0, 1) == exact
    others = {planned_largest_micro_batch(s.pairs, trainer.pairs_per_step, 3, 0, 1, seed, True, s.total_steps,
                                          s.steps_per_epoch) for seed in range(cfg.seed + 1, cfg.seed + 9)}
    assert others != {exact}  # the order matters: other seeds plan other micro-batches
    for budget, world in ((40, 1), (0, 2), (40, 2)):
        assert plan(budget, world) >= largest_planned_micro_batch(taken, 3, budget, world)
    assert plan(0, 2) <= largest_micro_batch(s.pairs, 3, 0)


def test_largest_micro_batch():
    ps = pairs(100, 900, 300, 700, 500)
    assert largest_micro_batch(ps, 2, 0) == 1600  # the two longest together
    assert largest_micro_batch(ps, 8, 0) == 2500
    assert largest_micro_batch(ps, 2, 4096) == 4096 and largest_micro_batch(ps, 2, 512) == 900


def test_choose_fit_picks_the_fastest_that_fits_then_a_budget(caplog):
    act = ActivationBytes(mlp=480_000, layer=800_000, outside=2_000, layer_input=4_000, layers=20)
    per = {p: act.per_token(p) for p in ("none", "ffn", "full")}
    static, head, tokens = 10 * GIB, GIB, 100_000

    def limit_for(policy):  # just enough for `policy` at `tokens`
        return int(static + head + per[policy] * tokens * 1.10 + GIB / 2) + 1

    assert choose_fit(act, static, head, limit_for("none"), tokens, 0, 2000).policy == "none"
    # just short of none: all layers but two keep their activations (keep:19 would hold one layer's input more than
    # none, while its one recomputed layer runs), which recomputes less than ffn's every MLP
    assert choose_fit(act, static, head, limit_for("none") - 2, tokens, 0, 2000, ffn_share=0.6).policy == "keep:18"
    assert choose_fit(act, static, head, limit_for("full"), tokens, 0, 2000).policy == "full"
    fit = choose_fit(act, static, head, limit_for("full") - GIB, tokens, 0, 2000)
    assert fit.policy == "full" and 2000 <= fit.budget < tokens and fit.budget % 256 == 0
    assert static + head + per["full"] * fit.budget * 1.10 + GIB / 2 <= limit_for("full") - GIB
    fit = choose_fit(act, static, head, int(static * 1.2), tokens, 0, 90_001)  # not even the longest pair: warned
    assert fit.policy == "full" and fit.budget == 90_112
    assert "longest pair (90001 tokens) is estimated to need" in caplog.text


def test_keep_takes_the_most_layers_that_fit_and_ffn_serves_when_it_recomputes_less():
    act = ActivationBytes(mlp=480_000, layer=800_000, outside=2_000, layer_input=4_000, layers=20)
    static, head, tokens = 10 * GIB, GIB, 100_000

    def peak(policy):
        return static + head + act.per_token(policy) * tokens * 1.10 + GIB / 2

    assert act.per_token("keep:20") == act.per_token("none") and act.per_token("full") < act.per_token("keep:1")
    for n in (1, 7, 13):
        limit = int(peak(f"keep:{n}")) + 1
        fit = choose_fit(act, static, head, limit, tokens, 0, 2000, ffn_share=0.6)
        assert fit.policy == f"keep:{n}" and fit.estimates_gib[f"keep:{n}"] <= limit / GIB + 0.05, fit
        assert peak(f"keep:{n + 1}") > limit
    # ffn fits here, and keeps fewer layers' worth than keep:N would need: the cheaper recompute wins either way
    limit = int(peak("ffn")) + 1
    kept = max(n for n in range(1, 20) if peak(f"keep:{n}") <= limit)
    assert choose_fit(act, static, head, limit, tokens, 0, 2000, ffn_share=0.2).policy == "ffn"
    assert choose_fit(act, static, head, limit, tokens, 0, 2000, ffn_share=0.99).policy == f"keep:{kept}"


def test_the_backward_walks_the_layers_writing_gradients_as_it_frees_activations():
    """Two layers by hand (per token, one token, no margin): outside 1, each layer keeps 2 (none) or its input 0.5
    and recomputes 2 (full), a workspace of one layer's 2; gradients 10 outside and 5 per layer."""
    act = ActivationBytes(mlp=2, layer=2, outside=1, layer_input=0.5, layers=2)
    grads = GradBytes(outside=10, layers=[5, 5])
    # none: last layer 10 + (1 + 2 + 2) + 2 = 17; first 15 + (1 + 2) + 2 = 20, as the end holds
    assert backward_peak(act, grads, "none", 1, margin=1.0) == 20
    # full: last layer 10 + (1 + 0.5 + 0.5) + 2 + 2 = 16; first 15 + (1 + 0.5) + 2 + 2 = 20.5
    assert backward_peak(act, grads, "full", 1, margin=1.0) == 20.5
    assert backward_peak(act, grads, "keep:1", 1, margin=1.0) == 20.5  # the first layer is recomputed last
    # with many tokens the activations dominate: the start of the backward, with the outside gradients only
    assert backward_peak(act, grads, "none", 1000, margin=1.0) == 10 + 1000 * (1 + 4 + 2)
    # the head's float32 sum comes first, beside every activation; a tied embedding's second gradient comes last
    head = GradBytes(outside=10, layers=[5, 5], head_accumulator=40, tied_embedding=3)
    assert backward_peak(act, head, "none", 1, margin=1.0) == 10 + 40 + (1 + 4)
    small = ActivationBytes(mlp=0, layer=0, outside=0, layer_input=0, layers=2)
    assert backward_peak(small, head, "full", 1, margin=1.0) == 10 + 40
    assert backward_peak(small, GradBytes(10, [5, 5], 0, 3), "full", 1, margin=1.0) == 20 + 3


@pytest.mark.parametrize("policy", ["none", "ffn", "full", "keep:3", "keep:17"])
def test_the_backward_peak_is_below_counting_gradients_and_activations_together(policy):
    act = ActivationBytes(mlp=480_000, layer=800_000, outside=2_000, layer_input=4_000, layers=20)
    grads = GradBytes(outside=600_000_000, layers=[100_000_000] * 20)
    tokens, one_layer = 12_000, (480_000 + 800_000) / 20
    peak = backward_peak(act, grads, policy, tokens)
    together = grads.total + 1.10 * tokens * (act.per_token(policy) + act.mlp / 20 + one_layer)
    kept = sum(k for k, _ in act.by_layer(policy))
    assert grads.total <= peak < together
    assert peak >= grads.outside + 1.10 * tokens * (act.outside + kept)  # the backward's start
    assert len(act.by_layer(policy)) == 20


def test_one_micro_batch_per_step_keeps_more_layers_under_the_same_limit():
    act = ActivationBytes(mlp=480_000, layer=800_000, outside=2_000, layer_input=4_000, layers=20)
    grads = GradBytes(outside=600_000_000, layers=[150_000_000] * 20)  # 3.6 GB of gradients inside `static`
    static, head, tokens = 10 * GIB + grads.total, GIB, 12_000
    limit = int(static + head + act.per_token("keep:4") * tokens * 1.10 + GIB / 2) + 1
    together = choose_fit(act, static, head, limit, tokens, 0, 2000, ffn_share=0.9)
    walked = choose_fit(act, static, head, limit, tokens, 0, 2000, ffn_share=0.9, grads=grads)
    assert together.policy == "keep:4"
    assert walked.policy == "none" or int(walked.policy.split(":")[1]) > 4
    assert walked.estimates_gib["full"] < together.estimates_gib["full"]


def test_fit_walks_the_backward_only_for_one_micro_batch_per_step_under_a_named_limit(monkeypatch):
    from fastdpo.config import TrainConfig
    from fastdpo.training import fit as fit_module

    seen = []
    real = fit_module.choose_fit
    monkeypatch.setattr(fit_module, "choose_fit", lambda *a, **k: seen.append(a[8]) or real(*a, **k))  # grads
    ps = pairs(*[400] * 16)

    def grads_given(default_limit=False, world=1, **kw):
        seen.clear()
        cfg = TrainConfig(model="m", dataset=["d"], per_device_train_batch_size=8, **kw)
        m = tiny()
        fit_module.resolve_fit(cfg, RunPlan.of(cfg), m, Backend("dense"), ps, torch.device("cpu"), 0, 64 * GIB, 0,
                               default_limit=default_limit, world=world)
        return seen[0]

    given = grads_given()
    assert isinstance(given, GradBytes) and given.total == grad_bytes(tiny()).total
    assert given.outside == 512 * 64 * 4 + 64 * 4  # the tied embedding and the final norm, float32
    assert len(given.layers) == 3 and given.total == sum(p.numel() * 4 for p in tiny().parameters())
    assert given.head_accumulator == given.tied_embedding == 512 * 64 * 4  # tied: the head is the embedding
    assert grads_given(gradient_accumulation_steps=2) is None
    assert grads_given(max_tokens_per_batch=1024) is None
    assert grads_given(default_limit=True) is None
    assert grads_given(world=2) is None


def test_keep_checkpoints_all_layers_but_the_last_n_and_bad_values_are_refused():
    from fastdpo.config import TrainConfig
    from fastdpo.errors import FastDPOError

    model = tiny(layers=4)
    assert apply_checkpointing(model, "keep:1") == ["layers.0", "layers.1", "layers.2"]
    assert apply_checkpointing(model, "keep:4") == [] and apply_checkpointing(model, "keep:9") == []
    assert apply_checkpointing(model, "full") == [f"layers.{i}" for i in range(4)]
    TrainConfig(model="m", dataset=["d"], gradient_checkpointing="keep:3").validate()
    for bad in ("keep:0", "keep:x", "keep:"):
        with pytest.raises(FastDPOError, match="keep:N"):
            TrainConfig(model="m", dataset=["d"], gradient_checkpointing=bad).validate()


def test_the_ffn_recompute_share_comes_from_the_layer_s_projections():
    from fastdpo.training.fit import ffn_recompute_share

    # Qwen3 tiny: q 64x64, k and v 32x64, o 64x64, gate and up 256x64 (down left out): 2*16384 / (12288 + 32768)
    assert ffn_recompute_share(tiny()) == pytest.approx(32768 / (64 * 64 * 2 + 32 * 64 * 2 + 32768))


def test_fit_is_no_checkpointing_off_cuda():
    from fastdpo.config import TrainConfig

    cfg = TrainConfig(model="m", dataset=["d"])
    assert cfg.gradient_checkpointing == "fit"
    cfg.validate()
    plan = RunPlan.of(cfg)
    fit_checkpointing(cfg, plan, tiny(), Backend("dense"), pairs(100), torch.device("cpu"), 0, None)
    assert plan.gradient_checkpointing == "none" and cfg.gradient_checkpointing == "fit"


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_estimate_bounds_the_measured_peak_on_cuda(accumulate, caplog):
    """On CUDA the chosen policy's estimated peak is at or above the steps' measured peak, and within 1.5 GiB of it:
    one micro-batch per step (the backward walked layer by layer) and two (gradients beside the second)."""
    import logging
    import re

    from fastdpo.config import TrainConfig
    from fastdpo.data.anchor import anchor_pairs, anchor_tokenizer
    from fastdpo.data.load import Row
    from fastdpo.data.prepare import DataOptions, tokenize_pairs
    from fastdpo.training.setup import assemble
    from fastdpo.training.trainer import Trainer

    torch.manual_seed(0)
    cfg_model = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg_model, dtype=torch.bfloat16, attn_implementation="sdpa")
    tok = anchor_tokenizer()
    rows = anchor_pairs(16)
    cfg = TrainConfig(model="m", dataset=["d"], per_device_train_batch_size=8 // accumulate,
                      gradient_accumulation_steps=accumulate, max_steps=2, max_memory_gib=6.0)
    ps, _ = tokenize_pairs([Row(r["prompt"], r["chosen"], r["rejected"], str(i)) for i, r in enumerate(rows)], tok,
                           DataOptions.for_scoring(cfg))
    torch.cuda.reset_peak_memory_stats()
    with caplog.at_level(logging.INFO, logger="fastdpo"):
        trainer = Trainer(cfg, assemble(cfg, torch.device("cuda"), model, tok, ps))
    chosen = trainer.plan.gradient_checkpointing
    assert chosen in ("none", "ffn", "full") or chosen.startswith("keep:"), chosen
    estimate = float(re.search(rf"{re.escape(chosen)} ~([0-9.]+) GiB", caplog.text).group(1))
    trainer.step(ps[:8])
    trainer.step(ps[8:16])
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() / GIB
    assert measured <= 6.0 and measured <= estimate + 0.05, (chosen, estimate, measured)
    assert estimate - measured < 1.5, (chosen, estimate, measured)  # the margin and headroom: about 1.2 GiB


def test_resolve_fit_switches_to_lean_layers_and_splits_budgets_over_a_group():
    """With room, no checkpointing and the plain layers; short of memory, the lean layers (measured again) and a
    budget; under sequence parallelism each rank holds 1/N of a micro-batch, and FSDP2 shards the static bytes."""
    from fastdpo.config import TrainConfig
    from fastdpo.training.fit import resolve_fit

    ps = pairs(*[400] * 16)
    cpu = torch.device("cpu")

    def run(limit, static=0, shards=1, split=1, default_limit=False, **kw):
        cfg = TrainConfig(model="m", dataset=["d"], per_device_train_batch_size=8, **kw)
        m = tiny()
        plan = RunPlan.of(cfg)
        resolve_fit(cfg, plan, m, Backend("dense"), ps, cpu, 0, limit, static, shards, split, default_limit)
        lean = "forward" in m.model.layers[0].mlp.__dict__
        return plan, lean

    roomy, lean = run(64 * GIB)
    assert roomy.gradient_checkpointing == "none" and roomy.max_tokens_per_batch == 0 and not lean
    tight, lean = run(int(0.5 * GIB + 2 * 1024 * 512 * 4 + 2_000_000))
    assert lean and tight.gradient_checkpointing in ("ffn", "full")
    if tight.gradient_checkpointing == "full" and tight.max_tokens_per_batch:
        assert tight.max_tokens_per_batch >= 400
    # the same tight limit with the micro-batch split over 4 ranks needs less of each
    split, _ = run(int(0.5 * GIB + 2 * 1024 * 512 * 4 + 2_000_000), split=4)
    order = ["none", "ffn", "full"]
    assert order.index(split.gradient_checkpointing) <= order.index(tight.gradient_checkpointing)
    # FSDP2 over 8 ranks: 8 GiB of weights and states is 1 GiB per rank
    assert run(2 * GIB, static=8 * GIB, shards=8)[0].gradient_checkpointing == "none"
    # the default limit: the same roomy GPU, but activations may take only about the weights' size (tiny here)
    default, lean = run(64 * GIB, default_limit=True)
    assert default.gradient_checkpointing == "full" and lean


def test_the_probe_leaves_the_random_state_as_it_found_it():
    model = tiny()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # the dense path's SDPA then draws dropout masks
    torch.manual_seed(3)
    before = torch.get_rng_state()
    measure_activations(model, Backend("dense"), 0, torch.device("cpu"), tokens=64)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_trained_vision_tower_s_activations_move_the_choice():
    """The largest micro-batch's images, through a trained vision tower, count beside the language model's tokens:
    what fits without checkpointing for text alone needs checkpointing with them (which also checkpoints the
    tower's blocks, keeping far less per pixel)."""
    act = ActivationBytes(mlp=480_000, layer=800_000, outside=2_000, layer_input=4_000, layers=20,
                          vision_kept=400.0, vision_checkpointed=20.0)
    static, head, tokens, pixels = 10 * GIB, GIB, 10_000, 20_000_000
    limit = int(static + head + act.per_token("none") * tokens * 1.10 + GIB / 2) + 1
    assert choose_fit(act, static, head, limit, tokens, 0, 2000).policy == "none"
    fit = choose_fit(act, static, head, limit, tokens, 0, 2000, pixels=pixels)
    assert fit.policy != "none" and fit.estimates_gib["none"] > limit / GIB
    assert act.vision("none", pixels) == 400.0 * pixels and act.vision("keep:3", pixels) == 20.0 * pixels
