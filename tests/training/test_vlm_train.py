"""DPO on rows with images with a tiny Qwen2.5-VL model dir (`fastdpo.model.tiny.build_tiny_vlm_dir`) and, where marked
by the `family_dir` fixture, tiny Qwen3-VL and LLaVA dirs too, on CPU in float32: whole runs (full fine-tuning and LoRA) pass
the certificate and save; the vision tower and merger stay as they were unless --freeze_vit / --freeze_aligner say
otherwise; one step's loss and gradients equal the plain computation (the model's own forwards of [prompt | chosen]
and [prompt | rejected], full logits, the sigmoid loss against a frozen copy); the vision tower runs once per micro-
batch forward; an image moves the log-probs; rows with images and a text-only model are refused; one step equals
TRL's DPOTrainer on the same rows; LLaVA refuses --max_pixels / --min_pixels."""

import json

import pytest
import torch
from data_helpers import write_jsonl
from safetensors.torch import load_file
from vlm_helpers import VLM_DIR_FAMILIES, build_vlm_dir, image_rows, sequence_logp, vision_prefixes

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import build_tiny_vlm_dir
from fastdpo.training.loop import train
from fastdpo.training.trainer import Trainer

ATOL = 1e-5
TRL_TOL = 1e-4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm_dir(tmp_path_factory.mktemp("vlm") / "model", "qwen2_5_vl")


@pytest.fixture(scope="module", params=VLM_DIR_FAMILIES)
def family_dir(request, tmp_path_factory):
    return build_vlm_dir(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen_dir(request, vlm_dir, tmp_path_factory):
    """The tiny Qwen2.5-VL dir, and a tiny Qwen3-VL one (DeepStack)."""
    if request.param == "qwen2_5_vl":
        return vlm_dir
    return build_tiny_vlm_dir(tmp_path_factory.mktemp(request.param) / "model", request.param)


def family_of(model_dir) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def tower_of(model):
    """The vision tower module of a loaded model (Qwen: `visual`, LLaVA: `vision_tower`)."""
    inner = model.model
    return inner.vision_tower if hasattr(inner, "vision_tower") else inner.visual


MODULE_TOWERS = ("model.visual.", "model.vision_tower.")  # parameter names of the towers, Qwen's and LLaVA's


def config(tmp_path, model, name, data=None, **kw) -> TrainConfig:
    data = data or write_jsonl(tmp_path / "data.jsonl", image_rows(tmp_path))
    base = dict(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / name), device="cpu",
                torch_dtype="float32", max_steps=2, learning_rate=1e-2, per_device_train_batch_size=2,
                gradient_accumulation_steps=1, shuffle=False, save_steps=0, disable_progress=True, seed=1)
    return TrainConfig(**{**base, **kw})


def certificate(out) -> dict:
    cert = json.loads((out / "summary.json").read_text())["certificate"]
    return {c["name"]: c for c in cert["checks"]} | {"status": cert["status"]}


def saved(out, name="model.safetensors") -> dict:
    return load_file(out / "final" / name)


def start(model_dir) -> dict:
    return load_file(model_dir / "model.safetensors")


@pytest.mark.parametrize("kw", [{}, {"freeze_vit": False, "freeze_aligner": False}])
def test_full_fine_tuning_trains_and_freezes_the_vision_parts(tmp_path, family_dir, kw):
    from fastdpo.model.processor import load_processor

    vlm_dir = family_dir
    result = train(config(tmp_path, vlm_dir, "run", **kw), progress=False)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    c = certificate(tmp_path / "run")
    assert c["status"] == "PASS" and c["fast_path"]["status"] == "PASS", c
    before, after = start(vlm_dir), saved(tmp_path / "run")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    tower, aligner = vision_prefixes(family_of(vlm_dir))
    vit = {k for k in before if k.startswith(tower) and not k.startswith(aligner)}
    merger = {k for k in before if k.startswith(aligner)}
    assert vit and merger
    llm = set(before) - vit - merger
    assert changed & llm
    if kw:
        assert changed & vit and changed & merger
    else:
        assert not changed & (vit | merger)
    final = tmp_path / "run" / "final"
    assert any((final / n).is_file() for n in ("preprocessor_config.json", "processor_config.json"))
    assert type(load_processor(final)) is type(load_processor(vlm_dir))  # the saved dir keeps its processor
    assert result.summary is not None


