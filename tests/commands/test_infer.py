"""`fastdpo infer` and the generation entry point: deterministic greedy answers, batching that does not change them,
the chat template, base vs tuned, batch JSONL, streaming, and clear errors."""

import json
import shutil

import pytest
from cli_helpers import run_cli
from data_helpers import write_jsonl
from model_helpers import WORDS

from fastdpo.commands.infer import GenerationArgs, InferConfig, ModelArgs, run_infer
from fastdpo.errors import FastDPOError
from fastdpo.model.generate import generate_ids, generate_texts, load_for_generation, prompt_ids
from fastdpo.model.tiny import build_tiny_model

PROMPTS = ["w10 w11", "w12", "w13 w14 w15 w16 w17", "w40 w22 w31"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def test_greedy_is_deterministic_and_batching_does_not_change_answers(lora_run):
    base, adapter, _ = lora_run
    loaded = load_for_generation(ModelArgs(model=str(base), adapters=str(adapter)))
    gen = GenerationArgs(max_new_tokens=6)
    first = generate_ids(loaded.model, loaded.tokenizer, PROMPTS, gen)
    assert generate_ids(loaded.model, loaded.tokenizer, PROMPTS, gen) == first
    one_by_one = [generate_ids(loaded.model, loaded.tokenizer, [p], gen)[0] for p in PROMPTS]
    assert one_by_one == first  # left padding in a batch changes nothing
    small_batches = generate_ids(loaded.model, loaded.tokenizer, PROMPTS, GenerationArgs(max_new_tokens=6,
                                                                                         max_batch_size=3))
    assert small_batches == first
    assert all(1 <= len(x) <= 6 for x in first)
    texts = generate_texts(loaded.model, loaded.tokenizer, PROMPTS, gen)
    assert texts == [loaded.tokenizer.decode(x, skip_special_tokens=True).strip() for x in first]
    with loaded.base_model() as b:
        base_ids = generate_ids(b, loaded.tokenizer, PROMPTS, gen)
    assert base_ids != first  # the adapter changes the answers, and turning it off restores the base
    plain = load_for_generation(ModelArgs(model=str(base)))
    assert generate_ids(plain.model, plain.tokenizer, PROMPTS, gen) == base_ids


def test_sampling_is_seeded(model_dirs):
    loaded = load_for_generation(ModelArgs(model=str(model_dirs("llama"))))
    gen = GenerationArgs(max_new_tokens=8, temperature=1.5, top_k=20, top_p=0.95, seed=7)
    a = generate_ids(loaded.model, loaded.tokenizer, PROMPTS, gen)
    assert generate_ids(loaded.model, loaded.tokenizer, PROMPTS, gen) == a
    greedy = generate_ids(loaded.model, loaded.tokenizer, PROMPTS, GenerationArgs(max_new_tokens=8))
    assert a != greedy


def chat_model(tmp_path, model_dirs):
    """A copy of the tiny llama dir whose tokenizer has CHAT_TEMPLATE."""
    m = tmp_path / "chat"
    shutil.copytree(model_dirs("llama"), m)
    cfg_path = m / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return m


def test_chat_template_formats_prompts(tmp_path, model_dirs):
    m = chat_model(tmp_path, model_dirs)
    loaded = load_for_generation(ModelArgs(model=str(m)))
    tok = loaded.tokenizer
    assert tok.chat_template
    got = prompt_ids(tok, "w10 w11", system="w1")
    want = tok("system w1 <eos> user w10 w11 <eos> assistant", add_special_tokens=False)["input_ids"]
    assert got == want
    messages = [{"role": "user", "content": "w10 w11"}]
    assert prompt_ids(tok, messages, system="w1") == want
    assert prompt_ids(tok, "w10 w11", use_chat_template=False) == tok("w10 w11")["input_ids"]
    plain = load_for_generation(ModelArgs(model=str(model_dirs("llama")))).tokenizer
    with pytest.raises(FastDPOError, match="chat template"):
        prompt_ids(plain, "w10", system="w1")
    with pytest.raises(FastDPOError, match="chat template"):
        prompt_ids(plain, messages)
    # generation goes through the template: same ids as feeding the templated text by hand
    gen = GenerationArgs(max_new_tokens=4, system="w1")
    by_template = generate_ids(loaded.model, tok, ["w10 w11"], gen)
    ids = prompt_ids(tok, "w10 w11", system="w1")
    import torch

    manual = loaded.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                   pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert by_template[0] == manual[: len(by_template[0])]


def test_batch_file_with_compare_writes_jsonl(tmp_path, lora_run):
    base, adapter, _ = lora_run
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)])
    cfg = InferConfig(model=str(base), adapters=str(adapter), prompts=str(prompts), compare=True, max_new_tokens=6)
    results = run_infer(cfg)
    rows = [json.loads(line) for line in (tmp_path / "p.infer.jsonl").read_text().splitlines()]
    assert rows == results
    assert [r["id"] for r in rows] == list(range(len(PROMPTS)))  # order and extra fields kept
    loaded = load_for_generation(ModelArgs(model=str(base), adapters=str(adapter)))
    gen = GenerationArgs(max_new_tokens=6)
    assert [r["response"] for r in rows] == generate_texts(loaded.model, loaded.tokenizer, PROMPTS, gen)
    with loaded.base_model() as b:
        assert [r["base_response"] for r in rows] == generate_texts(b, loaded.tokenizer, PROMPTS, gen)


