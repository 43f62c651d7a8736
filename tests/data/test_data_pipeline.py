"""Tokenisation at scale: the fingerprint cache, worker processes, streaming, and training on a stream."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from model_helpers import WORDS
from safetensors.torch import load_file

from fastdpo.config import TrainConfig
from fastdpo.data.prepare import DataOptions, load_pairs
from fastdpo.data.stream import PairStream
from fastdpo.data.tokenize import TokenizeOptions
from fastdpo.model.tiny import word_tokenizer
from fastdpo.training.loop import train


def as_tuples(pairs):
    return [(p.index, p.prompt, p.chosen, p.rejected) for p in pairs]


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", easy_rows(300, seed=5))


def test_cache_hit_and_invalidation(tmp_path, data):
    tok = word_tokenizer(WORDS)
    opts = DataOptions(cache_dir=str(tmp_path / "cache"))
    first, s1 = load_pairs([str(data)], tok, opts)
    again, s2 = load_pairs([str(data)], tok, opts)
    assert not s1.cached and s2.cached
    assert as_tuples(first) == as_tuples(again) and s1.stats == s2.stats
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 1
    # another setting, another tokenizer, other bytes: each is a miss
    _, s3 = load_pairs([str(data)], tok, DataOptions(TokenizeOptions(max_length=7), cache_dir=opts.cache_dir))
    _, s4 = load_pairs([str(data)], word_tokenizer(WORDS, add_bos=False), opts)
    write_jsonl(data, easy_rows(300, seed=6))
    changed, s5 = load_pairs([str(data)], tok, opts)
    assert not (s3.cached or s4.cached or s5.cached)
    assert as_tuples(changed) != as_tuples(first)
    _, s6 = load_pairs([str(data)], tok, DataOptions(use_cache=False, cache_dir=str(tmp_path / "off")))
    assert not s6.cached and not (tmp_path / "off").exists()


def test_worker_processes_give_the_same_pairs(tmp_path, data):
    tok = word_tokenizer(WORDS)
    two, summary = load_pairs([f"{data}#1100"], tok, DataOptions(use_cache=False, num_proc=2))  # three chunks
    ref, _ = load_pairs([f"{data}#1100"], tok, DataOptions(use_cache=False))
    assert as_tuples(two) == as_tuples(ref) and summary.stats.pairs == 1100


def test_one_file_with_every_format(tmp_path):
    from data_helpers import assistant, chat_tokenizer, user

    conv = [user("w1"), assistant("w2"), user("w3")]
    rows = [
        {"prompt": "w1 w2", "chosen": " w5", "rejected": " w7"},
        {"prompt": conv, "chosen": [assistant("w5")], "rejected": [assistant("w7")], "tools": []},
        {"chosen": "w1 w2 w5", "rejected": "w1 w2 w7 w8"},
        {"chosen": conv + [assistant("w5")], "rejected": conv + [assistant("w7")], "system": "w9"},
        {"chosen": "\n\nHuman: w1\n\nAssistant: w5", "rejected": "\n\nHuman: w1\n\nAssistant: w7"},
        {"messages": conv + [assistant("w5")], "rejected_response": "w7"},
        {"messages": conv + [assistant("w5")], "rejected_messages": conv + [assistant("w7")]},
    ]
    f = write_jsonl(tmp_path / "all.jsonl", rows)
    pairs, summary = load_pairs([str(f)], chat_tokenizer("chatml"), DataOptions(use_cache=False))
    assert summary.stats.formats == {"standard": 1, "conversational": 1, "implicit_text": 1,
                                     "implicit_conversational": 1, "hh_rlhf": 1, "ms_swift": 2}
    assert [p.index for p in pairs] == list(range(7))
    tok = chat_tokenizer("chatml")
    assert tok.decode(pairs[2].prompt) == "<bos> w1 w2" and tok.decode(pairs[2].rejected) == "w7 w8 <eos>"
    assert pairs[5].prompt == pairs[6].prompt  # ms-swift: both ways to give the rejected reply
    assert tok.decode(pairs[5].chosen) == tok.decode(pairs[6].chosen) == "w5 <|im_end|>"


def stream_opts(**kw):
    return DataOptions(**{"shuffle_buffer_size": 64, **kw})


def test_stream_yields_every_pair_once_per_epoch_in_a_seeded_order(data):
    tok = word_tokenizer(WORDS)
    ref, _ = load_pairs([str(data)], tok, DataOptions(use_cache=False))
    s = PairStream([str(data)], tok, stream_opts())
    epoch0, epoch1 = s.take(300), s.take(300)
    assert sorted(as_tuples(epoch0)) == sorted(as_tuples(ref)) == sorted(as_tuples(epoch1))
    assert as_tuples(epoch0) != as_tuples(ref)  # shuffled
    assert as_tuples(epoch0) != as_tuples(epoch1)  # reshuffled each epoch
    assert s.stats.rows == 300 and s.stats.pairs == 300
    s.close()
    again = PairStream([str(data)], tok, stream_opts())
    assert as_tuples(again.take(450)) == as_tuples(epoch0 + epoch1[:150])
    other = PairStream([str(data)], tok, stream_opts(seed=7))
    assert as_tuples(other.take(300)) != as_tuples(epoch0)


def test_stream_order_does_not_depend_on_workers(tmp_path):
    tok = word_tokenizer(WORDS)
    f = write_jsonl(tmp_path / "big.jsonl", easy_rows(2500, seed=3))  # three 1024-row chunks
    a = PairStream([str(f)], tok, stream_opts(num_workers=0))
    b = PairStream([str(f)], tok, stream_opts(num_workers=2))
    assert as_tuples(a.take(2600)) == as_tuples(b.take(2600))
    a.close()
    b.close()


def test_stream_interleaves_datasets_and_cycles_short_samples(tmp_path):
    tok = word_tokenizer(WORDS)
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "w1", "chosen": " w2", "rejected": " w3"}] * 2)
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"w{i}", "chosen": " w2", "rejected": " w3"} for i in range(10, 20)])
    s = PairStream([f"{a}#5", f"{b}#3"], tok, stream_opts())
    recs = list(s.records())
    assert [r.where for r in recs] == [f"{a}:1", f"{b}:1", f"{a}:2", f"{b}:2", f"{a}:1", f"{b}:3", f"{a}:2", f"{a}:1"]


def test_stream_reports_a_bad_row_with_its_line(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", easy_rows(5) + [{"prompt": "w1", "chosen": "w2"}])
    s = PairStream([str(f)], word_tokenizer(WORDS), stream_opts())
    with pytest.raises(Exception, match=r"d\.jsonl:6: field 'rejected' is missing"):
        s.take(1)


def run(tmp_path, model_dir, name, data, **kw):
    base = dict(learning_rate=1e-3, max_steps=4, logging_steps=1, seed=3, per_device_train_batch_size=4,
                dataset_cache_dir=str(tmp_path / "cache"))
    cfg = TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})
    return train(cfg, progress=False)


def test_training_on_a_stream_resumes_exactly(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(24, seed=1))
    kw = dict(streaming=True, shuffle_buffer_size=8, dataloader_num_workers=1)
    full = run(tmp_path, m, "full", data, **kw)
    assert len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()) == 4
    summary = json.loads((tmp_path / "full" / "data_summary.json").read_text())
    assert summary["rows"] == 24 and summary["pairs"] == 24
    run(tmp_path, m, "part", data, save_steps=2, **kw)  # leaves checkpoint-2
    resumed = run(tmp_path, m, "part", data, resume_from_checkpoint="latest", **{**kw, "dataloader_num_workers": 0})
    assert resumed["final_dir"].startswith(str(tmp_path / "part"))
    a = load_file(f"{full['final_dir']}/model.safetensors")
    b = load_file(f"{resumed['final_dir']}/model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_training_writes_the_data_summary(tmp_path, model_dirs):
    rows = easy_rows(16, seed=2) + [{"prompt": "w1", "chosen": " w2", "rejected": " w2"},
                                   {"prompt": " ".join(["w9"] * 30), "chosen": " w5", "rejected": " w6"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run(tmp_path, model_dirs("qwen3"), "o", data, max_steps=1, max_length=20)
    s = json.loads((tmp_path / "o" / "data_summary.json").read_text())
    assert (s["rows"], s["pairs"], s["dropped_identical"], s["dropped_prompt_too_long"]) == (18, 16, 1, 1)
    assert s["options"]["truncation_strategy"] == "right" and s["formats"] == {"standard": 18}


@pytest.mark.parametrize("flags, needle", [
    ({"max_steps": -1}, "needs --max_steps"),
    ({"split_dataset_ratio": 0.1}, "--split_dataset_ratio"),
    ({"precompute_ref_log_probs": True}, "--precompute_ref_log_probs"),
    ({"gradient_checkpointing": "auto"}, "auto"),
])
def test_streaming_refuses_what_needs_the_data_ahead(flags, needle):
    from fastdpo.errors import FastDPOError

    cfg = TrainConfig(model="m", dataset=["d.jsonl"], streaming=True, **{"max_steps": 5, **flags})
    with pytest.raises(FastDPOError, match=needle):
        cfg.validate_data()