@pytest.mark.parametrize("kw", [{}, {"freeze_vit": False}])
def test_lora_trains_adapters_on_the_language_model_only(tmp_path, family_dir, kw):
    train(config(tmp_path, family_dir, "lora", train_type="lora", lora_rank=4, **kw), progress=False)
    c = certificate(tmp_path / "lora")
    assert c["status"] == "PASS" and c["fast_path"]["status"] == "PASS", c
    adapter = saved(tmp_path / "lora", "adapter_model.safetensors")
    vit = {k for k in adapter if ".visual.blocks." in k or ".vision_tower." in k}
    assert any(k.endswith("q_proj.lora_A.weight") for k in adapter)
    assert all("language_model" in k for k in set(adapter) - vit)
    assert not any(part in k for k in adapter for part in (".merger.", ".deepstack_merger_list.", ".multi_modal_projector."))
    assert (tmp_path / "lora" / "final" / "chat_template.jinja").is_file()
    assert bool(vit) == bool(kw), sorted(adapter)[:4]


@pytest.mark.parametrize("kw", [{}, {"train_type": "lora", "lora_rank": 4}], ids=["full", "lora"])
def test_verify_run_checks_a_vision_language_run_again(tmp_path, vlm_dir, kw):
    """`fastdpo verify --run` reads the run's rows with their images, as training read them, and its certificate
    passes again on the saved model."""
    from fastdpo.commands.verify_run import verify_saved_run

    train(config(tmp_path, vlm_dir, "run", **kw), progress=False)
    cert = verify_saved_run(str(tmp_path / "run"))
    assert cert.status == "PASS", [c.line() for c in cert.checks]
    assert {c.name for c in cert.checks} >= {"saved_model", "fast_path", "reference"}


def test_text_rows_train_with_a_vision_language_model(tmp_path, vlm_dir):
    data = write_jsonl(tmp_path / "text.jsonl", [{k: v for k, v in r.items() if k != "images"} | {
        "messages": [{**m, "content": m["content"].replace("<image>", "")} for m in r["messages"]]}
        for r in image_rows(tmp_path)])
    train(config(tmp_path, vlm_dir, "text", data=data), progress=False)
    assert certificate(tmp_path / "text")["status"] == "PASS"


def test_rows_with_images_and_a_text_only_model_are_refused(tmp_path, model_dirs):
    with pytest.raises(FastDPOError, match=r"data.jsonl:1.*The model is text-only.*such as Qwen2.5-VL"):
        train(config(tmp_path, model_dirs("qwen3"), "text"), progress=False)


def test_freeze_flags_are_refused_with_a_text_only_model(tmp_path, model_dirs):
    with pytest.raises(FastDPOError, match="text-only"):
        train(config(tmp_path, model_dirs("qwen3"), "text", freeze_vit=False), progress=False)


def plain_step(policy, reference, pairs, beta) -> torch.Tensor:
    """The sigmoid DPO loss of `pairs`, mean over pairs, from 4 separate forwards per pair; backward into `policy`."""
    losses = []
    for p in pairs:
        with torch.no_grad():
            ref = sequence_logp(reference, p, p.chosen) - sequence_logp(reference, p, p.rejected)
        pol = sequence_logp(policy, p, p.chosen) - sequence_logp(policy, p, p.rejected)
        losses.append(-torch.nn.functional.logsigmoid(beta * (pol - ref)))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss


def trainer_of(tmp_path, model, **kw):

    return Trainer(config(tmp_path, model, "step", max_grad_norm=0.0, **kw))