def test_full_checkpoint_compares_with_its_base(tmp_path, model_dirs):
    base = model_dirs("llama")
    full = build_tiny_model(tmp_path / "full", "llama", WORDS, seed=1)  # a full model dir with other weights
    cfg = InferConfig(model=str(base), checkpoint=str(full), prompts=str(write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])), compare=True, max_new_tokens=5,
        result_path=str(tmp_path / "out" / "answers.jsonl"))
    rows = run_infer(cfg)
    tuned = load_for_generation(ModelArgs(model=str(full)))
    plain = load_for_generation(ModelArgs(model=str(base)))
    gen = GenerationArgs(max_new_tokens=5)
    assert [r["response"] for r in rows] == generate_texts(tuned.model, tuned.tokenizer, PROMPTS, gen)
    assert [r["base_response"] for r in rows] == generate_texts(plain.model, plain.tokenizer, PROMPTS, gen)
    assert (tmp_path / "out" / "answers.jsonl").is_file()


def test_cli_streams_a_single_prompt(tmp_path, capsys, model_dirs):
    full = build_tiny_model(tmp_path / "full", "llama", WORDS, seed=2)
    rc, out = run_cli(capsys, "infer", "--model", model_dirs("llama"), "--checkpoint", full, "--prompt", "w10 w11",
                      "--max_new_tokens", 6)
    assert rc == 0, out
    loaded = load_for_generation(ModelArgs(model=str(full)))
    answer = generate_texts(loaded.model, loaded.tokenizer, ["w10 w11"], GenerationArgs(max_new_tokens=6))[0]
    assert answer and out.split()[: len(answer.split())] == answer.split()  # streamed as it is generated


def test_cli_errors(tmp_path, capsys, lora_run):
    base, adapter, out = lora_run
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{"text": "w2"}\n')
    cases = [
        (["--prompt", "w1", "--prompts", "x.jsonl"], ["exactly one of --prompt"]),
        (["--prompt", "w1", "--messages", '[{"role": "user", "content": "w1"}]'], ["exactly one of --prompt"]),
        (["--prompt", "w1", "--compare"], ["--compare needs"]),
        (["--checkpoint", out, "--prompt", "w1"], ["output_dir", "final"]),
        (["--adapters", base, "--prompt", "w1"], ["full model", "--checkpoint"]),
        (["--prompts", bad], ["bad.jsonl:2", "prompt"]),
        (["--prompt", "w1", "--temperature", "-1"], ["--temperature"]),
        (["--prompt", "w1", "--system", "w2"], ["--system", "chat template"]),
        (["--messages", "[{role: user}]"], ["--messages is not valid JSON", "Quote it"]),
        (["--messages", '[{"role": "user"}]'], ["--messages must be a non-empty JSON list"]),
        (["--prompt", "w1", "--infer_backend", "vllm"], ["--infer_backend vllm", "--merge_lora"]),
    ]
    for args, needles in cases:
        rc, text = run_cli(capsys, "infer", "--model", base, *args)
        assert rc == 1, text
        for n in needles:
            assert n in text, text


