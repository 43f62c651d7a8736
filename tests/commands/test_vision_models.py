"""The after-training commands with a vision-language model dir (tiny Qwen2.5-VL and tiny LLaVA on CPU, float32):
eval's preference metrics of rows with images equal the plain computation (the model's own forwards, adapter on and
off); eval refuses rows with images for a text-only model; infer with images generates what the model's own
`generate` gives on its processor's inputs, base and tuned side by side, and refuses images it cannot use."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from data_helpers import write_jsonl
from vlm_helpers import VLM_DIR_FAMILIES, build_vlm_dir, image_rows, random_vlm_adapter, sequence_logp

from fastdpo.commands.evaluate import EvalConfig, run_eval
from fastdpo.errors import FastDPOError

BETA = 0.1


@pytest.fixture(scope="module", params=VLM_DIR_FAMILIES)
def vlm(request, tmp_path_factory):
    """(base dir, random adapter dir, data file of rows with images)."""
    root = tmp_path_factory.mktemp(request.param)
    base = build_vlm_dir(root / "model", request.param)
    return base, random_vlm_adapter(base, root / "adapter"), write_jsonl(root / "data.jsonl", image_rows(root))


def eval_config(tmp_path, base, data, **kw) -> EvalConfig:
    return EvalConfig(**{"model": str(base), "dataset": [str(data)], "output_dir": str(tmp_path / "eval"),
                         "device": "cpu", "torch_dtype": "float32", "beta": BETA, **kw})


def plain_logps(cfg, base, adapter, data):
    """(pairs, policy, reference): the held-out pairs as eval reads them (images and all), and their chosen and
    rejected log-prob sums (B, 2) from the model's own forwards, adapter on and off."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from fastdpo.data.load import load_rows
    from fastdpo.data.prepare import DataOptions, tokenize_rows
    from fastdpo.model.processor import load_processor

    opts = DataOptions.for_scoring(cfg)
    opts = dataclasses.replace(opts, read=dataclasses.replace(opts.read, images=True))
    pairs, _ = tokenize_rows(load_rows([str(data)], read=opts.read), None, opts, processor=load_processor(base))
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        pol = torch.tensor([[sequence_logp(model, p, p.chosen), sequence_logp(model, p, p.rejected)] for p in pairs])
        with model.disable_adapter():
            ref = torch.tensor([[sequence_logp(model, p, p.chosen), sequence_logp(model, p, p.rejected)]
                                for p in pairs])
    return pairs, pol, ref


def test_eval_of_rows_with_images_equals_the_plain_computation(tmp_path, vlm):


    base, adapter, data = vlm
    cfg = eval_config(tmp_path, base, data, adapters=str(adapter))
    report = run_eval(cfg)
    m = report["metrics"]
    assert report["pairs"] == 4 and report["reference"] == "adapter_off"

    pairs, pol, ref = plain_logps(cfg, base, adapter, data)
    assert sum(p.num_images for p in pairs) == 4
    rewards = BETA * (pol - ref)
    margins = rewards[:, 0] - rewards[:, 1]
    assert margins.abs().min() > 1e-3  # the adapter moves every pair: the comparison can fail
    want = {"rewards/chosen": rewards[:, 0].mean(), "rewards/rejected": rewards[:, 1].mean(),
            "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).float().mean(),
            "logps/chosen": pol[:, 0].mean(), "logps/rejected": pol[:, 1].mean(),
            "loss": -torch.nn.functional.logsigmoid(margins).mean()}
    for name, value in want.items():
        assert m[name] == pytest.approx(float(value), abs=1e-4), name
    assert math.isfinite(m["kl"]) and m["kl"] > 0