@pytest.mark.parametrize("kw", [{"per_device_train_batch_size": 4}, {"gradient_accumulation_steps": 2},
                                {"freeze_vit": False, "freeze_aligner": False, "per_device_train_batch_size": 4}])
def test_one_step_equals_the_plain_computation(tmp_path, family_dir, kw):
    import copy

    trainer = trainer_of(tmp_path, family_dir, **kw)
    s = trainer.s
    pairs = s.pairs[:4]
    assert sum(p.num_images for p in pairs) == 4 and s.backend.name == "dense" and s.backend.vision
    trainer.step(pairs)  # a first step moves the policy away from the reference: the second's loss is not log 2
    policy, reference = copy.deepcopy(s.model), copy.deepcopy(s.reference.model).eval()
    policy.zero_grad(set_to_none=True)
    grads = {}
    for name, q in s.model.named_parameters():  # the accumulated gradient, before the update clears it
        if q.requires_grad:
            q.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
    result = trainer.step(pairs)
    assert result.metrics.micro_batches == (2 if "gradient_accumulation_steps" in kw else 1)
    loss = plain_step(policy, reference, pairs, s.cfg.beta)
    assert abs(float(loss) - 0.6931) > 1e-3
    assert result.metrics.finish()["loss"] == pytest.approx(float(loss), abs=ATOL)
    # the parameters the plain computation reaches (LLaVA's CLIP post_layernorm lies after the feature layer)
    trained = {n for n, q in policy.named_parameters() if q.requires_grad and q.grad is not None}
    assert grads.keys() == trained and any(n.startswith(MODULE_TOWERS) for n in trained) == bool(
        kw.get("freeze_vit") is False)
    for name, q in policy.named_parameters():
        if name in trained:
            torch.testing.assert_close(grads[name], q.grad, atol=ATOL, rtol=0, msg=name)


def test_the_vision_tower_runs_once_per_micro_batch_forward(tmp_path, family_dir):
    """Two micro-batches of two pairs: the policy's tower runs twice and the reference copy's twice, each time on the
    images of its micro-batch only (never an image twice in a step's forwards of one model)."""
    trainer = trainer_of(tmp_path, family_dir, gradient_accumulation_steps=2)
    s = trainer.s
    pairs = s.pairs[:4]
    calls = {"policy": [], "reference": []}

    def images_of(args, kwargs) -> int:  # Qwen's tower takes (patches, grid_thw), LLaVA's (images, C, H, W)
        grid = kwargs.get("grid_thw", args[-1] if len(args) > 1 else None)
        return int((grid if grid is not None else (args[0] if args else kwargs["pixel_values"])).shape[0])

    for who, model in (("policy", s.model), ("reference", s.reference.model)):
        tower_of(model).register_forward_pre_hook(
            lambda m, args, kwargs, who=who: calls[who].append(images_of(args, kwargs)), with_kwargs=True)
    trainer.step(pairs)
    images = [sum(p.num_images for p in pairs[:2]), sum(p.num_images for p in pairs[2:])]
    assert calls == {"policy": images, "reference": images}


def test_an_image_moves_the_first_steps_log_probs(tmp_path, vlm_dir):
    def first_logps(name, colors):
        data = write_jsonl(tmp_path / f"{name}.jsonl", image_rows(tmp_path / name, colors))
        train(config(tmp_path, vlm_dir, name, data=data, max_steps=1), progress=False)
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        return first["logps/chosen"], first["logps/rejected"]

    a = first_logps("a", ((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)))
    same = first_logps("same", ((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)))
    b = first_logps("b", ((10, 10, 10), (30, 200, 30), (30, 30, 200), (200, 200, 30)))  # pair 0's image only
    assert a == same and a[0] != b[0] and a[1] != b[1]