def test_cli_answers_messages_like_ms_swift(tmp_path, capsys, model_dirs):
    """`--messages '[...]' --infer_backend pt` (ms-swift's infer command): the conversation goes through the chat
    template and the answer is what generate_texts gives for the same messages."""
    m = chat_model(tmp_path, model_dirs)
    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w10 w11"}]
    rc, out = run_cli(capsys, "infer", "--model", m, "--infer_backend", "pt", "--max_new_tokens", 5,
                      "--messages", json.dumps(messages))
    assert rc == 0, out
    loaded = load_for_generation(ModelArgs(model=str(m)))
    answer = generate_texts(loaded.model, loaded.tokenizer, [messages], GenerationArgs(max_new_tokens=5))[0]
    assert answer and out.split()[: len(answer.split())] == answer.split()


@pytest.mark.parametrize("template", ["chatml", "identity"])
def test_a_model_trained_with_a_template_generates_from_the_prompts_it_trained_on(tmp_path, model_dirs, template):
    """--template is saved as the trained model's chat template: generation from final/ starts from exactly the
    prompt tokens training scored (the tiny tokenizer has no template of its own, so before, a chat prompt was
    refused); eval and infer take --template for a model saved without it."""
    from fastdpo.commands.evaluate import EvalConfig
    from fastdpo.config import TrainConfig
    from fastdpo.data.load import load_rows
    from fastdpo.data.prepare import DataOptions, tokenize_pairs
    from fastdpo.model.load import load_tokenizer
    from fastdpo.training.loop import train

    words = WORDS[4:40]
    rows = [{"prompt": [{"role": "user", "content": " ".join(words[i:i + 4])}],
             "chosen": [{"role": "assistant", "content": " " + words[i + 5]}],
             "rejected": [{"role": "assistant", "content": " " + words[i + 7]}]} for i in range(8)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    base = model_dirs("qwen3")
    assert not getattr(load_tokenizer(str(base)), "chat_template", None)
    cfg = TrainConfig(model=str(base), dataset=[str(data)], output_dir=str(tmp_path / "out"), template=template,
                      train_type="lora", lora_rank=2, max_steps=1, per_device_train_batch_size=4)
    final = train(cfg, progress=False)["final_dir"]
    trained, _ = tokenize_pairs(load_rows([str(data)]), load_tokenizer(str(base)), DataOptions.from_config(cfg))
    loaded = load_for_generation(ModelArgs(model=str(base), adapters=str(final)))
    prompts = [r["prompt"] for r in rows]
    assert [prompt_ids(loaded.tokenizer, p) for p in prompts] == [list(p.prompt) for p in trained]
    assert len(generate_ids(loaded.model, loaded.tokenizer, prompts[:2], GenerationArgs(max_new_tokens=2))) == 2
    for args in (InferConfig(model=str(base), template=template, prompt="x"),
                 EvalConfig(model=str(base), template=template, dataset=[str(data)])):
        tok = load_for_generation(args).tokenizer
        assert [prompt_ids(tok, p) for p in prompts] == [list(p.prompt) for p in trained]


def test_cli_keeps_library_deprecation_noise_out(tmp_path, capsys, lora_run):
    """Loading an adapter makes peft read a property newer transformers deprecate; the command does not pass that
    warning on (the user can do nothing about it). Other warnings still show."""
    import warnings

    import peft
    import transformers

    base, adapter, _ = lora_run
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc, out = run_cli(capsys, "infer", "--model", base, "--adapters", adapter, "--prompt", "w10", "--max_new_tokens", 2)
        warnings.warn("a warning of our own", FutureWarning, stacklevel=1)
    assert rc == 0, out
    texts = [str(w.message) for w in seen]
    assert not any("is_gradient_checkpointing" in t for t in texts), (texts, transformers.__version__, peft.__version__)
    assert "a warning of our own" in texts


def test_an_adapter_alone_runs_on_the_base_it_names(tmp_path, capsys, lora_run):
    """`fastdpo infer --adapters DIR` and `fastdpo export --adapters DIR --merge_lora` without --model use the base
    the adapter's adapter_config.json names (ms-swift's `swift infer --adapters ...`); a base that is not there, or
    none, is a clear error. --stream false prints the answer when done instead of streaming it."""
    import json

    base, adapter, _ = lora_run
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    alone = InferConfig(adapters=str(adapter), prompt="w10")
    alone.validate()
    assert alone.model == str(base)
    gen = GenerationArgs(max_new_tokens=6)
    given = load_for_generation(ModelArgs(model=str(base), adapters=str(adapter)))
    ids = generate_ids(given.model, given.tokenizer, PROMPTS, gen)
    named = load_for_generation(alone)
    assert generate_ids(named.model, named.tokenizer, PROMPTS, gen) == ids
    rc, streamed = run_cli(capsys, "infer", "--adapters", adapter, "--prompt", "w10 w11", "--max_new_tokens", 4)
    assert rc == 0 and f"--model {base}" in streamed and "answer" not in streamed, streamed
    rc, table = run_cli(capsys, "infer", "--adapters", adapter, "--prompt", "w10 w11", "--max_new_tokens", 4,
                        "--stream", "false")
    assert rc == 0 and "answer" in table and "prompt" in table, table  # printed as a table when done
    rc, out = run_cli(capsys, "export", "--adapters", adapter, "--merge_lora", "true", "--output_dir", tmp_path / "m")
    assert rc == 0 and (tmp_path / "m" / "config.json").is_file(), out

    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved)
    cfg = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(tmp_path / "gone")}))
    rc, out = run_cli(capsys, "infer", "--adapters", moved, "--prompt", "w1")
    assert rc == 1 and "which is not there from here. Pass --model" in out, out
    (moved / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": None}))
    rc, out = run_cli(capsys, "export", "--adapters", moved, "--merge_lora", "true", "--output_dir", tmp_path / "m2")
    assert rc == 1 and "names no base model" in out, out
    rc, out = run_cli(capsys, "infer", "--prompt", "w1")
    assert rc == 1 and "--model is required" in out


def test_load_data_args_answers_the_runs_held_out_prompts(tmp_path, capsys, model_dirs):
    """ms-swift's `--load_data_args true`: the prompts are the pairs the run held out (here its
    --split_dataset_ratio share of --dataset, the same rows its evaluation scored), read from the run's saved config;
    the answers go to the run's infer_held_out.jsonl. A run that held out nothing is a clear error."""
    from data_helpers import easy_rows

    from fastdpo.config import TrainConfig
    from fastdpo.data.load import load_rows
    from fastdpo.data.split import held_out_rows
    from fastdpo.training.loop import train

    base = model_dirs("qwen3")
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(20, seed=4))
    cfg = TrainConfig(model=str(base), dataset=[str(data)], output_dir=str(tmp_path / "run"), train_type="lora",
                      lora_rank=2, max_steps=1, per_device_train_batch_size=4, split_dataset_ratio=0.25)
    final = train(cfg, progress=False)["final_dir"]
    rc, out = run_cli(capsys, "infer", "--adapters", final, "--load_data_args", "true", "--max_new_tokens", 2)
    assert rc == 0, out
    answers = [json.loads(line) for line in (tmp_path / "run" / "infer_held_out.jsonl").read_text().splitlines()]
    _, held = held_out_rows(cfg, load_rows(cfg.dataset, cfg.seed))
    assert len(answers) == len(held) == 5
    assert [a["prompt"] for a in answers] == [r.prompt for r in held] and all("response" in a for a in answers)

    plain = TrainConfig(**{**cfg.to_dict(), "output_dir": str(tmp_path / "plain"), "split_dataset_ratio": 0.0})
    rc, out = run_cli(capsys, "infer", "--adapters", train(plain, progress=False)["final_dir"], "--load_data_args",
                      "true")
    assert rc == 1 and "held out no pairs" in out, out
    rc, out = run_cli(capsys, "infer", "--model", base, "--load_data_args", "true")
    assert rc == 1 and "add --adapters or --checkpoint" in out, out


