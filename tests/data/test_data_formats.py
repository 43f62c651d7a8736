"""Every preference row format normalises to the same Row; every bad row names its location, field and a fix."""

import pytest
from data_helpers import assistant, user

from fastdpo.data.formats import RowError, parse_hh, to_row

W = "f.jsonl:7"


def test_standard_strings():
    row = to_row({"prompt": "w1 w2", "chosen": " w5", "rejected": " w7", "id": 3}, W)
    assert (row.prompt, row.chosen, row.rejected, row.format, row.source) == ("w1 w2", " w5", " w7", "standard", W)
    assert not row.conversational


def test_conversational_with_multi_turn_prompt_and_system_column():
    prompt = [user("w1"), assistant("w2"), user("w3")]
    row = to_row({"prompt": prompt, "chosen": [assistant("w5")], "rejected": [assistant("w7")], "system": "w9"}, W)
    assert row.format == "conversational" and row.conversational
    assert row.prompt == [{"role": "system", "content": "w9"}, *prompt]
    assert row.chosen == [assistant("w5")] and row.rejected == [assistant("w7")]


def test_string_prompt_with_message_completions_becomes_a_user_turn():
    row = to_row({"prompt": "w1", "chosen": [assistant("w5")], "rejected": [assistant("w7")]}, W)
    assert row.prompt == [user("w1")] and row.format == "conversational"


def test_implicit_conversational_prompt_is_the_common_prefix():
    shared = [{"role": "system", "content": "w0"}, user("w1"), assistant("w2"), user("w3")]
    value = {"chosen": shared + [assistant("w5")], "rejected": shared + [assistant("w7"), user("w8"), assistant("w9")]}
    row = to_row(value, W)
    assert row.format == "implicit_conversational"
    assert row.prompt == shared
    assert row.chosen == [assistant("w5")]
    assert row.rejected == [assistant("w7"), user("w8"), assistant("w9")]
    # UltraFeedback style: a string prompt column copying the first user turn; the conversations hold the prompt
    row2 = to_row({"prompt": "w1", **value}, W)
    assert row2.prompt == shared and row2.format == "implicit_conversational"
    # ... and a `messages` column holding a copy of the chosen conversation for SFT
    assert to_row({"prompt": "w1", **value, "messages": value["chosen"]}, W).prompt == shared


def test_implicit_text_prompt_cut_at_a_word_boundary():
    row = to_row({"chosen": "Q: w1 w2 A: w55", "rejected": "Q: w1 w2 A: w56 w7"}, W)
    assert (row.prompt, row.chosen, row.rejected) == ("Q: w1 w2 A:", " w55", " w56 w7")
    assert row.prompt + row.chosen == "Q: w1 w2 A: w55" and row.format == "implicit_text"


def test_hh_rlhf_text_becomes_a_conversation():
    hist = "\n\nHuman: w1 w2\n\nAssistant: w3\n\nHuman: w4"
    row = to_row({"chosen": hist + "\n\nAssistant: w5 w6", "rejected": hist + "\n\nAssistant: w7"}, W)
    assert row.format == "hh_rlhf"
    assert row.prompt == [user("w1 w2"), assistant("w3"), user("w4")]
    assert row.chosen == [assistant("w5 w6")] and row.rejected == [assistant("w7")]
    assert parse_hh("just text") is None


def test_ms_swift_rejected_response_and_rejected_messages():
    msgs = [user("w1"), assistant("w5")]
    row = to_row({"messages": msgs, "rejected_response": "w7", "system": "w9"}, W)
    assert row.format == "ms_swift"
    assert row.prompt == [{"role": "system", "content": "w9"}, user("w1")]
    assert row.chosen == [assistant("w5")] and row.rejected == [assistant("w7")]
    row = to_row({"messages": msgs, "rejected_messages": [user("w1"), assistant("w7")]}, W)
    assert row.prompt == [user("w1")] and row.rejected == [assistant("w7")]