def trl_rows(ms_swift_rows: list[dict]) -> list[dict]:
    from PIL import Image

    def parts(text: str) -> list[dict]:
        out = []
        for i, piece in enumerate(text.split("<image>")):
            out += ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
        return out

    return [{"images": [Image.open(p).convert("RGB") for p in r["images"]],
             "prompt": [{"role": "user", "content": parts(r["messages"][0]["content"])}],
             "chosen": [{"role": "assistant", "content": r["messages"][1]["content"]}],
             "rejected": [{"role": "assistant", "content": r["rejected_response"]}]} for r in ms_swift_rows]


def grads_of(model) -> dict:
    got = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q, n=n: got.__setitem__(n, q.grad.clone()))
    return got


def test_one_step_equals_trl_dpo_trainer_on_rows_with_images(tmp_path, family_dir):
    """TRL 1.16's DPOTrainer on the same rows (its vision format: image parts in the prompt, PIL images), the same
    processor, float32 (TRL defaults to bfloat16 autocast: off): loss, log-probs, rewards and every parameter's
    gradient (the vision tower and merger trained, as TRL trains them) within TRL_TOL."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import DPOConfig, DPOTrainer

    from fastdpo.model.processor import load_processor

    vlm_dir = family_dir
    with_images = [r for r in image_rows(tmp_path) if "images" in r]
    model = AutoModelForImageTextToText.from_pretrained(str(vlm_dir), dtype=torch.float32)
    theirs = grads_of(model)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(with_images), max_steps=1,
                     use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no", max_grad_norm=0.0,
                     learning_rate=1e-2, beta=0.1)
    tr = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(trl_rows(with_images)),
                    processing_class=load_processor(str(vlm_dir)))
    tr.train()
    logged = next(h for h in tr.state.log_history if "loss" in h)

    data = write_jsonl(tmp_path / "images.jsonl", with_images)
    ours = Trainer(config(tmp_path, vlm_dir, "ours", data=data, per_device_train_batch_size=len(with_images),
                          max_grad_norm=0.0, freeze_vit=False, freeze_aligner=False, beta=0.1))
    mine = grads_of(ours.s.model)
    got = ours.step(ours.s.pairs[:len(with_images)]).metrics.finish()

    for key in ("loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert got[key] == pytest.approx(logged[key], abs=TRL_TOL), key
    assert set(mine) == set(theirs) and any(n.startswith(MODULE_TOWERS) for n in theirs)
    for name, g in theirs.items():
        torch.testing.assert_close(mine[name], g, rtol=0, atol=TRL_TOL, msg=name)


@pytest.mark.parametrize("kw", [{"precompute_ref_log_probs": True}, {"gradient_checkpointing": "full"}],
                         ids=["precompute", "checkpointing"])
def test_precomputed_reference_and_checkpointing_with_images(tmp_path, qwen_dir, kw):
    """A reference precomputed over the rows with their images, and recomputed layers (Qwen3-VL: its DeepStack
    additions between them), both pass the certificate: the precomputed sums equal a live reference forward, and the
    packed path equals the model's own forwards."""
    train(config(tmp_path, qwen_dir, "run", **kw), progress=False)
    c = certificate(tmp_path / "run")
    assert c["status"] == "PASS", c
    assert c["fast_path"]["status"] == "PASS" and c["reference_at_start"]["status"] == "PASS"


def test_llava_refuses_pixel_bounds_and_rows_whose_tags_miss_their_images(tmp_path):
    """--max_pixels / --min_pixels are Qwen2-VL's (LLaVA's CLIP processor resizes to one fixed size): refused; a
    row with more `<image>` tags than images: refused with its file and line."""
    llava = build_vlm_dir(tmp_path / "llava", "llava")
    for flag in ({"max_pixels": 64 * 64}, {"min_pixels": 16 * 16}):
        with pytest.raises(FastDPOError, match="fixed size"):
            train(config(tmp_path, llava, "pixels", **flag), progress=False)
    rows = image_rows(tmp_path)
    rows[1]["messages"][0]["content"] += " <image>"
    with pytest.raises(FastDPOError, match=r"bad\.jsonl:2.*3 <image> tags.*2 images"):
        train(config(tmp_path, llava, "bad", data=write_jsonl(tmp_path / "bad.jsonl", rows)), progress=False)