def test_an_adapter_names_its_local_base_by_absolute_path(tmp_path, capsys, monkeypatch, model_dirs):
    """Trained with `--model base` relative to the working directory, the adapter still finds its base from
    elsewhere: a local base dir is saved in adapter_config.json by its absolute path."""
    from data_helpers import easy_rows

    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    shutil.copytree(model_dirs("qwen3"), tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8, seed=4))
    cfg = TrainConfig(model="base", dataset=[str(data)], output_dir="run", train_type="lora", lora_rank=2,
                      max_steps=1, per_device_train_batch_size=4)
    final = tmp_path / train(cfg, progress=False)["final_dir"]
    named = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((tmp_path / "base").resolve())
    monkeypatch.chdir(tmp_path / "run")
    rc, out = run_cli(capsys, "infer", "--adapters", final, "--prompt", "w10", "--max_new_tokens", 2)
    assert rc == 0, out


def test_val_dataset_answers_a_preference_datasets_prompts(tmp_path, capsys, lora_run):
    """ms-swift's `--val_dataset`: any preference data train reads (here conversational rows, whose prompt is a
    message list, and a plain-text file) is answered row by row; chosen and rejected are kept next to the answer."""
    base, adapter, _ = lora_run
    conv = write_jsonl(tmp_path / "conv.jsonl", [
        {"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": " w5"}],
         "rejected": [{"role": "assistant", "content": " w6"}]} for p in PROMPTS[:2]])
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": p, "chosen": " w5", "rejected": " w6"} for p in PROMPTS])
    rc, out = run_cli(capsys, "infer", "--model", base, "--adapters", adapter, "--val_dataset", plain,
                      "--max_new_tokens", 3)
    assert rc == 0, out
    got = [json.loads(line) for line in (tmp_path / "plain.infer.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in got] == PROMPTS and all(g["chosen"] == " w5" and "response" in g for g in got)
    rc, out = run_cli(capsys, "infer", "--model", base, "--adapters", adapter, "--val_dataset", conv,
                      "--max_new_tokens", 3, "--use_chat_template", "false")
    assert rc == 1 and "chat template" in out, out  # message lists need a template: the tiny tokenizer has none
    rc, out = run_cli(capsys, "infer", "--model", base, "--adapters", adapter, "--val_dataset", conv, "--template",
                      "chatml", "--max_new_tokens", 3, "--result_path", tmp_path / "r.jsonl")
    assert rc == 0, out
    got = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [g["messages"][0]["content"] for g in got] == PROMPTS[:2]
    rc, out = run_cli(capsys, "infer", "--model", base, "--val_dataset", plain, "--prompt", "w1")
    assert rc == 1 and "exactly one of" in out


def test_prompts_already_rendered_are_not_wrapped_again(tmp_path, model_dirs):
    """Text that already holds the template's end of a user turn (its generation prompt) goes in as it is: wrapping
    it in a second user turn would feed the model a conversation inside a message."""
    from fastdpo.data.template import turn_end

    loaded = load_for_generation(ModelArgs(model=str(chat_model(tmp_path, model_dirs))))
    tok = loaded.tokenizer
    marker = turn_end(tok)
    assert marker == "<eos> assistant"
    text = tok.apply_chat_template([{"role": "user", "content": "w10 w11"}], add_generation_prompt=True,
                                   tokenize=False)
    assert prompt_ids(tok, text, rendered=marker) == tok(text)["input_ids"]
    assert prompt_ids(tok, text) != tok(text)["input_ids"]  # without the check: wrapped a second time
    assert prompt_ids(tok, "w10 w11", rendered=marker) == prompt_ids(tok, "w10 w11")  # unrendered text: templated
    with pytest.raises(FastDPOError, match="already rendered"):
        prompt_ids(tok, text, system="w1", rendered=marker)
    gen = GenerationArgs(max_new_tokens=3)
    seen = []
    import fastdpo.model.generate as infer_mod

    real = infer_mod.prompt_ids
    try:
        infer_mod.prompt_ids = lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw)
        generate_ids(loaded.model, tok, [text], gen)
    finally:
        infer_mod.prompt_ids = real
    assert seen == [marker]  # generation passes the marker on


def test_preference_data_prompts_go_in_as_training_read_them(tmp_path, model_dirs, monkeypatch):
    """--val_dataset / --load_data_args: plain-text prompts are tokenised as training tokenises plain-text rows (as
    they are), conversational ones through the template; with --adapters of a run, the rows are read with the run's
    reading (here --apply_chat_template, which makes plain-text rows user turns)."""
    import fastdpo.model.generate as infer_mod
    from fastdpo.commands.infer import val_rows

    m = chat_model(tmp_path, model_dirs)
    seen = []
    real = infer_mod.prompt_ids
    monkeypatch.setattr(infer_mod, "prompt_ids",
                        lambda tok, p, system="", use=True, rendered=None: seen.append((p, use)) or real(
                            tok, p, system, use, rendered))
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": p, "chosen": " w5", "rejected": " w6"} for p in PROMPTS])
    conv = write_jsonl(tmp_path / "conv.jsonl", [
        {"prompt": [{"role": "user", "content": "w12"}], "chosen": [{"role": "assistant", "content": "w5"}],
         "rejected": [{"role": "assistant", "content": "w6"}]}])
    run_infer(InferConfig(model=str(m), val_dataset=[str(plain), str(conv)], max_new_tokens=1,
                          result_path=str(tmp_path / "r.jsonl")))
    assert seen == [(p, False) for p in PROMPTS] + [([{"role": "user", "content": "w12"}], True)]
    seen.clear()
    run_infer(InferConfig(model=str(m), prompts=str(plain), max_new_tokens=1, result_path=str(tmp_path / "s.jsonl")))
    assert seen == [(p, True) for p in PROMPTS]  # typed prompts: through the template, as before

    seen.clear()  # eval's generation (--reward_fn) answers preference data the same way, in order
    from fastdpo.model.generate import answer_as_read

    loaded = load_for_generation(ModelArgs(model=str(m)))
    mixed = ["w10", [{"role": "user", "content": "w12"}], "w13"]
    answers = answer_as_read(loaded.model, loaded.tokenizer, mixed, GenerationArgs(max_new_tokens=2))
    assert sorted(seen, key=str) == sorted([("w10", False), ("w13", False), (mixed[1], True)], key=str)
    assert answers == [generate_texts(loaded.model, loaded.tokenizer, ["w10"], GenerationArgs(
        max_new_tokens=2, use_chat_template=False))[0], generate_texts(loaded.model, loaded.tokenizer, [mixed[1]],
        GenerationArgs(max_new_tokens=2))[0], generate_texts(loaded.model, loaded.tokenizer, ["w13"], GenerationArgs(
            max_new_tokens=2, use_chat_template=False))[0]]

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model: {m}\ndataset: [{plain}]\napply_chat_template: true\n")
    rows = val_rows(InferConfig(model=str(m), adapters=str(run / "final"), val_dataset=[str(plain)]))
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": p}] for p in PROMPTS]
    assert [r["prompt"] for r in val_rows(InferConfig(model=str(m), val_dataset=[str(plain)]))] == PROMPTS
