"""Records of one prompt with several completions, read as the pairs they stand for.

A record may give several pairs of one prompt:
- a `rejected` list: `prompt`, `chosen`, `rejected: [r1, r2, ...]` (texts, or assistant message lists): the pairs
  (chosen, r_k) in list order;
- ms-swift with a list of rejected replies: `messages` ending with the chosen reply, `rejected_response: [t1, ...]`;
- scored completions: `prompt`, `completions: [...]` with `scores: [...]` (higher is better) or `ranks: [...]`
  (1 is best): the pairs the pairing rule picks;
- UltraFeedback's raw rows: `instruction`, `completions: [{response, fine-grained_score, overall_score,
  annotations}, ...]`: a user turn and assistant replies, paired by a score (`--ultrafeedback_score`).

Pairing rules (`--pairing`), over the scored completions in record order:
- `best_vs_rest`: the best against every completion scored strictly lower;
- `best_vs_worst`: the best against the worst;
- `all_pairs`: every (i, j) with score_i > score_j;
- `ranking`: the completions in score order as one ranking, given as its adjacent pairs (best, second), (second,
  third), ... for Plackett-Luce; a tie is an error there (the likelihood needs a strict order).
Two completions of equal score are never paired; where several share the top (bottom) score, the first in record order
is the best (worst). A completion without a usable score (missing, null, NaN, `N/A`) takes part in no pair. What a
record leaves out is counted on its first pair (`Row.notes`); a record that gives no pair at all (every completion
ties, fewer than two scored) is kept as one `Row` with `dropped` set, so the data summary counts it.

The pairs of one record are adjacent and carry `member` 0, 1, ...: they train exactly as the same pairs written one
per record.
"""

from __future__ import annotations

import dataclasses
import math

from fastdpo.data.formats import Row, RowError, fields_present, refuse_pair_and_label, to_row

PAIRINGS = ("best_vs_rest", "best_vs_worst", "all_pairs", "ranking")
ULTRAFEEDBACK_SCORES = ("auto", "fine-grained_score", "overall_score", "ratings")
TIED, UNSCORED = "tied pairs", "unscored completions"
ALL_TIE, TOO_FEW = "every completion ties", "fewer than two scored completions"
NO_PAIR = (ALL_TIE, TOO_FEW)  # why a record gave no pair


def left_out_text(counts: dict[str, int]) -> str:
    """What pairing left out, counted: '2 tied pairs, 1 row with no pair (every completion ties)'."""
    return ", ".join(f"{n} row{'s' * (n != 1)} with no pair ({k})" if k in NO_PAIR else f"{n} {k if n != 1 else k[:-1]}"
                     for k, n in sorted(counts.items()))


@dataclasses.dataclass(frozen=True)
class Pairing:
    """How a record of scored completions becomes pairs: the rule, and which UltraFeedback score ranks them."""

    rule: str = "best_vs_rest"
    ultrafeedback_score: str = "auto"


DEFAULT_PAIRING = Pairing()


def to_rows(value: object, where: str, formatting: str | None = None, pairing: Pairing = DEFAULT_PAIRING) -> list[Row]:
    """One decoded record as its pairs (one for a plain pair record); raise `RowError` naming the field and a fix."""
    if isinstance(value, dict) and formatting is None:
        if value.get("completions") is not None:
            refuse_pair_and_label(value, where)
            return _scored(value, where, pairing)
        if _is_list_of_replies(value.get("rejected")):
            return _each(value, where, "rejected", formatting)
        if value.get("messages") is not None and isinstance(value.get("rejected_response"), list):
            return _each(value, where, "rejected_response", formatting)
    return [to_row(value, where, formatting)]


def _is_list_of_replies(rejected: object) -> bool:
    """A `rejected` that lists several replies: texts, or message lists (one message list is one reply)."""
    return isinstance(rejected, list) and bool(rejected) and (
        all(isinstance(r, str) for r in rejected) or all(isinstance(r, list) for r in rejected))


def _each(value: dict, where: str, name: str, formatting: str | None) -> list[Row]:
    """The pairs of a record whose `name` lists several rejected replies: (chosen, reply k) for each k."""
    replies = value[name]
    if not replies:
        raise RowError(where, name, "is an empty list.", "Give at least one rejected reply.")
    rows = []
    for k, reply in enumerate(replies):
        try:
            row = to_row({**value, name: reply}, where, formatting)
        except RowError as e:
            field = f"{name}[{k}]" + (e.field[len(name):] if e.field and e.field.startswith(name) else "")
            raise RowError(e.where, field if e.field and e.field.startswith(name) else e.field, e.problem, e.fix,
                           e.kind) from None
        rows.append(dataclasses.replace(row, member=k))
    return rows