def plain_kto_step(policy, reference, rows, beta) -> torch.Tensor:
    """KTO of unpaired rows with images (one KL round: the rows' chunk), mean over rows, from separate forwards of
    [prompt with its images | completion] and [prompt with its images | KL completion]; backward into `policy`."""
    with torch.no_grad():
        kl = torch.stack([sequence_logp(policy, r, r.rejected) - sequence_logp(reference, r, r.rejected)
                          for r in rows]).mean().clamp(min=0)
    losses = []
    for r in rows:
        with torch.no_grad():
            ref = sequence_logp(reference, r, r.chosen)
        lr = sequence_logp(policy, r, r.chosen) - ref
        losses.append(1 - torch.sigmoid(beta * (lr - kl)) if r.label else 1 - torch.sigmoid(beta * (kl - lr)))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss


def second_step_equals(trainer, pairs, plain) -> None:
    """A first step moves the policy off the reference; the second step's loss and accumulated gradients equal
    `plain(policy, reference, pairs, beta)` on copies of the models taken before it."""
    import copy

    s = trainer.s
    trainer.step(pairs)
    policy, reference = copy.deepcopy(s.model), copy.deepcopy(s.reference.model).eval()
    policy.zero_grad(set_to_none=True)
    grads = {}
    for name, q in s.model.named_parameters():
        if q.requires_grad:
            q.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
    result = trainer.step(pairs)
    loss = plain(policy, reference, pairs, s.cfg.beta)
    assert result.metrics.finish()["loss"] == pytest.approx(float(loss), abs=ATOL)
    reached = [name for name, q in policy.named_parameters() if q.grad is not None]
    assert reached
    for name, q in policy.named_parameters():
        if q.grad is not None:
            torch.testing.assert_close(grads[name], q.grad, atol=ATOL, rtol=0, msg=name)


def test_kto_on_rows_with_images_equals_the_plain_computation(tmp_path, family_dir):
    """Pairs with images unpaired for KTO (each prompt's images stay with both of its rows; a row's KL completion,
    the completion of the row before it, is scored after its own prompt and images): one step's loss and gradients
    equal the plain computation."""

    trainer = trainer_of(tmp_path, family_dir, loss_type="kto", per_device_train_batch_size=8)
    s = trainer.s
    rows = s.pairs[:8]  # the four pairs' eight rows, one KL round
    assert sum(r.num_images for r in rows) >= 2 and {r.label for r in rows} == {True, False}
    assert all(r.rejected != r.chosen for r in rows)  # KL completions are other rows' completions
    second_step_equals(trainer, rows, plain_kto_step)


def plain_plackett_luce_step(policy, reference, pairs, beta) -> torch.Tensor:
    """The Plackett-Luce loss of the rankings `pairs` hold (consecutive pairs of one `chunk`, each pair's rejected the
    next one's chosen), mean over rankings, from separate forwards of every completion; backward into `policy`."""
    losses = []
    for chunk in dict.fromkeys(p.chunk for p in pairs):
        ranked = [p for p in pairs if p.chunk == chunk]
        completions = [p.chosen for p in ranked] + [ranked[-1].rejected]
        rewards = []
        for c in completions:
            with torch.no_grad():
                ref = sequence_logp(reference, ranked[0], c)
            rewards.append(beta * (sequence_logp(policy, ranked[0], c) - ref))
        r = torch.stack(rewards)
        losses.append(sum(torch.logsumexp(r[k:], 0) - r[k] for k in range(len(ranked))))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss


def test_a_ranking_with_images_trains_under_plackett_luce_as_the_plain_computation(tmp_path, family_dir):
    """Scored completions of a prompt with an image: one ranking, its prompt and image computed once for all of its
    completions (one group); one step's loss and gradients equal the Plackett-Luce likelihood of separate forwards.
    A second record with other images stays its own group."""
    rows = image_rows(tmp_path)
    def reply(text):
        return [{"role": "assistant", "content": text}]

    ranked = [{"prompt": r["messages"][:1], "completions": [reply(r["messages"][1]["content"]),
                                                            reply(r["rejected_response"]), reply("w30")],
               "scores": [3, 1, 2], "images": r["images"]} for r in (rows[0], rows[3])]
    data = write_jsonl(tmp_path / "ranked.jsonl", ranked)
    trainer = trainer_of(tmp_path, family_dir, data=data, loss_type="plackett_luce", pairing="ranking",
                         per_device_train_batch_size=2)
    s = trainer.s
    pairs = s.pairs[:4]
    assert [p.chunk for p in pairs] == [0, 0, 1, 1] and all(p.num_images == 1 for p in pairs)
    assert pairs[0].rejected == pairs[1].chosen  # the ranking's middle completion (score 2): "w30"
    from fastdpo.model.backend import make_batch

    batch = make_batch(pairs, s.backend, 0, torch.device("cpu"))
    assert batch.unit_heads == (0, 2)  # two groups: one per record and its image
    second_step_equals(trainer, pairs, plain_plackett_luce_step)


def test_precompute_ref_reads_rows_with_images_and_training_reuses_its_table(tmp_path, vlm_dir, monkeypatch):
    """`fastdpo precompute-ref` on a vision-language model dir and rows with images: the table training's
    --precompute_ref_log_probs then finds (no reference pass of its own), and whose log-probs the run's certificate
    finds equal to the starting policy's."""
    import fastdpo.dpo.reference
    from fastdpo.commands.precompute import precompute_ref

    calls = []
    real = fastdpo.dpo.reference.compute_table
    monkeypatch.setattr(fastdpo.dpo.reference, "compute_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = config(tmp_path, vlm_dir, "pre", precompute_ref_log_probs=True, ref_cache_dir=str(tmp_path / "cache"))
    first = precompute_ref(cfg)
    assert not first["reused"] and first["pairs"] == 4 and len(calls) == 1
    train(cfg, progress=False)
    assert len(calls) == 1  # the run read the table precompute-ref wrote
    assert certificate(tmp_path / "pre")["reference_at_start"]["status"] == "PASS"


def test_a_precomputed_reference_is_not_reused_for_changed_images(tmp_path, vlm_dir):
    """The reference cache's key holds the images' contents and the size bounds: the same rows reuse it; an image
    file overwritten with another picture of the same size (the same token ids), or another --max_pixels, misses."""
    from data_helpers import write_image

    rows = image_rows(tmp_path)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    cache = tmp_path / "refcache"

    def run(name, **kw):
        train(config(tmp_path, vlm_dir, name, data=data, precompute_ref_log_probs=True, ref_cache_dir=str(cache),
                     max_steps=1, **kw), progress=False)
        return sorted(p.name for p in cache.glob("*.safetensors"))

    first = run("a")
    assert len(first) == 1 and run("b") == first  # the same rows and images: reused
    write_image(tmp_path / "img" / "0.png", 16, 16, (0, 0, 0))  # row 1's image: same size, other colour
    changed = run("c")
    assert len(changed) == 2 and set(first) < set(changed)
    assert len(run("d", max_pixels=16 * 16)) == 3


def test_a_list_of_rejected_replies_with_images_trains_as_one_group(tmp_path, family_dir):
    """A row with an image and two rejected replies gives two pairs that share the prompt and its image: they pack as
    one group (the image once), and the step's loss and gradients equal the plain computation of both pairs."""

    rows = image_rows(tmp_path)
    rows[0]["rejected_response"] = ["w7", "w9 w10"]
    data = write_jsonl(tmp_path / "listed.jsonl", rows)
    trainer = trainer_of(tmp_path, family_dir, data=data, per_device_train_batch_size=5)
    s = trainer.s
    pairs = s.pairs[:5]
    assert s.backend.group and pairs[0].prompt == pairs[1].prompt and pairs[0].num_images == 1
    from fastdpo.model.backend import make_batch

    batch = make_batch(pairs, s.backend, 0, torch.device("cpu"))
    assert len(batch.pair_lengths) == 4 and batch.unit_heads[0] == 0  # pairs 0 and 1: one run
    second_step_equals(trainer, pairs, plain_step)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "gemma3"])
