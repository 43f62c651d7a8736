"""Fuzzing the data path: whatever bytes, JSON, specs or text come in, loading and tokenising either succeed or raise
a FastDPOError that names where (never another exception, never a hang), and valid rows come back unchanged."""

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdpo.data.load import Row, load_file, load_rows
from fastdpo.data.tokenize import tokenize_rows
from fastdpo.errors import FastDPOError

FUZZ = settings(max_examples=150, deadline=timedelta(seconds=5), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# every code point, surrogates included (they reach us as JSON escapes such as "\ud800")
ANY_CHAR = st.characters(codec=None, exclude_categories=())
TEXT_CHAR = st.characters(exclude_categories=("Cs",))  # what a Python str from valid UTF-8 can hold
TRICKY = ["<eos>", "<bos>", "<pad>", "<unk>", " ", "\n", "\r\n", "\u2028", "\x85", "\x00", "\ufeff", "w5 w6", "w7",
          "\U0001f600", "e\u0301", "\u202e", "[", "{", "\\", '"']
TEXT = st.lists(st.one_of(st.text(TEXT_CHAR, max_size=12), st.sampled_from(TRICKY)), max_size=6).map("".join)
JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(ANY_CHAR, max_size=20))
JSON_VALUE = st.recursive(JSON_SCALAR, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(ANY_CHAR, max_size=8), c,
                                                                                             max_size=4), max_leaves=12)
FIELD = TEXT | st.text(ANY_CHAR, max_size=8) | st.sampled_from(["\ud800", "a\udc80b", "\udfff\ud800"])  # lone surrogates
ROW_DICT = st.fixed_dictionaries({"prompt": FIELD, "chosen": FIELD, "rejected": FIELD},
                                 optional={"extra": JSON_VALUE, "score": JSON_SCALAR})
