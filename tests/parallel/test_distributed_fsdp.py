"""FSDP2 on two CPU ranks (gloo): same weights as one rank, a sharded checkpoint resumed on one rank, a consolidated
`final/`, and LoRA with the adapters-off reference and a step-sorting loss under --deepspeed zero2."""

import pytest
from data_helpers import easy_rows, write_jsonl
from dist_helpers import BASE, assert_weights_close, dataset, metrics, run_ranks, weights
from safetensors.torch import load_file

from fastdpo.config import TrainConfig
from fastdpo.training.loop import train


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, model_dirs):
    """FSDP2 full_shard with a token budget (uneven micro-batch counts per rank), checkpoint and evaluation at step
    3 (and at the end, step 6); and one rank."""
    tmp = tmp_path_factory.mktemp("fsdp")
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp))], **BASE)
    held_out = dict(val_dataset=[str(write_jsonl(tmp / "val.jsonl", easy_rows(7, seed=5)))], eval_steps=3)
    run_ranks(2, output_dir=str(tmp / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_tokens_per_batch=40, save_steps=3, fsdp="full_shard", **held_out, **common)
    one = TrainConfig(output_dir=str(tmp / "ws1"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      save_steps=3, **held_out, **common)
    train(one, progress=False)
    return tmp, one, common


def test_fsdp_two_ranks_match_one_rank(fsdp):
    from transformers import AutoModelForCausalLM

    tmp, _, _ = fsdp
    assert_weights_close(weights(tmp / "ws2"), weights(tmp / "ws1"), atol=1e-5)  # same tensors: tied head not doubled
    two, one = (train_rows(tmp / d) for d in ("ws2", "ws1"))
    assert len(two) == len(one) == 6
    for x, y in zip(two, one):
        for key in ("loss", "rewards/margins", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
    # the busiest rank's token positions, times two ranks, against the pairs' own: never below them (the ranks'
    # shares differ, and a rank without a pair in the step runs a zero-weight one); one process runs exactly the
    # pairs' tokens
    assert all(r["batch/padding"] >= 0 for r in two) and any(r["batch/padding"] > 0 for r in two)
    assert all(r["batch/padding"] == 0 for r in one)
    assert [r["batch/micro_batches"] for r in one][:5] == [2] * 5
    model = AutoModelForCausalLM.from_pretrained(tmp / "ws2" / "final")  # final/ is an ordinary HF dir
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_fsdp_evaluates_held_out_pairs_like_one_rank(fsdp):
    """Every rank scores the held-out pairs through the sharded model, after a step whose update was followed by a
    checkpoint: the same numbers as one process, at step 3 and at the end."""
    tmp, _, _ = fsdp
    two, one = ([r for r in metrics(tmp / d) if "eval_loss" in r] for d in ("ws2", "ws1"))
    assert [r["step"] for r in two] == [r["step"] for r in one] == [3, 6]
    for x, y in zip(two, one):
        for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/chosen", "eval_logps/rejected"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
    assert two[0]["eval_loss"] != two[1]["eval_loss"]  # the policy moved between the evaluations


def train_rows(out) -> list[dict]:
    return [r for r in metrics(out) if "loss" in r]


def test_fsdp_checkpoint_resumes_on_one_rank(fsdp):
    tmp, one, _ = fsdp
    ck = tmp / "ws2" / "checkpoint-3"
    assert (ck / "sharded" / "__0_0.distcp").is_file() and (ck / "sharded" / "__1_0.distcp").is_file()
    resumed = TrainConfig(**{**one.to_dict(), "output_dir": str(tmp / "resumed"), "resume_from_checkpoint": str(ck),
                             "save_steps": 0})
    train(resumed, progress=False)
    assert_weights_close(weights(tmp / "resumed"), weights(tmp / "ws2"), atol=1e-6)


def test_one_rank_checkpoint_resumes_on_two_fsdp_ranks(fsdp):
    tmp, _, common = fsdp
    run_ranks(2, output_dir=str(tmp / "scaled"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              fsdp="full_shard", resume_from_checkpoint=str(tmp / "ws1" / "checkpoint-3"), **common)
    assert_weights_close(weights(tmp / "scaled"), weights(tmp / "ws1"), atol=1e-5)
    assert [r["step"] for r in metrics(tmp / "scaled")] == [4, 5, 6]


def test_fsdp_full_checkpointing_two_ranks_match_one_rank(fsdp, tmp_path):
    """Full activation checkpointing recomputes each decoder layer in backward, which runs the layer's forward hooks
    again inside a unit of two layers; the weights must still be those of one rank without checkpointing."""
    tmp, _, common = fsdp
    run_ranks(2, output_dir=str(tmp_path / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_tokens_per_batch=40, fsdp="full_shard", gradient_checkpointing="full", **common)
    assert_weights_close(weights(tmp_path / "ws2"), weights(tmp / "ws1"), atol=1e-5)


def test_zero2_full_two_ranks_match_one_rank(fsdp, tmp_path):
    """shard_grad_op keeps the weights gathered through a step's micro-batches (several per rank here: a token
    budget and accumulation) and shards them again for the optimizer: the weights must stay those of one rank, so
    no micro-batch may run on weights gathered before the last update."""
    tmp, _, common = fsdp
    run_ranks(2, output_dir=str(tmp_path / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_tokens_per_batch=40, fsdp="shard_grad_op", **common)
    assert_weights_close(weights(tmp_path / "ws2"), weights(tmp / "ws1"), atol=1e-5)
    for x, y in zip(metrics(tmp_path / "ws2"), train_rows(tmp / "ws1"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), x["step"]


def test_zero2_lora_two_ranks_match_one_rank(tmp_path, model_dirs):
    """LoRA with the adapters-off reference through the sharded module, and aot, which ranks pairs over the whole
    step: the ranks gather the step's log-ratios before any backward."""
    common = dict(model=str(model_dirs("llama")), dataset=[str(dataset(tmp_path))], train_type="lora",
                  lora_rank=4, lora_alpha=8, lora_dropout=0.0, loss_type="aot", **BASE)
    run_ranks(2, output_dir=str(tmp_path / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              deepspeed="zero2", **common)
    train(TrainConfig(output_dir=str(tmp_path / "ws1"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      **common), progress=False)
    a, b = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("ws2", "ws1"))
    assert_weights_close(a, b, atol=1e-5)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in a.items())
    assert metrics(tmp_path / "ws2")[-1]["rewards/margins"] == pytest.approx(
        metrics(tmp_path / "ws1")[-1]["rewards/margins"], rel=1e-4)


def test_fsdp_bf16_stochastic_rounding_shards_and_resumes(tmp_path, model_dirs):
    """bf16 weights: fastdpo's AdamW runs on each rank's DTensor shard, its moments are saved sharded, and the
    checkpoint resumes on one rank; the result stays within bf16 rounding of the two-rank run."""
    common = dict(model=str(model_dirs("qwen3")), dataset=[str(dataset(tmp_path))], torch_dtype="bfloat16", **BASE)
    run_ranks(2, output_dir=str(tmp_path / "ws2"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              save_steps=3, fsdp="full_shard", **common)
    one = TrainConfig(output_dir=str(tmp_path / "resumed"), per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, resume_from_checkpoint=str(tmp_path / "ws2" / "checkpoint-3"),
                      **common)
    train(one, progress=False)
    a, b = weights(tmp_path / "ws2"), weights(tmp_path / "resumed")
    assert all(v.dtype.is_floating_point for v in a.values())
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < 2e-2, worst  # a few bf16 spacings: the rounding noise of shards and of whole tensors differ
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == [4, 5, 6]


def test_zero2_keeps_weights_gathered_through_a_step(model_dirs):
    """shard_grad_op (ZeRO-2) gathers the weights once per optimizer step: after the backward of a micro-step that is
    not the step's last they stay whole (plain tensors, not shards), and the last one shards them again for the
    optimizer. (full_shard: `test_full_shard_keeps_the_first_unit_and_root_gathered_between_micro_steps`.)"""
    mode = "shard_grad_op"
    import torch
    import torch.distributed as dist
    from data_helpers import random_pairs
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import grad_sync, wrap_models

    model = AutoModelForCausalLM.from_pretrained(model_dirs("qwen3"))
    backend = Backend("dense")
    prepare_packed(model, backend)
    plan = parallel_plan(mode, "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = wrap_models(model, Reference("precompute"), backend, d)
        batch = make_batch(random_pairs(3, model.config.vocab_size), backend, 0, torch.device("cpu"))
        layer = model.model.layers[0].mlp.up_proj.weight
        sharded = []
        for last in (False, False, True):
            with grad_sync(policy, last, keep_gathered=d.keeps_gathered):
                sums, *_ = policy(batch, build_mask(batch, backend))
                sums.sum().backward()
            sharded.append(isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor))
        assert isinstance(layer, DTensor)  # the registered parameter is the shard
        assert sharded == [False, False, True]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reference", ["precompute", "copy"])
def test_full_shard_keeps_last_unit_and_root_gathered_into_backward(model_dirs, reference):
    """full_shard frees a unit's gathered weights after its forward and gathers them again for its backward, except
    where the backward needs them at once: the last decoder unit and the root (embeddings, head) stay whole from the
    forward into the backward, which shards them again. A forward-only reference frees all of its units."""
    import torch
    import torch.distributed as dist
    from data_helpers import random_pairs
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import build_mask, make_batch
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import wrap_models

    config, model, backend = five_layer_qwen3(model_dirs)
    ref = Reference(reference, AutoModelForCausalLM.from_config(config) if reference == "copy" else None)
    plan = parallel_plan("full_shard", "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, layers_per_unit=2)  # units: layers 0-1, 2-3, 4

    def whole(m):  # which of layer 0 (first unit), layer 4 (last unit) and the embeddings (root) are not shards
        return [not isinstance(w, DTensor) for w in (m.model.layers[0].mlp.up_proj.weight,
                                                     m.model.layers[4].mlp.up_proj.weight,
                                                     m.model.embed_tokens.weight)]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = wrap_models(model, ref, backend, d)
        batch = make_batch(random_pairs(3, config.vocab_size), backend, 0, torch.device("cpu"))
        mask = build_mask(batch, backend)
        if reference == "copy":
            ref.logps(None, batch, backend, mask)
            assert whole(ref.model) == [False, False, False]
        sums, *_ = policy(batch, mask)
        assert whole(model) == [False, True, True]
        sums.sum().backward()
        assert whole(model) == [False, False, False]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["full_shard", "shard_grad_op", "reference"])
def test_each_forward_gathers_the_next_unit_as_it_opens(mode, model_dirs):
    """FSDP2 issues a unit's gather as the unit before it opens its forward (the root: the first unit's), not when the
    host reaches the unit itself: the first decoder layer of each unit starts only after the next unit's gather was
    issued. The same for the policy under full_shard and shard_grad_op and for a sharded forward-only reference."""
    import torch
    import torch.distributed as dist
    from data_helpers import random_pairs
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import build_mask, make_batch
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import wrap_models

    config, model, backend = five_layer_qwen3(model_dirs)
    ref = Reference("copy", AutoModelForCausalLM.from_config(config)) if mode == "reference" else Reference("precompute")
    plan = parallel_plan("shard_grad_op" if mode == "shard_grad_op" else "full_shard", "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, layers_per_unit=2)  # units: layers 0-1, 2-3, 4
    events, unshard = [], FSDPParamGroup.unshard

    def record(group, *args, **kwargs):
        if not group.is_unsharded and group._all_gather_result is None:  # a gather is issued
            events.append(("gather", group.fsdp_params[0]._param_fqn))
        return unshard(group, *args, **kwargs)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    FSDPParamGroup.unshard = record
    try:
        policy = wrap_models(model, ref, backend, d)
        watched = ref.model if mode == "reference" else model
        for i in (0, 2, 4):
            watched.model.layers[i].register_forward_pre_hook(lambda m, a, i=i: events.append(("forward", i)))
        batch = make_batch(random_pairs(3, config.vocab_size), backend, 0, torch.device("cpu"))
        mask = build_mask(batch, backend)
        if mode == "reference":
            ref.logps(None, batch, backend, mask)
        else:
            policy(batch, mask)
    finally:
        FSDPParamGroup.unshard = unshard
        dist.destroy_process_group()
    gathered = [next((k for k, e in enumerate(events) if e[0] == "gather" and f"layers.{i}." in e[1]), None)
                for i in (0, 2, 4)]
    started = [events.index(("forward", i)) for i in (0, 2, 4)]
    assert None not in gathered, events
    assert gathered[1] < started[0] and gathered[2] < started[1], events  # the next unit's gather came first


def test_full_shard_keeps_the_first_unit_and_root_gathered_between_micro_steps(model_dirs):
    """full_shard (ZeRO-3) frees a unit's gathered weights after its backward, except, between an optimizer step's
    micro-steps, the two that the next forward opens with: the root (embeddings, head) and the first decoder unit.
    The middle and last units are shards after every backward; the step's last backward shards everything for the
    optimizer."""
    import torch
    import torch.distributed as dist
    from data_helpers import random_pairs
    from torch.distributed.tensor import DTensor

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import build_mask, make_batch
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import grad_sync, wrap_models

    config, model, backend = five_layer_qwen3(model_dirs)
    plan = parallel_plan("full_shard", "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, layers_per_unit=2)  # units: layers 0-1, 2-3, 4

    def whole():  # layer 0 (first unit), layer 2 (middle unit), layer 4 (last unit), embeddings (root)
        return [not isinstance(w, DTensor) for w in (model.model.layers[0].mlp.up_proj.weight,
                                                     model.model.layers[2].mlp.up_proj.weight,
                                                     model.model.layers[4].mlp.up_proj.weight,
                                                     model.model.embed_tokens.weight)]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = wrap_models(model, Reference("precompute"), backend, d)
        seen = []
        for step in range(2):
            for last in (False, False, True):
                batch = make_batch(random_pairs(3, config.vocab_size, seed=step), backend, 0, torch.device("cpu"))
                with grad_sync(policy, last, keep_gathered=d.keeps_gathered):
                    sums, *_ = policy(batch, build_mask(batch, backend))
                    sums.sum().backward()
                seen.append(whole())
        between, end = [True, False, False, True], [False, False, False, False]
        assert seen == [between, between, end] * 2
    finally:
        dist.destroy_process_group()


def test_full_shard_gathers_the_step_start_after_the_update(model_dirs):
    """full_shard: after an update, `gather_step_start` gathers the root and the first decoder unit (what a step's
    first forward opens with) before that forward; the forward then computes exactly what it computes without it, and
    the step's last backward shards everything again. (One rank: the values of a real two-rank gather are checked by
    the two-rank runs against one rank.)"""
    import copy

    import torch
    import torch.distributed as dist
    from data_helpers import random_pairs
    from torch.distributed.tensor import DTensor

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import build_mask, make_batch
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import gather_step_start, grad_sync, wrap_models

    config, model, backend = five_layer_qwen3(model_dirs)
    twin = copy.deepcopy(model)
    plan = parallel_plan("full_shard", "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, layers_per_unit=2)  # units: layers 0-1, 2-3, 4

    def whole(m):  # layer 0 (first unit), layer 2 (middle unit), layer 4 (last unit), embeddings (root)
        return [not isinstance(w, DTensor) for w in (m.model.layers[0].mlp.up_proj.weight,
                                                     m.model.layers[2].mlp.up_proj.weight,
                                                     m.model.layers[4].mlp.up_proj.weight,
                                                     m.model.embed_tokens.weight)]

    def step(policy, seed):
        batch = make_batch(random_pairs(3, config.vocab_size, seed=seed), backend, 0, torch.device("cpu"))
        with grad_sync(policy, True, keep_gathered=d.keeps_gathered):
            sums, *_ = policy(batch, build_mask(batch, backend))
            sums.sum().backward()
        return sums.detach()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs, counts = [], []
        for m, early in ((model, True), (twin, False)):
            policy = wrap_models(m, Reference("precompute"), backend, d)
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            step(policy, 0)  # one step with an update: the next step's gathers must see the updated shards
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert whole(m) == [False, False, False, False]
            handles = gather_step_start(policy) if early else []
            counts.append(len(handles))
            for h in handles:
                h.wait()
            assert whole(m) == ([True, False, False, True] if early else [False] * 4)
            runs.append((step(policy, 1), {n: p.grad.full_tensor() for n, p in m.named_parameters()}))
            assert whole(m) == [False, False, False, False]
        assert counts == [2, 0] and torch.equal(runs[0][0], runs[1][0])
        assert runs[0][1].keys() == runs[1][1].keys()
        assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
    finally:
        dist.destroy_process_group()


def test_step_start_gathers_nothing_outside_full_shard(model_dirs):
    """DDP, one process and shard_grad_op have no step-start units: nothing is gathered."""
    import torch.distributed as dist

    from fastdpo.dpo.reference import Reference
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import gather_step_start, wrap_models

    config, model, backend = five_layer_qwen3(model_dirs)
    plan = parallel_plan("shard_grad_op", "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, layers_per_unit=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert gather_step_start(wrap_models(model, Reference("precompute"), backend, d)) == []
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["shard_grad_op", "full_shard"])
def test_fsdp_accumulates_micro_steps_like_one_process(mode, model_dirs):
    """Deferred FSDP2 micro-steps accumulate their gradients in the parameters' dtype (bf16) and reduce in float32
    at the end, as one process and DDP do: after three micro-steps the gradients equal the unwrapped model's bit for
    bit. FSDP2 left to itself accumulates in float32 (a float32 copy of every gradient, rounded differently)."""
    import copy

    import torch
    import torch.distributed as dist
    from data_helpers import random_pairs
    from transformers import AutoModelForCausalLM

    from fastdpo.dpo.reference import Reference
    from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import LogpsModule, grad_sync, wrap_models

    model = AutoModelForCausalLM.from_pretrained(model_dirs("qwen3"), torch_dtype=torch.bfloat16)
    backend = Backend("dense")
    prepare_packed(model, backend)
    plain = copy.deepcopy(model)
    batches = [make_batch(random_pairs(3, model.config.vocab_size, seed=i), backend, 0, torch.device("cpu"))
               for i in range(3)]
    one = LogpsModule(plain, backend)
    for batch in batches:
        sums, *_ = one(batch, build_mask(batch, backend))
        (sums.sum() * 3.7).backward()
    plan = parallel_plan(mode, "")
    d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = wrap_models(model, Reference("precompute"), backend, d)
        for i, batch in enumerate(batches):
            with grad_sync(policy, last=i == 2, keep_gathered=d.keeps_gathered):
                sums, *_ = policy(batch, build_mask(batch, backend))
                (sums.sum() * 3.7).backward()
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    want = dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for n, g in got.items():
        assert g.dtype == torch.bfloat16, n
        assert torch.equal(g, want[n].grad), (n, (g.float() - want[n].grad.float()).abs().max().item())


@pytest.mark.parametrize("requested, groups", [(2, [[0, 1], [2, 3], [4]]), (1, [[0], [1], [2], [3], [4]]),
                                               (3, [[0, 1, 2], [3, 4]]), (4, [[0, 1, 2], [3, 4]]),
                                               (0, [[0, 1, 2, 3, 4]])])
def test_fsdp_units_hold_the_requested_decoder_layers(model_dirs, requested, groups):
    """FSDP2 shards at most --fsdp_layers_per_unit consecutive decoder layers as one unit (one gather, one reduction
    and one run of its hooks per forward and backward for all of them), in as few units as that allows, equal within
    one layer (4 of 5 layers: 3 and 2, not 4 and 1). 0 sizes the units by the layers' weights: these tiny layers
    all fit in one."""
    import torch.distributed as dist

    from fastdpo.dpo.reference import Reference
    from fastdpo.parallel.distributed import Dist, parallel_plan
    from fastdpo.parallel.wrap import wrap_models

    config, model, backend = five_layer_qwen3(model_dirs)
    plan = parallel_plan("full_shard", "")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = Dist(0, 1, 0, plan.mode, plan.reshard_after_forward, layers_per_unit=requested)
        wrap_models(model, Reference("precompute"), backend, d)
        states = [id(layer._get_fsdp_state()) for layer in model.model.layers]
    finally:
        dist.destroy_process_group()
    assert [[i for i in range(5) if states[i] == s] for s in dict.fromkeys(states)] == groups


def test_auto_units_follow_the_layers_weights():
    """0 (auto) packs at most UNIT_MIB of weights per unit, in equal units: Qwen3-1.7B's 28 layers of ≈ 96 MiB (bf16)
    give four units of 7 (not 8, 8, 8, 4), Qwen3-8B's 36 of ≈ 368 MiB eighteen units of 2; a layer larger than
    UNIT_MIB is a unit of its own; a model smaller than that is one unit."""
    import torch

    from fastdpo.parallel.wrap import UNIT_MIB, unit_sizes

    class Layer(torch.nn.Module):
        def __init__(self, params):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(params, dtype=torch.bfloat16, device="meta"))

    qwen3_1_7b = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144 + 2 * 128 + 2 * 2048
    qwen3_8b = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 128 + 2 * 4096
    assert UNIT_MIB == 768
    assert unit_sizes([Layer(qwen3_1_7b)] * 28) == [7, 7, 7, 7]
    assert unit_sizes([Layer(qwen3_8b)] * 36) == [2] * 18
    assert unit_sizes([Layer(UNIT_MIB << 20)] * 3) == [1, 1, 1]
    assert unit_sizes([Layer(1000)] * 3) == [3]
    assert unit_sizes([Layer(qwen3_1_7b)] * 28, requested=8) == [7, 7, 7, 7]
    assert unit_sizes([Layer(qwen3_1_7b)] * 28, requested=2) == [2] * 14
    assert unit_sizes([]) == []


def test_four_fsdp_ranks_match_one_rank_and_resume_on_two(fsdp, tmp_path):
    """More than two ranks (float32 sums under --reduce_dtype auto; shares of one pair, uneven micro-batch counts
    under a token budget; a unit per decoder layer): four FSDP2 ranks give one rank's weights and metrics, and their
    sharded checkpoint (units of one layer) resumes on two ranks (units sized automatically)."""
    tmp, _, common = fsdp
    run_ranks(4, timeout=240, output_dir=str(tmp_path / "ws4"), per_device_train_batch_size=1,
              gradient_accumulation_steps=2, max_tokens_per_batch=40, save_steps=3, fsdp="full_shard",
              fsdp_layers_per_unit=1, **common)
    assert_weights_close(weights(tmp_path / "ws4"), weights(tmp / "ws1"), atol=1e-5)
    for x, y in zip(metrics(tmp_path / "ws4"), train_rows(tmp / "ws1"), strict=True):
        for key in ("loss", "rewards/margins", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
    ck = tmp_path / "ws4" / "checkpoint-3"
    assert sorted(p.name for p in (ck / "sharded").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    run_ranks(2, output_dir=str(tmp_path / "two"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              fsdp="shard_grad_op", resume_from_checkpoint=str(ck), **common)
    assert_weights_close(weights(tmp_path / "two"), weights(tmp / "ws1"), atol=1e-5)
    assert [r["step"] for r in metrics(tmp_path / "two")] == [4, 5, 6]


def five_layer_qwen3(model_dirs):
    """The tiny Qwen3 with five decoder layers, on the packed dense path: (config, model, backend)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastdpo.model.backend import Backend, prepare_packed

    config = AutoConfig.from_pretrained(model_dirs("qwen3"))
    config.num_hidden_layers = 5
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * 5
    model = AutoModelForCausalLM.from_config(config)
    backend = Backend("dense")
    prepare_packed(model, backend)
    return config, model, backend