def test_a_vision_language_family_fastdpo_does_not_train_is_refused(tmp_path, family):
    """A Qwen3-VL MoE (or Gemma 3) dir is refused by name before its rows are read (not trained as text, not called
    text-only); the MoE one is told the dense Qwen3-VL models train."""
    import transformers
    from safetensors.torch import save_file

    from fastdpo.model.tiny import word_tokenizer

    model = tmp_path / family
    transformers.AutoConfig.for_model(family).save_pretrained(model)
    save_file({"x": torch.zeros(1)}, model / "model.safetensors")
    word_tokenizer(["w1", "w2"]).save_pretrained(model)
    with pytest.raises(FastDPOError, match=f"model_type '{family}', which fastdpo does not train yet") as e:
        train(config(tmp_path, model, "run"), progress=False)
    assert ("mixture-of-experts" in str(e.value) and "'qwen3_vl'" in str(e.value)) == (family == "qwen3_vl_moe")


@pytest.mark.parametrize("kw", [{}, {"train_type": "lora", "lora_dropout": 0.1}], ids=["full", "lora"])
def test_a_trained_vision_tower_is_checkpointed_and_its_gradients_do_not_change(tmp_path, family_dir, kw):
    """With the vision tower trained (--freeze_vit false: its weights, or LoRA adapters with dropout on its linear
    layers), its blocks are checkpointed with the decoder's layers: their forward keeps only each block's input for
    the backward (a 3B model's tower kept some 30 GB for a 4-image micro-batch otherwise), and one step's gradients,
    the tower's included, are those without it (the recompute replays the dropout's draws)."""
    from fastdpo.model.memory import vision_blocks
    from fastdpo.model.vlm import pair_images, vision_features

    with_images = [r for r in image_rows(tmp_path) if "images" in r]
    data = write_jsonl(tmp_path / "images.jsonl", with_images)
    runs, kept = {}, {}
    for policy in ("none", "full"):
        t = Trainer(config(tmp_path, family_dir, policy, data=data, per_device_train_batch_size=len(with_images),
                           max_grad_norm=0.0, freeze_vit=False, freeze_aligner=False, gradient_checkpointing=policy,
                           **kw))
        blocks = vision_blocks(t.s.model)
        assert blocks and all(getattr(b, "_fastdpo_ckpt", False) == (policy == "full") for b in blocks)
        pixel_values, grid = pair_images(t.s.pairs)
        saved = []

        def pack(x, saved=saved):
            saved.append(x.untyped_storage().nbytes())
            return x

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            vision_features(t.s.model, pixel_values, grid)
        kept[policy] = sum(saved)
        grads = grads_of(t.s.model)
        t.step(t.s.pairs[:len(with_images)])
        runs[policy] = grads
    assert kept["full"] < 0.5 * kept["none"], kept
    towers = tuple("." + t for t in MODULE_TOWERS)  # under PEFT the names sit below base_model.model
    assert set(runs["full"]) == set(runs["none"])
    assert any(n.startswith(MODULE_TOWERS) or any(t in n for t in towers) for n in runs["full"])
    for name, g in runs["none"].items():
        torch.testing.assert_close(runs["full"][name], g, rtol=1e-5, atol=1e-6, msg=name)


def vision_saved(model, pairs) -> tuple[int, int]:
    """Bytes autograd keeps (weights not counted, storages once) for one forward with grad of the vision tower over
    the pairs' images, and those images' pixel-value elements."""
    from fastdpo.model.vlm import pair_images, vision_features

    pixel_values, grid = pair_images(pairs)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(x):
        key = x.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = x.untyped_storage().nbytes()
        return x

    model.train()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        vision_features(model, pixel_values, grid)
    return sum(seen.values()), pixel_values.numel()