def test_tools_column_as_list_or_json_text():
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    base = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
    assert to_row({**base, "tools": tools}, W).tools == tools
    assert to_row({**base, "tools": '[{"type": "function", "function": {"name": "get_time"}}]'}, W).tools == tools


def test_null_keys_of_columnar_messages_are_dropped():
    m = {"role": "assistant", "content": "w5", "tool_calls": None}
    row = to_row({"prompt": [user("w1")], "chosen": [m], "rejected": [assistant("w7")]}, W)
    assert row.chosen == [assistant("w5")]


def test_identical_pairs_are_flagged_not_rejected():
    assert to_row({"prompt": "w1", "chosen": "w2", "rejected": "w2"}, W).identical
    assert not to_row({"prompt": "w1", "chosen": "w2", "rejected": "w3"}, W).identical


BAD = [
    ("not an object", ["w1"], None, "expected a JSON object"),
    ("missing field", {"prompt": "a", "chosen": "b"}, "rejected", "is missing"),
    ("no preference fields", {"question": "a"}, None, "no preference fields"),
    ("wrong type", {"prompt": "a", "chosen": 3, "rejected": "c"}, "chosen", "got int"),
    ("null completion", {"prompt": "a", "chosen": "b", "rejected": None}, "rejected", "is missing"),
    ("empty string", {"prompt": "a", "chosen": "b", "rejected": ""}, "rejected", "is empty"),
    ("lone surrogate", {"prompt": "a\ud800", "chosen": "b", "rejected": "c"}, "prompt", "unpaired surrogate"),
    ("lone surrogate in a message", {"prompt": [user("a")], "chosen": [assistant("b\udc80")],
                                     "rejected": [assistant("c")]}, "chosen[0].content", "unpaired surrogate"),
    ("mixed forms", {"prompt": "a", "chosen": [assistant("b")], "rejected": "c"}, "rejected", "same form"),
    ("string completions, message prompt", {"prompt": [user("a")], "chosen": "b", "rejected": "c"}, "chosen",
     "prompt is a list"),
    ("message without role", {"prompt": [{"content": "a"}], "chosen": [assistant("b")], "rejected": [assistant("c")]},
     "prompt[0].role", "is missing"),
    ("non-text content", {"prompt": [user("a")], "chosen": [{"role": "assistant", "content": [1]}],
                          "rejected": [assistant("c")]}, "chosen[0].content", "must be a string"),
    ("completion not by the assistant", {"prompt": [user("a")], "chosen": [user("b")], "rejected": [assistant("c")]},
     "chosen[0].role", "assistant turn"),
    ("empty message list", {"prompt": [user("a")], "chosen": [], "rejected": [assistant("c")]}, "chosen", "empty list"),
    ("ms-swift without rejected", {"messages": [user("a"), assistant("b")]}, "rejected_response", "rejected_messages"),
    ("ms-swift with TRL's rejected", {"messages": [user("a"), assistant("b")], "rejected": "c"}, "rejected",
     "goes in rejected_response or rejected_messages"),
    ("ms-swift ending with the user", {"messages": [user("a")], "rejected_response": "c"}, "messages", "ends with"),
    ("bad tools", {"prompt": "a", "chosen": "b", "rejected": "c", "tools": "[{"}, "tools", "not valid JSON"),
    ("implicit conversation ends early", {"chosen": [user("a"), assistant("b")], "rejected": [user("a")]},
     "rejected", "ends where"),
]


@pytest.mark.parametrize("value, field, needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_rows_name_location_field_and_fix(value, field, needle):
    with pytest.raises(RowError) as info:
        to_row(value, W)
    msg = str(info.value)
    assert msg.startswith(W + ":"), msg
    assert needle in msg, msg
    if field:
        assert f"field {field!r}" in msg, msg
    assert info.value.fix, "every message carries a fix"