def test_eval_without_an_adapter_has_zero_margins_against_itself(tmp_path, vlm):
    base, _, data = vlm
    m = run_eval(eval_config(tmp_path, base, data, ref_model=str(base)))["metrics"]
    assert m["rewards/margins"] == pytest.approx(0.0, abs=1e-5) and m["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_eval_of_rankings_with_images_reads_each_ranking_whole(tmp_path, vlm):
    """Scored completions of prompts with images under --loss_type plackett_luce: against itself every reward is 0,
    so a ranking of three completions costs log 3 + log 2 (its pairs scored apart would cost log 2 each)."""
    base, _, data = vlm
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    ranked = [{"prompt": r["messages"][:1], "images": r["images"],
               "completions": [[{"role": "assistant", "content": t}] for t in ("w5", "w6 w7", "w8")],
               "scores": [1, 3, 2]} for r in rows if r.get("images")]
    path = Path(tmp_path) / "ranked.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ranked))
    report = run_eval(eval_config(tmp_path, base, path, ref_model=str(base), loss_type="plackett_luce",
                                  pairing="ranking"))
    assert report["pairs"] == 2 * len(ranked)
    assert report["metrics"]["loss"] == pytest.approx(math.log(3) + math.log(2), abs=1e-5)


def test_eval_refuses_rows_with_images_for_a_text_only_model(tmp_path, vlm, model_dirs):
    with pytest.raises(FastDPOError, match=r"data.jsonl:1.*text-only"):
        run_eval(eval_config(tmp_path, model_dirs("qwen3"), vlm[2]))


def direct_generate(model, processor, text_parts: list, images: list, new_tokens: int) -> str:
    """The model's own `generate` on its processor's inputs (one user turn of `text_parts`), greedy: the answer."""
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                             for p in text_parts]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[Image.open(p) for p in images], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        seqs = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
    return processor.tokenizer.decode(seqs[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def infer_config(base, **kw):
    from fastdpo.commands.infer import InferConfig

    return InferConfig(**{"model": str(base), "device": "cpu", "torch_dtype": "float32", "max_new_tokens": 6,
                          "stream": False, **kw})


@pytest.mark.parametrize("prompt", ["<image>w1 w2", "w1 w2"])  # no tag: the image goes before the text
def test_infer_with_an_image_generates_what_the_models_own_generate_gives(tmp_path, vlm, prompt):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from fastdpo.commands.infer import run_infer
    from fastdpo.model.processor import load_processor

    base, adapter, data = vlm
    image = image_rows(tmp_path)[1]["images"][0]
    got = run_infer(infer_config(base, adapters=str(adapter), prompt=prompt, images=[image], compare=True))[0]
    processor = load_processor(base)
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), adapter).eval()
    tuned = direct_generate(model, processor, [None, "w1 w2"], [image], 6)
    with model.disable_adapter():
        plain = direct_generate(model, processor, [None, "w1 w2"], [image], 6)
    assert got["response"] == tuned and got["base_response"] == plain and tuned != plain
    other = image_rows(tmp_path / "other", colors=[(0, 0, 0)] * 4)[1]["images"][0]  # 24 x 16: other placeholders
    assert run_infer(infer_config(base, adapters=str(adapter), prompt=prompt, images=[other]))[0]["response"] == \
        direct_generate(model, processor, [None, "w1 w2"], [other], 6)


def test_infer_answers_rows_with_images_of_a_preference_file(tmp_path, vlm):
    import json

    from fastdpo.commands.infer import run_infer

    base, adapter, data = vlm
    out = tmp_path / "answers.jsonl"
    results = run_infer(infer_config(base, adapters=str(adapter), val_dataset=[str(data)], result_path=str(out)))
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 4 and all(r["response"] for r in written)
    assert [len(r.get("images", [])) for r in written] == [1, 2, 0, 1]
    assert written[0]["images"][0] == json.loads(data.read_text().splitlines()[0])["images"][0]
    alone = run_infer(infer_config(base, adapters=str(adapter), messages=json.dumps(
        json.loads(data.read_text().splitlines()[1])["messages"][:1]), images=written[1]["images"]))
    assert alone[0]["response"] == results[1]["response"]  # the same prompt and images, given on the command line


def test_infer_refuses_images_it_cannot_use(tmp_path, vlm, model_dirs):
    from fastdpo.commands.infer import run_infer

    image = image_rows(tmp_path)[0]["images"][0]
    with pytest.raises(FastDPOError, match="text-only model"):
        run_infer(infer_config(model_dirs("qwen3"), prompt="w1", images=[image]))
    with pytest.raises(FastDPOError, match=r"--images .*nope.png: file not found"):
        run_infer(infer_config(vlm[0], prompt="w1", images=[str(tmp_path / "nope.png")]))
    with pytest.raises(FastDPOError, match="2 <image> tags and 1 image"):
        run_infer(infer_config(vlm[0], prompt="<image>w1<image>", images=[image]))
    with pytest.raises(FastDPOError, match="text-only"):
        run_infer(infer_config(model_dirs("qwen3"), val_dataset=[str(vlm[2])]))