def test_the_memory_plan_counts_what_a_trained_vision_tower_keeps(tmp_path, family_dir):
    """`fit` measures a trained tower's kept bytes per pixel-value element, whole and checkpointed: the whole figure
    is what the tower's forward keeps for the run's images (within 10 %), the checkpointed one bounds what it keeps
    once checkpointed, and a frozen tower keeps nothing."""
    from fastdpo.model.memory import apply_checkpointing
    from fastdpo.training.fit import largest_pixels, measure_vision

    with_images = [r for r in image_rows(tmp_path) if "images" in r]
    data = write_jsonl(tmp_path / "images.jsonl", with_images)
    t = Trainer(config(tmp_path, family_dir, "trained", data=data, freeze_vit=False, freeze_aligner=False))
    model, pairs = t.s.model, t.s.pairs
    whole, checkpointed = measure_vision(model, pairs, torch.device("cpu"))
    assert whole > checkpointed > 0
    held = [p for p in pairs if p.num_images]
    for pair in held:
        kept, pixels = vision_saved(model, [pair])
        assert whole * pixels == pytest.approx(kept, rel=0.1)
    assert largest_pixels(pairs, 2) == sum(sorted((p.pixel_values.numel() for p in held), reverse=True)[:2])
    apply_checkpointing(model, "full")
    for pair in held:
        kept, pixels = vision_saved(model, [pair])
        assert kept <= checkpointed * pixels
    frozen = Trainer(config(tmp_path, family_dir, "frozen", data=data))
    assert measure_vision(frozen.s.model, frozen.s.pairs, torch.device("cpu")) == (0.0, 0.0)


def test_a_plan_with_a_trained_vision_tower_checkpoints_where_text_alone_would_not(tmp_path, family_dir, caplog):
    """Under a limit that the language model's tokens alone fit without checkpointing, a trained tower's images
    make the plan checkpoint (and the log says they were counted); a frozen tower leaves the plan as text's."""
    from fastdpo.config import RunPlan
    from fastdpo.model.fused import fuse_layers
    from fastdpo.model.memory import apply_checkpointing
    from fastdpo.training.fit import (
        ActivationBytes,
        head_bytes,
        largest_pixels,
        measure_activations,
        measure_vision,
        resolve_fit,
    )

    with_images = [r for r in image_rows(tmp_path) if "images" in r]
    data = write_jsonl(tmp_path / "images.jsonl", with_images)
    cpu = torch.device("cpu")
    plans = {}
    for name, frozen in (("trained", False), ("frozen", True)):
        cfg = config(tmp_path, family_dir, name, data=data, freeze_vit=frozen, freeze_aligner=frozen,
                     gradient_accumulation_steps=2)  # activations and gradients counted together
        t = Trainer(cfg)
        model, pairs = t.s.model, t.s.pairs
        apply_checkpointing(model, "none")
        fuse_layers(model)  # lean already: the plan does not measure again with fewer bytes kept
        largest = sum(sorted((p.num_tokens for p in pairs), reverse=True)[:cfg.per_device_train_batch_size])
        text = measure_activations(model, t.s.backend, 0, cpu).per_token("none") * largest * 1.1
        if not frozen:  # room for the text and a fifth of the tower's whole activations
            whole = ActivationBytes(0, 0, 0, 0, 1, *measure_vision(model, pairs, cpu)).vision(
                "none", largest_pixels(pairs, cfg.per_device_train_batch_size))
            assert whole > 0
        limit = int(head_bytes(model) + text + 0.5 * 2**30 + (whole / 5 if not frozen else 0) + 1)
        plan = RunPlan.of(cfg)
        with caplog.at_level("INFO", logger="fastdpo"):
            resolve_fit(cfg, plan, model, t.s.backend, pairs, cpu, 0, limit, 0)
        plans[name] = plan.gradient_checkpointing
    assert plans["frozen"] == "none" and plans["trained"] != "none"
    assert "pixel values through the trained vision tower" in caplog.text
