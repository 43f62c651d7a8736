"""Records of one prompt with several completions (a rejected list, ms-swift's rejected_response list, scored or
ranked completions, UltraFeedback's raw rows) read as the pairs they stand for, and trained exactly as those pairs
written one per row."""

import json

import pytest
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

from fastdpo.config import TrainConfig
from fastdpo.data.columns import RowOptions
from fastdpo.data.formats import RowError
from fastdpo.data.groups import ALL_TIE, TIED, TOO_FEW, UNSCORED, Pairing, pairs_by_rule, to_rows
from fastdpo.data.load import load_rows
from fastdpo.errors import FastDPOError


def texts(rows):
    return [(r.prompt, r.chosen, r.rejected) for r in rows]


def test_a_rejected_list_is_the_pairs_of_its_chosen_with_each():
    rows = to_rows({"prompt": "Q", "chosen": " a", "rejected": [" b", " c"]}, "f:1")
    assert texts(rows) == [("Q", " a", " b"), ("Q", " a", " c")]
    assert [r.member for r in rows] == [0, 1] and {r.format for r in rows} == {"standard"}
    conv = to_rows({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "a"}],
                    "rejected": [[{"role": "assistant", "content": "b"}], [{"role": "assistant", "content": "c"}]]},
                   "f:2")
    assert [r.rejected for r in conv] == [[{"role": "assistant", "content": "b"}],
                                         [{"role": "assistant", "content": "c"}]]
    one = to_rows({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "a"}],
                   "rejected": [{"role": "assistant", "content": "b"}]}, "f:3")  # one message list: one pair
    assert len(one) == 1


def test_ms_swift_rejected_response_list():
    rows = to_rows({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a"}],
                    "rejected_response": ["b", "c", "d"]}, "f:1")
    assert [r.rejected[0]["content"] for r in rows] == ["b", "c", "d"]
    assert {r.format for r in rows} == {"ms_swift"}


def test_a_bad_member_is_named_by_its_place():
    with pytest.raises(RowError) as e:
        to_rows({"prompt": "Q", "chosen": " a", "rejected": [" b", ""]}, "f:4")
    assert e.value.field == "rejected[1]" and "f:4" in str(e.value)
    with pytest.raises(RowError) as e:
        to_rows({"prompt": "Q", "completions": ["a", ""], "scores": [2, 1]}, "f:5")
    assert e.value.field == "completions[1]"


@pytest.mark.parametrize("rule, scores, pairs, tied", [
    ("best_vs_rest", [3, 1, 3, 2], [(0, 1), (0, 3)], 1),
    ("best_vs_worst", [3, 1, 3, 1], [(0, 1)], 0),
    ("all_pairs", [3, 1, 3, 2], [(0, 1), (0, 3), (2, 1), (2, 3), (3, 1)], 1),
    ("all_pairs", [1, None, 2], [(2, 0)], 0),
    ("best_vs_rest", [2, 2, 2], [], 2),
    ("best_vs_worst", [2, 2], [], 1),
])
def test_pairing_rules(rule, scores, pairs, tied):
    assert pairs_by_rule(scores, rule) == (pairs, tied)


def test_all_pairs_against_a_direct_enumeration():
    import random

    rng = random.Random(0)
    for _ in range(50):
        scores = [rng.choice([None, 1, 2, 3, 4]) for _ in range(rng.randint(1, 7))]
        got, tied = pairs_by_rule(scores, "all_pairs")
        ok = [i for i, s in enumerate(scores) if s is not None]
        assert sorted(got) == sorted((i, j) for i in ok for j in ok if scores[i] > scores[j])
        assert tied == sum(1 for a in ok for b in ok if a < b and scores[a] == scores[b])


def test_ranks_read_as_scores_and_what_is_left_out_is_counted():
    rows = to_rows({"prompt": "Q", "completions": ["x", "y", "z"], "ranks": [2, 1, 3]}, "f:1")
    assert [(r.chosen, r.rejected) for r in rows] == [("y", "x"), ("y", "z")]
    rows = to_rows({"prompt": "Q", "completions": ["a", "b", "c", "d"], "scores": [3, float("nan"), 3, "N/A"]}, "f:2")
    assert [(r.chosen, r.rejected) for r in rows] == [("a", "c")] or rows[0].dropped
    assert rows[0].dropped == ALL_TIE and dict(rows[0].notes) == {TIED: 1, UNSCORED: 2}
    rows = to_rows({"prompt": "Q", "completions": ["a", "b"], "scores": [1, None]}, "f:3")
    assert rows[0].dropped == TOO_FEW


@pytest.mark.parametrize("record, field", [
    ({"prompt": "Q", "completions": ["a", "b"]}, "scores"),
    ({"prompt": "Q", "completions": ["a", "b"], "scores": [1, 2], "ranks": [1, 2]}, "scores"),
    ({"prompt": "Q", "completions": ["a", "b"], "scores": [1]}, "scores"),
    ({"completions": ["a", "b"], "scores": [1, 2]}, "prompt"),
    ({"prompt": "Q", "completions": [], "scores": []}, "completions"),
    ({"instruction": "Q", "completions": [{"text": "a"}]}, "completions[0]"),
])
def test_bad_scored_records_are_named(record, field):
    with pytest.raises(RowError) as e:
        to_rows(record, "data.jsonl:7")
    assert e.value.field == field and str(e.value).startswith("data.jsonl:7")


def ultrafeedback(scores, overall=(8, 3, 5)):
    return {"instruction": "Say hi", "models": ["m1", "m2", "m3"], "completions": [
        {"response": f"reply {k}", "fine-grained_score": s, "overall_score": o,
         "annotations": {"helpfulness": {"Rating": str(k + 1)}, "honesty": {"Rating": "N/A"}}}
        for k, (s, o) in enumerate(zip(scores, overall))]}


