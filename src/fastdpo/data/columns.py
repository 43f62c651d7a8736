"""What happens to a record before and after its format is detected: dataset columns renamed to fastdpo's names
(`--columns`, as ms-swift's; OpenRLHF's `--prompt_key` / `--chosen_key` / `--rejected_key` add to it), and
OpenRLHF's prompt handling for plain-text rows: `--input_template` wraps the prompt text, `--apply_chat_template`
turns the prompt into a user turn so the chat template applies (message-list rows always go through it).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from fastdpo.data.dataset_info import DatasetRead
from fastdpo.data.formats import Row, RowError, fields_present
from fastdpo.data.groups import DEFAULT_PAIRING, Pairing
from fastdpo.errors import FastDPOError

# the columns fastdpo reads (see fastdpo.data.formats): what --columns may rename a dataset column to
COLUMN_NAMES = ("prompt", "chosen", "rejected", "system", "tools", "messages", "rejected_response", "rejected_messages",
                "instruction", "input", "history", "conversations", "completions", "scores", "ranks", "completion",
                "label", "images", "rejected_images")
KEY_FLAGS = {"prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected"}  # OpenRLHF
MAX_ROW_BYTES = 16 << 20  # --max_row_mb's default: far above any row that fits a context window


def column_mapping(columns: object) -> tuple[tuple[str, str], ...]:
    """--columns {dataset column: fastdpo column} -> sorted pairs; a FastDPOError names what is wrong."""
    if not isinstance(columns, dict):
        raise FastDPOError(f"--columns must be a JSON object (dataset column -> fastdpo column), got {columns!r}.")
    seen: dict[str, str] = {}
    for source, target in columns.items():
        if not isinstance(source, str) or not isinstance(target, str) or not source:
            raise FastDPOError(f"--columns: {source!r}: {target!r} must map a column name to a column name.")
        close = difflib.get_close_matches(target, COLUMN_NAMES, n=1)
        if target not in COLUMN_NAMES and close:  # another name sets a column aside; a near miss is a typo
            raise FastDPOError(f"--columns maps {source!r} to {target!r}, which fastdpo does not read. Did you mean "
                               f"{close[0]!r}? (Columns fastdpo reads: {', '.join(COLUMN_NAMES)}.)")
        if target in seen:
            raise FastDPOError(f"--columns maps both {seen[target]!r} and {source!r} to {target!r}. Keep one.")
        seen[target] = source
    return tuple(sorted(columns.items()))


def add_key_flag(columns: dict, flag: str, source: str) -> None:
    """`--prompt_key COL` (or chosen/rejected): add COL -> prompt to `columns`, refusing a different mapping of
    either side."""
    target = KEY_FLAGS[flag]
    if columns.get(source, target) != target:
        raise FastDPOError(f"--{flag} {source} maps column {source!r} to {target}, but --columns maps it to "
                           f"{columns[source]!r}. Drop one of them.")
    other = next((s for s, t in columns.items() if t == target and s != source), None)
    if other is not None:
        raise FastDPOError(f"--{flag} {source} names the {target} column, but --columns (or another flag) names "
                           f"{other!r}. Drop one of them.")
    columns[source] = target


def check_input_template(template: str) -> None:
    """OpenRLHF's --input_template: Python format text with one `{}` where the prompt goes."""
    try:
        filled = template.format("\0")
    except (IndexError, KeyError, ValueError) as e:
        raise FastDPOError(f"--input_template {template!r} is not a valid template ({type(e).__name__}: {e}). Put "
                           "{} where the prompt goes and write other braces as {{ and }}.") from None
    if "\0" not in filled:
        raise FastDPOError(f"--input_template {template!r} has no {{}} for the prompt, e.g. 'User: {{}}\\nAssistant: '.")
    if "\\n" in template:
        raise FastDPOError(f"--input_template {template!r} holds the two characters \\n, not a newline. Pass a real "
                           "newline: $'User: {}\\nAssistant: ' in Bash, or a double-quoted string in YAML.")


def check_row_flags(cfg) -> None:
    """--columns, --dataset_info, --input_template and --apply_chat_template of a config (train, check-data, eval)."""
    read = RowOptions.from_config(cfg)
    named = set(getattr(cfg, "dataset", [])) | set(getattr(cfg, "val_dataset", []))
    stray = [spec for spec, _ in read.datasets if spec not in named]
    if stray:
        lists = "--dataset and --val_dataset do" if hasattr(cfg, "val_dataset") else "--dataset does"
        raise FastDPOError(f"--dataset_info gives a reading for {', '.join(stray)}, which {lists} not name. Key each "
                           "reading by a dataset as written there, and leave out the others' readings.")
    if cfg.input_template:
        check_input_template(cfg.input_template)
        if cfg.apply_chat_template:
            raise FastDPOError("--input_template and --apply_chat_template both wrap the prompt (OpenRLHF uses the "
                               "input template only without the chat template). Drop one.")