def _number(x: object) -> float | None:
    """A usable score, else None: numbers (not booleans), numeric strings; NaN, `N/A` and the rest are not."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return None if math.isnan(x) or math.isinf(x) else float(x)
    if isinstance(x, str):
        try:
            v = float(x)
        except ValueError:
            return None
        return None if math.isnan(v) or math.isinf(v) else v
    return None


def pairs_by_rule(scores: list[float | None], rule: str) -> tuple[list[tuple[int, int]], int]:
    """(preferred, dispreferred) index pairs of the scored completions by `rule`, and the tied pairs left out."""
    scored = [i for i, s in enumerate(scores) if s is not None]
    if len(scored) < 2:
        return [], 0
    top = max(scores[i] for i in scored)
    bottom = min(scores[i] for i in scored)
    best = next(i for i in scored if scores[i] == top)
    if rule == "best_vs_worst":
        worst = next(i for i in scored if scores[i] == bottom)
        return ([(best, worst)], 0) if top > bottom else ([], 1)
    if rule == "ranking":  # ties are refused by the caller
        order = sorted(scored, key=lambda i: -scores[i])
        return list(zip(order, order[1:])), 0
    if rule == "best_vs_rest":
        pairs = [(best, j) for j in scored if scores[j] < top]
        return pairs, sum(1 for j in scored if j != best and scores[j] == top)
    pairs = [(i, j) for i in scored for j in scored if scores[i] > scores[j]]
    tied = sum(1 for a, i in enumerate(scored) for j in scored[a + 1:] if scores[i] == scores[j])
    return pairs, tied


def _scores(value: dict, where: str, n: int) -> list[float | None]:
    """The completions' scores from `scores` (higher is better) or `ranks` (1 is best), one per completion."""
    has_scores, has_ranks = value.get("scores") is not None, value.get("ranks") is not None
    if has_scores == has_ranks:
        problem = "are both given" if has_scores else f"are both missing (fields present: {fields_present(value)})"
        raise RowError(where, "scores", f"and ranks {problem}.", "Give the completions' scores (higher is better) "
                       "or their ranks (1 is best), one per completion.")
    name = "scores" if has_scores else "ranks"
    given = value[name]
    if not isinstance(given, list) or len(given) != n:
        got = f"{len(given)} values" if isinstance(given, list) else type(given).__name__
        raise RowError(where, name, f"must list one value per completion ({n}), got {got}.", "Fix the row.")
    numbers = [_number(x) for x in given]
    return numbers if has_scores else [None if x is None else -x for x in numbers]


def _ultrafeedback_score(c: dict, which: str) -> float | None:
    """One UltraFeedback completion's score: fine-grained_score (the mean of the aspect ratings), overall_score (the
    critique's 1-10), or the mean of the numeric aspect ratings; `auto` takes the first of these it finds."""
    order = ("fine-grained_score", "overall_score", "ratings") if which == "auto" else (which,)
    for name in order:
        if name == "ratings":
            notes = c.get("annotations") if isinstance(c.get("annotations"), dict) else {}
            ratings = [_number(a.get("Rating")) for a in notes.values() if isinstance(a, dict)]
            ratings = [r for r in ratings if r is not None]
            score = sum(ratings) / len(ratings) if ratings else None
        else:
            score = _number(c.get(name))
        if score is not None:
            return score
    return None


def _scored(value: dict, where: str, pairing: Pairing) -> list[Row]:
    """A record of several completions with scores or ranks (or UltraFeedback's raw form) as the pairs its rule
    picks."""
    completions = value["completions"]
    if not isinstance(completions, list) or not completions:
        raise RowError(where, "completions", "must be a non-empty list of completions.", "Fix the row.")
    ultra = value.get("prompt") is None and value.get("instruction") is not None
    if ultra:
        for k, c in enumerate(completions):
            if not isinstance(c, dict) or not isinstance(c.get("response"), str):
                raise RowError(where, f"completions[{k}]", "must be an object with the response text (UltraFeedback: "
                               "response, fine-grained_score, overall_score, annotations).", "Fix the completion.")
        scores = [_ultrafeedback_score(c, pairing.ultrafeedback_score) for c in completions]
        replies = [[{"role": "assistant", "content": c["response"]}] for c in completions]
        base = {"prompt": [{"role": "user", "content": value["instruction"]}]}
        fmt = "ultrafeedback"
    else:
        if value.get("prompt") is None:
            raise RowError(where, "prompt", f"is missing (fields present: {fields_present(value)}).",
                           "A record of scored completions needs the prompt they answer.")
        scores = _scores(value, where, len(completions))
        replies, base, fmt = completions, {"prompt": value["prompt"]}, "completions"
    for key in ("system", "tools"):
        if value.get(key) is not None:
            base[key] = value[key]
    if pairing.rule == "ranking":
        given = sorted(s for s in scores if s is not None)
        if any(a == b for a, b in zip(given, given[1:])):
            name = "scores" if value.get("scores") is not None else "ranks" if not ultra else "completions"
            raise RowError(where, name, "has tied values: a ranking (--pairing ranking, Plackett-Luce) needs a "
                           "strict order of its completions.", "Break the tie in the data, or train a pairwise loss "
                           "with --pairing best_vs_rest (it leaves tied pairs out).", kind="tied ranking")
    pairs, tied = pairs_by_rule(scores, pairing.rule)
    unscored = sum(s is None for s in scores)
    notes = tuple((k, v) for k, v in ((TIED, tied), (UNSCORED, unscored)) if v)
    if not pairs:
        reason = TOO_FEW if len(completions) - unscored < 2 else ALL_TIE
        first = _pair(base, replies, 0, min(1, len(replies) - 1), where, fmt)
        return [dataclasses.replace(first, notes=notes, dropped=reason)]
    rows = [dataclasses.replace(_pair(base, replies, i, j, where, fmt), member=m) for m, (i, j) in enumerate(pairs)]
    rows[0] = dataclasses.replace(rows[0], notes=notes)
    return rows


def _pair(base: dict, replies: list, i: int, j: int, where: str, fmt: str) -> Row:
    """Completions i and j of a record as one pair, errors naming the completions."""
    try:
        row = to_row({**base, "chosen": replies[i], "rejected": replies[j]}, where)
    except RowError as e:
        at = {"chosen": f"completions[{i}]", "rejected": f"completions[{j}]"}
        field = next((at[k] + e.field[len(k):] for k in at if e.field and e.field.startswith(k)), e.field)
        raise RowError(e.where, field, e.problem, e.fix, e.kind) from None
    return dataclasses.replace(row, format=fmt)