def test_ultrafeedback_raw_rows():
    rows = to_rows(ultrafeedback([4.5, 1.25, 3.0]), "uf:1")
    assert [r.format for r in rows] == ["ultrafeedback"] * 2
    assert rows[0].prompt == [{"role": "user", "content": "Say hi"}]
    assert [(r.chosen[0]["content"], r.rejected[0]["content"]) for r in rows] == [("reply 0", "reply 1"),
                                                                                  ("reply 0", "reply 2")]
    by_overall = to_rows(ultrafeedback([4.5, 1.25, 3.0], (2, 9, 5)), "uf:1", pairing=Pairing("best_vs_worst",
                                                                                                "overall_score"))
    assert [(r.chosen[0]["content"], r.rejected[0]["content"]) for r in by_overall] == [("reply 1", "reply 0")]
    ratings = to_rows(ultrafeedback(["N/A", "N/A", "N/A"]), "uf:1")  # auto falls back to the next score there is
    assert ratings[0].chosen[0]["content"] == "reply 0"  # overall_score 8 is the best
    by_ratings = to_rows(ultrafeedback([4.5, 1.25, 3.0]), "uf:1", pairing=Pairing("best_vs_worst", "ratings"))
    assert [(r.chosen[0]["content"], r.rejected[0]["content"]) for r in by_ratings] == [("reply 2", "reply 0")]


def test_load_rows_keeps_a_records_pairs_together_and_samples_records(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Q{i}", "chosen": " a", "rejected": [" b", " c", " d"]}
                                              for i in range(6)])
    rows = load_rows([str(data)])
    assert len(rows) == 18 and [r.member for r in rows[:4]] == [0, 1, 2, 0]
    sampled = load_rows([f"{data}#2"])
    assert len(sampled) == 6 and [r.member for r in sampled] == [0, 1, 2, 0, 1, 2]
    first = load_rows([str(data)], read=RowOptions(max_samples=1))
    assert texts(first) == texts(rows[:3])


def test_pairing_flags_are_checked():
    with pytest.raises(FastDPOError, match="pairing"):
        TrainConfig(model="m", dataset="d", pairing="random").validate_reading()
    with pytest.raises(FastDPOError, match="ultrafeedback_score"):
        TrainConfig(model="m", dataset="d", ultrafeedback_score="best").validate_reading()


def grouped_and_flat(rows_per_prompt: int = 3):
    """The same pairs as records of several completions and as one pair per record."""
    base = easy_rows(8, seed=2)
    grouped, flat = [], []
    for i, r in enumerate(base):
        others = [r["rejected"]] + [base[(i + k) % len(base)]["rejected"] for k in range(1, rows_per_prompt)]
        grouped.append({"prompt": r["prompt"], "chosen": r["chosen"], "rejected": others})
        flat += [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": o} for o in others]
    return grouped, flat


@pytest.mark.parametrize("streaming", [False, True])
def test_several_rejected_train_exactly_as_the_pairs_written_one_per_row(tmp_path, model_dirs, streaming):
    from fastdpo.training.loop import train

    grouped, flat = grouped_and_flat()
    out = {}
    for name, rows in (("grouped", grouped), ("flat", flat)):
        data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / name),
                          max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                          seed=5, logging_steps=1, streaming=streaming, gradient_checkpointing="none")
        train(cfg, progress=False)
        out[name] = tmp_path / name
    timing = ("per_second", "time", "memory/", "mfu", "gc/")
    metrics = [[{k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
                for line in open(out[n] / "metrics.jsonl")] for n in ("grouped", "flat")]
    assert metrics[0] == metrics[1]
    a, b = (load_file(out[n] / "final" / "model.safetensors") for n in ("grouped", "flat"))
    assert all(a[k].equal(b[k]) for k in a)
    if not streaming:
        summary = json.loads((out["grouped"] / "data_summary.json").read_text())
        assert (summary["records"], summary["rows"], summary["several"], summary["pairs"]) == (8, 24, 8, 24)


def test_check_data_reports_groups_and_what_pairing_left_out(tmp_path, capsys, model_dirs):
    from fastdpo.cli import main

    rows = [{"prompt": "Q one two", "chosen": " a", "rejected": [" b", " c"]},
            {"prompt": "Q two", "completions": [" a", " b", " c"], "scores": [3, 2, 1]},
            {"prompt": "Q five", "completions": [" a", " b", " c"], "scores": [2, 2, 1]},
            {"prompt": "Q three", "completions": [" a", " b"], "scores": [1, 1]},
            {"prompt": "Q four", "chosen": " a", "rejected": " b"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    code = main(["check-data", "--dataset", str(data), "--model", str(model_dirs("qwen3"))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "several completions per prompt: 2 rows give 4 pairs" in out
    assert "with each prompt and each distinct completion once" in out
    assert "2 tied pairs" in out and "1 row with no pair (every completion ties)" in out


def test_check_data_names_prompts_that_differ_only_in_whitespace(tmp_path, capsys):
    from fastdpo.cli import main

    rows = [{"prompt": "What is  2+2?", "chosen": " 4", "rejected": " 5"},
            {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 22"},
            {"prompt": "What is 2+2?\n", "chosen": " 4", "rejected": " 7"},
            {"prompt": "What is 2+3?", "chosen": " 5", "rejected": " 6"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    assert main(["check-data", "--dataset", str(data)]) == 0
    out = capsys.readouterr().out
    assert "prompts that differ only in whitespace (1)" in out
    assert f"{data}:2: the prompt of {data}:1 but for whitespace" in out and ":4:" not in out