def test_eval_after_a_lora_run_gives_the_runs_own_held_out_metrics(tmp_path, vlm):
    """Two LoRA steps on rows with images, held out as --val_dataset (evaluated at the end of training): `fastdpo eval`
    of the saved adapter reports the metrics the run logged for the same rows, and they moved off zero."""
    import json

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    base, _, data = vlm
    cfg = TrainConfig(model=str(base), dataset=[str(data)], val_dataset=[str(data)], output_dir=str(tmp_path / "run"),
                      device="cpu", torch_dtype="float32", train_type="lora", lora_rank=4, lora_alpha=16,
                      target_modules="all-linear", max_steps=2, learning_rate=5e-2, per_device_train_batch_size=2,
                      shuffle=False, save_steps=0, disable_progress=True, seed=1, beta=BETA)
    result = train(cfg, progress=False)
    logged = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "eval_loss" in r][-1]
    m = run_eval(eval_config(tmp_path, base, data, adapters=result["final_dir"]))["metrics"]
    assert abs(m["rewards/margins"]) > 1e-4
    for name in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected"):
        assert m[name] == pytest.approx(logged["eval_" + name], abs=1e-4), name


def test_infer_resizes_images_as_the_run_did(tmp_path, monkeypatch):
    """A run trained with --max_pixels: `fastdpo infer --adapters` of it hands generation the same bound, and the
    processor then gives the image fewer placeholders than its default size; the base model alone keeps the
    processor's own size."""
    from PIL import Image

    from fastdpo.commands.infer import run_infer
    from fastdpo.config import TrainConfig
    from fastdpo.model import generate as generate_mod
    from fastdpo.model.processor import load_processor
    from fastdpo.model.tiny import build_tiny_vlm_dir
    from fastdpo.training.loop import train

    base = build_tiny_vlm_dir(tmp_path / "model")
    data = write_jsonl(tmp_path / "data.jsonl", image_rows(tmp_path))
    cfg = TrainConfig(model=str(base), dataset=[str(data)], output_dir=str(tmp_path / "run"), device="cpu",
                      torch_dtype="float32", train_type="lora", lora_rank=4, max_steps=1, max_pixels=16 * 16,
                      per_device_train_batch_size=2, save_steps=0, disable_progress=True)
    final = train(cfg, progress=False)["final_dir"]
    seen = []
    plain = generate_mod.generate_vision_ids

    def spy(*args, **kw):
        seen.append(args[6] if len(args) > 6 else kw.get("pixels"))
        return plain(*args, **kw)

    monkeypatch.setattr(generate_mod, "generate_vision_ids", spy)
    image = image_rows(tmp_path)[1]["images"][0]  # 24 x 16 pixels: six placeholders unless bounded to 16 x 16
    run_infer(infer_config(base, adapters=str(final), prompt="<image>w1", images=[image]))
    run_infer(infer_config(base, prompt="<image>w1", images=[image]))
    assert seen[0] is not None and seen[0].max_pixels == 16 * 16 and seen[1] is None

    processor = load_processor(base)
    tokens = [processor.image_processor(images=[Image.open(image)], **kw)["image_grid_thw"].prod().item() // 4
              for kw in ({}, {"size": seen[0].size(processor.image_processor)})]
    assert tokens[0] == 6 and tokens[1] < 6  # 24 x 16 pixels bounded to an area of 16 x 16


def test_eval_kto_metrics_of_rows_with_images(tmp_path, vlm):
    """Held-out pairs with images scored as unpaired rows (KTO): each row's log-ratio is the model's own forwards of
    [prompt with its images | completion], adapter on and off (one KL round: the rows' mean rewards and log-probs)."""


    base, adapter, data = vlm
    cfg = eval_config(tmp_path, base, data, adapters=str(adapter), loss_type="kto")
    m = run_eval(cfg)["metrics"]
    _, pol, ref = plain_logps(cfg, base, adapter, data)
    rewards = BETA * (pol - ref)  # column 0: the desirable rows (chosen), column 1: the undesirable ones
    assert rewards.abs().min() > 1e-4  # the adapter moves every row: the comparison can fail
    want = {"rewards/chosen": rewards[:, 0].mean(), "rewards/rejected": rewards[:, 1].mean(),
            "logps/chosen": pol[:, 0].mean(), "logps/rejected": pol[:, 1].mean()}
    for name, value in want.items():
        assert m[name] == pytest.approx(float(value), abs=1e-4), name
