"""Tokenisation: TRL-exact plain text, chat-template round trips, and the three truncation strategies."""

import pytest
from data_helpers import assistant, chat_tokenizer, easy_rows, user
from model_helpers import WORDS

from fastdpo.data.formats import RowError, to_row
from fastdpo.data.template import BUILTIN_TEMPLATES, resolve_template
from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import word_tokenizer


def rows_of(values):
    return [to_row(v, f"t.jsonl:{i + 1}") for i, v in enumerate(values)]


def tok_pairs(tok, values, **opts):
    opts.setdefault("max_length", 512)
    return tokenize_rows(tok, rows_of(values), options=TokenizeOptions(**opts))


def ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def test_plain_rows_tokenise_as_trl():
    tok = word_tokenizer(WORDS)
    values = easy_rows(20, seed=4) + [{"prompt": "", "chosen": "w3 w4<eos>", "rejected": "w5"}]
    pairs, stats = tokenize_rows(tok, rows_of(values), 512)
    for v, p in zip(values, pairs):
        eos = "<eos>"
        pc = ids(tok, v["prompt"] + v["chosen"] + ("" if v["chosen"].endswith(eos) else eos), True)
        pr = ids(tok, v["prompt"] + v["rejected"] + eos, True)
        plen = len(ids(tok, v["prompt"], True))
        assert (p.prompt, p.chosen, p.rejected) == (pc[:plen], pc[plen:], pr[plen:])
    assert [p.index for p in pairs] == list(range(len(values)))
    assert stats.rows == stats.pairs == len(values) and stats.formats == {"standard": len(values)}


@pytest.mark.parametrize("add_bos", [True, False])
def test_strings_and_conversations_give_identical_tokens_with_the_identity_template(add_bos):
    tok = word_tokenizer(WORDS, add_bos=add_bos)
    plain = easy_rows(12, seed=2) + [{"prompt": "w1 w2 w3", "chosen": " w4", "rejected": " w5 w6"}]
    conv = [{"prompt": [user(v["prompt"])], "chosen": [assistant(v["chosen"])], "rejected": [assistant(v["rejected"])]}
            for v in plain[:-1]]
    conv.append({"prompt": [user("w1"), assistant(" w2"), user(" w3")], "chosen": [assistant(" w4")],
                 "rejected": [assistant(" w5 w6")]})  # a multi-turn prompt: the same text
    a, _ = tok_pairs(tok, plain)
    b, stats = tok_pairs(tok, conv, template=BUILTIN_TEMPLATES["identity"])
    assert [(p.prompt, p.chosen, p.rejected) for p in a] == [(p.prompt, p.chosen, p.rejected) for p in b]
    assert stats.formats == {"conversational": len(conv)}


def round_trip(tok, row_value, pair, system=None):
    """prompt + completion tokens == the tokens of the template's full rendering, for both completions."""
    row = rows_of([row_value])[0]
    prompt = list(row.prompt)
    if system and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": system})
    for comp, got in ((row.chosen, pair.chosen), (row.rejected, pair.rejected)):
        full = tok.apply_chat_template(prompt + comp, tools=row.tools, tokenize=False)
        assert pair.prompt + got == ids(tok, full)
    gen = tok.apply_chat_template(prompt, tools=row.tools, tokenize=False, add_generation_prompt=True)
    assert pair.prompt == ids(tok, gen)


def test_chat_template_single_turn():
    tok = chat_tokenizer("chatml")
    value = {"prompt": [user("w1 w2")], "chosen": [assistant("w5 w6")], "rejected": [assistant("w7")]}
    (pair,), _ = tok_pairs(tok, [value])
    assert tok.decode(pair.prompt) == "<|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant"
    assert tok.decode(pair.chosen) == "w5 w6 <|im_end|>"
    assert tok.decode(pair.rejected) == "w7 <|im_end|>"
    round_trip(tok, value, pair)