@dataclass(frozen=True)
class RowOptions:
    """How records become rows. Part of the tokenisation cache key (but `max_row_bytes`: a row it lets through is
    read the same whatever the limit)."""

    columns: tuple[tuple[str, str], ...] = ()  # (dataset column, fastdpo column)
    input_template: str = ""
    apply_chat_template: bool = False
    datasets: tuple[tuple[str, DatasetRead], ...] = ()  # (dataset spec, its own reading): --dataset_info
    max_samples: int = 0  # the first N rows of each dataset, after `#N` (0: all)
    max_row_bytes: int = MAX_ROW_BYTES  # a larger row (line, array element, CSV record) is refused as it is read
    pairing: Pairing = DEFAULT_PAIRING  # which pairs a record of scored completions gives
    images: bool = False  # read rows with images (`fastdpo.data.vision`); else they are refused (training)

    @classmethod
    def from_config(cls, cfg) -> RowOptions:
        own = getattr(cfg, "dataset_info", None) or {}
        return cls(column_mapping(getattr(cfg, "columns", None) or {}), getattr(cfg, "input_template", ""),
                   getattr(cfg, "apply_chat_template", False),
                   tuple(sorted((spec, DatasetRead.from_dict(spec, d)) for spec, d in own.items())),
                   getattr(cfg, "max_samples", 0), int(getattr(cfg, "max_row_mb", MAX_ROW_BYTES / 2**20) * 2**20),
                   Pairing(_pairing_rule(cfg), getattr(cfg, "ultrafeedback_score", DEFAULT_PAIRING.ultrafeedback_score)))

    def reading(self, dataset: str) -> DatasetRead | None:
        """The reading of dataset spec `dataset` when --dataset_info gives it one (it replaces --columns there)."""
        return next((read for spec, read in self.datasets if spec == dataset), None)

    def rename(self, value: object, where: str) -> object:
        """The record with its mapped columns renamed (all at once, so a mapping may swap two columns)."""
        if not self.columns or not isinstance(value, dict):
            return value
        mapped = dict(self.columns)
        out = {k: v for k, v in value.items() if k not in mapped}
        for source, target in self.columns:
            if source not in value:
                raise RowError(where, source, f"is missing (fields present: {fields_present(value)}), but the column "
                               f"mapping renames it to {target}.", "Fix --columns (or --prompt_key / --chosen_key / "
                               "--rejected_key): it applies to every row of every dataset, --val_dataset included.")
            if target in out:
                raise RowError(where, target, f"is already a column, and --columns renames {source!r} to it.",
                               f"Drop one of the two columns, or map {target!r} elsewhere.")
            out[target] = value[source]
        return out

    def adapt(self, row: Row) -> Row:
        """The prompt handling asked for: --input_template around a plain-text prompt, or --apply_chat_template's
        user turn."""
        if not (self.input_template or self.apply_chat_template) or (row.conversational and not self.input_template):
            return row
        flag = "--input_template" if self.input_template else "--apply_chat_template"
        if row.conversational:
            raise RowError(row.source, None, f"is conversational ({row.format}), and {flag} wraps plain-text prompts "
                           "only: conversational rows go through the chat template.", f"Drop {flag}, or give the "
                           "prompt, chosen and rejected as strings.")
        if row.format not in ("standard", "unpaired"):
            raise RowError(row.source, "prompt", f"is missing ({row.format} row: the prompt is the text chosen and "
                           f"rejected share), so {flag} has no prompt to use.", "Add a prompt column (or name it with "
                           f"--prompt_key / --columns), or drop {flag}.")
        if self.input_template:
            return dataclasses.replace(row, prompt=self.input_template.format(row.prompt))
        chosen = [{"role": "assistant", "content": row.chosen}]
        rejected = chosen if row.unpaired else [{"role": "assistant", "content": row.rejected}]
        return dataclasses.replace(row, prompt=[{"role": "user", "content": row.prompt}], chosen=chosen,
                                   rejected=rejected)


AS_GIVEN = RowOptions()  # no renaming, prompts as they are


def _pairing_rule(cfg) -> str:
    """--pairing, except that a listwise loss (Plackett-Luce) reads scored rows as rankings."""
    rankings = getattr(cfg, "trains_rankings", None)
    return "ranking" if rankings is not None and rankings() else getattr(cfg, "pairing", DEFAULT_PAIRING.rule)