RECORD = st.one_of(JSON_VALUE, ROW_DICT, st.dictionaries(st.sampled_from(["prompt", "chosen", "rejected", "x"]),
                                                         JSON_VALUE, max_size=4))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def word_tok(model_dirs):
    from fastdpo.model.load import load_tokenizer

    return load_tokenizer(str(model_dirs("qwen3")))


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level BPE tokenizer (as GPT-2, Llama 3, Qwen use): every string maps to tokens, none to <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<bos>"]
    vocab = {s: i for i, s in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def outcome(fn, *args):
    """fn's result, or its FastDPOError (checked to be printable); any other exception fails the test."""
    try:
        return fn(*args)
    except FastDPOError as e:
        str(e).encode("utf-8")  # the CLI must be able to print it
        return e


def is_valid(v) -> bool:
    """A row the loader must accept: prompt/chosen/rejected are valid Unicode text, completions non-empty."""
    if not isinstance(v, dict) or not all(isinstance(v.get(k), str) for k in ("prompt", "chosen", "rejected")):
        return False
    try:
        "".join((v["prompt"], v["chosen"], v["rejected"])).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return bool(v["chosen"]) and bool(v["rejected"])


@FUZZ
@given(data=st.binary(max_size=3000), suffix=st.sampled_from([".jsonl", ".json"]))
def test_random_bytes(workdir, data, suffix):
    path = workdir / f"bytes{suffix}"
    path.write_bytes(data)
    got = outcome(load_rows, [str(path)])
    if isinstance(got, FastDPOError):
        assert str(path) in str(got)


@FUZZ
@given(records=st.lists(RECORD, max_size=6) | st.lists(ROW_DICT, min_size=1, max_size=4), as_array=st.booleans(),
       ascii_only=st.booleans(), blank=st.booleans())
def test_random_json_records(workdir, byte_tok, records, as_array, ascii_only, blank):
    dumps = lambda v: json.dumps(v, ensure_ascii=ascii_only)
    if as_array:
        path, text = workdir / "records.json", "[" + ",\n".join(map(dumps, records)) + "]"
    else:
        path, text = workdir / "records.jsonl", ("\n\n" if blank else "\n").join(map(dumps, records))
    path.write_text(text, encoding="utf-8", errors="surrogatepass")  # a lone surrogate unescaped is bad UTF-8
    got = outcome(load_file, str(path))
    if got and not isinstance(got, FastDPOError):  # whatever loads also tokenises (or fails cleanly)
        outcome(tokenize_rows, byte_tok, got, 32)
    if all(map(is_valid, records)) and (ascii_only or not _has_surrogate(records)):
        assert not isinstance(got, FastDPOError), got
        assert [(r.prompt, r.chosen, r.rejected) for r in got] == [(v["prompt"], v["chosen"], v["rejected"])
                                                                   for v in records]
    elif isinstance(got, FastDPOError):
        where = str(got).split(": ", 1)[0]
        assert where.startswith(str(path)), got
        if ":" in where[len(str(path)):]:  # names a line / row within the file
            line, _, index = where.rsplit(":", 1)[1].partition(" index ")  # `line` or `line index K`
            assert 1 <= int(line) <= max(1, text.count("\n") + 1, len(records)), got
            assert not index or int(index) >= 0, got


def _has_surrogate(v) -> bool:
    try:
        json.dumps(v, ensure_ascii=False).encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


@FUZZ
@given(rows=st.lists(st.fixed_dictionaries({"prompt": st.text(TEXT_CHAR), "chosen": st.text(TEXT_CHAR, min_size=1),
                                            "rejected": st.text(TEXT_CHAR, min_size=1)}), min_size=1, max_size=5),
       as_array=st.booleans(), ascii_only=st.booleans())
def test_valid_rows_of_any_unicode_round_trip(workdir, rows, as_array, ascii_only):
    path = workdir / ("rows.json" if as_array else "rows.jsonl")
    dumps = lambda v: json.dumps(v, ensure_ascii=ascii_only)
    path.write_text("[" + ",".join(map(dumps, rows)) + "]" if as_array else "\n".join(map(dumps, rows)) + "\n",
                    encoding="utf-8")
    got = load_rows([str(path)])
    assert [(r.prompt, r.chosen, r.rejected) for r in got] == [(v["prompt"], v["chosen"], v["rejected"]) for v in rows]


@FUZZ
@given(suffix=st.text(ANY_CHAR, max_size=30) | st.integers(-10, 10**30).map(str))
def test_random_dataset_specs(workdir, suffix):
    path = workdir / "spec.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "d", "chosen": "e", "rejected": "f"}\n')
    got = outcome(load_rows, [f"{path}#{suffix}"])
    if not isinstance(got, FastDPOError):
        assert suffix.isascii() and int(suffix) == len(got) >= 1


@FUZZ
@given(rows=st.lists(st.tuples(TEXT, TEXT, TEXT), min_size=1, max_size=6), max_length=st.integers(1, 48),
       which=st.sampled_from(["word", "byte"]))
def test_tokenize_random_text(word_tok, byte_tok, rows, max_length, which):
    tok = word_tok if which == "word" else byte_tok
    rows = [Row(p, c or "x", r or "y", f"fuzz:{i + 1}") for i, (p, c, r) in enumerate(rows)]
    got = outcome(tokenize_rows, tok, rows, max_length)
    if isinstance(got, FastDPOError):
        return
    pairs, stats = got
    assert 1 <= len(pairs) <= len(rows) and stats.rows == len(rows)
    vocab = len(tok)
    for p in pairs:
        assert 0 <= p.index < len(rows)
        assert p.chosen and p.rejected
        assert len(p.prompt) + len(p.chosen) <= max_length and len(p.prompt) + len(p.rejected) <= max_length
        assert all(0 <= t < vocab for t in p.prompt + p.chosen + p.rejected)


# ---------------------------------------------------------------- huge and deep inputs, in bounded time

DEEP = 200_000
HUGE = 2_000_000


@pytest.mark.parametrize("name, text, ok", [
    ("deep_top.jsonl", "[" * DEEP + "]" * DEEP, False),
    ("deep_field.jsonl", '{"prompt": ' + "[" * DEEP + "]" * DEEP + ', "chosen": "a", "rejected": "b"}', False),
    ("deep_array.json", "[" + '{"a": ' * DEEP + "1" + "}" * DEEP + "]", False),
    ("long_number.jsonl", '{"prompt": ' + "9" * 100_000 + ', "chosen": "a", "rejected": "b"}', False),
    ("huge_field.jsonl", json.dumps({"prompt": "w11", "chosen": " w5" * (HUGE // 3), "rejected": " w7"}), True),
    ("many_keys.jsonl", json.dumps({**{f"k{i}": i for i in range(200_000)}, "prompt": "a", "chosen": "b",
                                    "rejected": "c"}), True),
])
def test_huge_and_deep_inputs_in_bounded_time(workdir, word_tok, name, text, ok):
    path = workdir / name
    path.write_text(text, encoding="utf-8")
    t0 = time.perf_counter()
    got = outcome(load_rows, [str(path)])
    assert isinstance(got, FastDPOError) != ok, got
    if ok:
        pairs, _ = tokenize_rows(word_tok, got, max_length=64)
        assert len(pairs) == 1 and len(pairs[0].prompt) + len(pairs[0].chosen) <= 64
        if name == "huge_field.jsonl":  # cut to max_length, keeping the start
            assert len(pairs[0].prompt) + len(pairs[0].chosen) == 64
    else:
        assert str(got).startswith(f"{path}"), got
    assert time.perf_counter() - t0 < 60  # generous for a loaded CI machine: a hang would not finish at all


def test_special_files_are_refused_not_read(tmp_path):
    import os
    import threading

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # reading it would block forever
    got = []
    reader = threading.Thread(target=lambda: got.append(outcome(load_file, str(fifo))), daemon=True)
    reader.start()
    reader.join(30)
    assert got and isinstance(got[0], FastDPOError) and "not a regular file" in str(got[0]), "blocked on a pipe"
    for bad in ("x" * 5000 + ".jsonl", "a\x00b.jsonl"):
        with pytest.raises(FastDPOError):
            load_file(str(Path(tmp_path) / bad))