def test_chat_template_multi_turn_and_system_prompts():
    tok = chat_tokenizer("chatml")
    multi = {"prompt": [user("w1"), assistant("w2"), user("w3")], "chosen": [assistant("w5")],
             "rejected": [assistant("w7")]}
    own = {**multi, "system": "w9"}  # the row's own system prompt wins over --system
    pairs, _ = tok_pairs(tok, [multi, own], system="w8")
    round_trip(tok, multi, pairs[0], system="w8")
    round_trip(tok, own, pairs[1])
    assert tok.decode(pairs[0].prompt).startswith("<|im_start|> system w8 <|im_end|>")
    assert tok.decode(pairs[1].prompt).startswith("<|im_start|> system w9 <|im_end|>")
    assert "w1 <|im_end|> <|im_start|> assistant w2" in tok.decode(pairs[0].prompt)


def test_prefilled_reply_and_hh_rows():
    tok = chat_tokenizer("chatml")
    prefill = {"prompt": [user("w1"), assistant("w2")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
    hh = {"chosen": "\n\nHuman: w1\n\nAssistant: w2\n\nHuman: w3\n\nAssistant: w5",
          "rejected": "\n\nHuman: w1\n\nAssistant: w2\n\nHuman: w3\n\nAssistant: w7"}
    (a, b), _ = tok_pairs(tok, [prefill, hh])
    round_trip(tok, hh, b)
    row = rows_of([prefill])[0]
    full = tok.apply_chat_template(row.prompt + row.chosen, tokenize=False)
    # the reply is a turn of its own, as TRL renders it: only its tokens are scored
    assert a.prompt + a.chosen == ids(tok, full)
    assert tok.decode(a.prompt).endswith("assistant w2 <|im_end|> <|im_start|> assistant")
    assert tok.decode(a.chosen) == "w5 <|im_end|>" and tok.decode(a.rejected) == "w7 <|im_end|>"
    (h,), _ = tok_pairs(tok, [hh], template=BUILTIN_TEMPLATES["hh"])
    assert tok.decode(h.chosen) == "w5 <eos>" and tok.decode(h.rejected) == "w7 <eos>"


def test_template_from_a_jinja_file_receives_the_tools_column(tmp_path):
    f = tmp_path / "tools.jinja"
    f.write_text("{% if tools %}{{ '<|im_start|>tool\n' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}"
                 "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}" + BUILTIN_TEMPLATES["chatml"])
    tok = chat_tokenizer(None)
    value = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")],
             "tools": [{"type": "function", "function": {"name": "get_time"}},
                       {"type": "function", "function": {"name": "get_date"}}]}
    (pair,), _ = tok_pairs(tok, [value], template=resolve_template(str(f)))
    assert tok.decode(pair.prompt).startswith("<|im_start|> tool get_time get_date <|im_end|> <|im_start|> user w1")
    with pytest.raises(FastDPOError, match="neither a built-in"):
        resolve_template(str(tmp_path / "missing.jinja"))


def test_template_mismatch_is_reported_with_the_row():
    bad = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\nw0\n' }}{% endif %}")  # an extra word
    value = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
    with pytest.raises(RowError, match=r"t\.jsonl:1: the chat template renders the prompt differently"):
        tok_pairs(chat_tokenizer(None), [value], template=bad)


def test_tokens_merging_across_the_boundary_are_reported():
    value = {"prompt": [user("w1 w2")], "chosen": [assistant("w5")], "rejected": [assistant(" w7")]}  # "w2w5"
    with pytest.raises(RowError, match=r"t\.jsonl:1: .*merge with the chosen reply"):
        tok_pairs(chat_tokenizer(None), [value], template=BUILTIN_TEMPLATES["identity"])


def test_conversational_rows_need_a_template():
    value = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
    with pytest.raises(RowError, match="no chat_template.*--template"):
        tok_pairs(chat_tokenizer(None), [value])


def test_system_flag_refuses_plain_rows():
    with pytest.raises(RowError, match="--system applies to conversational rows"):
        tok_pairs(word_tokenizer(WORDS), easy_rows(1), system="w9")


def test_identical_pairs_are_dropped_and_counted():
    values = easy_rows(3) + [{"prompt": "w1", "chosen": " w2", "rejected": " w2"}]
    pairs, stats = tok_pairs(word_tokenizer(WORDS), values)
    assert len(pairs) == 3 and stats.dropped_identical == 1 and stats.rows == 4


def test_pairs_identical_once_cut_are_dropped_and_counted():
    """Completions that differ only past the length limit would train a pair with no preference (its loss stays at
    ln 2): dropped, counted, and named in the data summary with what to do."""
    from fastdpo.data.prepare import DataSummary

    values = [{"prompt": "w1", "chosen": " w2 w3 w4", "rejected": " w2 w3 w5"},
              {"prompt": "w1", "chosen": " w2 w6", "rejected": " w7 w8"}]
    options = TokenizeOptions(max_length=4)  # <bos> w1 + 2 completion tokens: w2 w3 on both sides of the first
    pairs, stats = tokenize_rows(word_tokenizer(WORDS), rows_of(values), options=options)
    assert len(pairs) == 1 and stats.dropped_identical_cut == 1 and stats.dropped == 1
    text = DataSummary(stats, options).text()
    assert "1 (chosen and rejected identical once cut to the length limits" in text and "raise --max_length" in text
    assert tokenize_rows(word_tokenizer(WORDS), rows_of(values))[1].dropped_identical_cut == 0


# prompt "w1 w2 w3 w4" -> <bos> w1 w2 w3 w4 (5); chosen -> w5 w6 <eos> (3); rejected -> w7 <eos> (2)
ROW = {"prompt": "w1 w2 w3 w4", "chosen": " w5 w6", "rejected": " w7"}
B, E = 3, 2  # <bos>, <eos>
P, C, R = [B, 5, 6, 7, 8], [9, 10, E], [11, E]


def fit(**opts):
    pairs, stats = tokenize_rows(word_tokenizer(WORDS), rows_of([ROW, {**ROW, "prompt": "w1"}]),
                                 options=TokenizeOptions(**opts))
    return {p.index: (p.prompt, p.chosen, p.rejected) for p in pairs}, stats


def test_truncation_right_cuts_completions_and_drops_prompts_that_fill_max_length():
    assert fit(max_length=8)[0][0] == (P, C, R)
    got, stats = fit(max_length=6)
    assert got[0] == (P, [9], [11]) and stats.truncated == 1
    got, stats = fit(max_length=5)
    assert 0 not in got and stats.dropped_prompt_too_long == 1 and got[1] == ([B, 5], [9, 10, E], [11, E])


def test_truncation_left_trims_the_prompt_and_keeps_completions_whole():
    got, stats = fit(max_length=6, truncation_strategy="left")
    assert got[0] == ([6, 7, 8], C, R) and stats.prompt_trimmed == 1
    long = {"prompt": "w1", "chosen": " w5 w6 w7 w8", "rejected": " w9"}  # chosen: 5 tokens with <eos>
    pairs, stats = tokenize_rows(word_tokenizer(WORDS), rows_of([ROW, long]),
                                 options=TokenizeOptions(max_length=4, truncation_strategy="left"))
    assert [(p.index, p.prompt, p.chosen) for p in pairs] == [(0, [8], C)]
    assert stats.dropped_too_long == 1  # a completion alone fills max_length


def test_truncation_delete_drops_over_length_pairs():
    got, stats = fit(max_length=7, truncation_strategy="delete")
    assert 0 not in got and got[1] == ([B, 5], C, R) and stats.dropped_too_long == 1
    assert fit(max_length=8, truncation_strategy="delete")[0][0] == (P, C, R)


def test_prompt_and_completion_limits():
    got, stats = fit(max_prompt_length=2, max_completion_length=1, max_length=100)
    assert got[0] == ([7, 8], [9], [11]) and stats.prompt_trimmed == 1 and stats.truncated == 2
    got, stats = fit(max_prompt_length=2, max_length=100, truncation_strategy="delete")
    assert 0 not in got and 1 in got and stats.dropped_too_long == 1


def test_no_pair_fits():
    with pytest.raises(FastDPOError, match="No pair fits --max_length 1"):
        fit(max_length=1)
