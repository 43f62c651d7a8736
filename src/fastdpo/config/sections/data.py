"""The data section: which datasets, how their rows are read and cut to length (`DataReading`, shared with
`fastdpo eval`), and how pairs are sampled."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, at_least, check_choice, option
from fastdpo.data.groups import PAIRINGS, ULTRAFEEDBACK_SCORES
from fastdpo.errors import FastDPOError


@dataclass
class DataReading(Section):
    """How rows are read and cut to length: one section for training and `fastdpo eval`, so both read a dataset the
    same way (and a run's saved reading can be adopted by eval)."""

    name = "data"
    title = "Data"

    split: str = option("train", "Split to read from HF datasets (hub ids, dataset repos, save_to_disk dirs).")
    max_length: int = option(2048, "Max tokens of prompt+completion per sequence (see --truncation_strategy).")
    truncation_strategy: str = option("right", "Over --max_length: right = cut completions, dropping pairs whose prompt "
                                      "alone fills it (default, TRL keep_start); left = trim the prompt from the left, "
                                      "completions whole; delete = drop the pair.")
    max_prompt_length: int = option(0, "Keep the last N prompt tokens (0: off; with delete, longer pairs are dropped).")
    max_completion_length: int = option(0, "Keep the first N completion tokens (0: off; with delete, longer pairs are dropped).")
    template: str = option("", "Chat template for conversational rows: chatml|llama3|identity|hh or a Jinja file "
                           "(default: the tokenizer's chat_template).")
    columns: dict = option({}, "Dataset columns renamed to fastdpo's before rows are read (as ms-swift): a JSON object "
                           "{dataset column: fastdpo column}, e.g. '{\"question\": \"prompt\", \"good\": \"chosen\", "
                           "\"bad\": \"rejected\"}' (a mapping in YAML). Applies to every dataset, --val_dataset too.")
    dataset_info: dict = option({}, "Datasets read with their own columns, row format and sharegpt tags, keyed by the "
                                "--dataset / --val_dataset entry: {ENTRY: {name, formatting: alpaca|sharegpt, columns: "
                                "{dataset column: fastdpo column}, tags: {role_tag, content_tag, user_tag, ...}}}; only "
                                "the columns named are read, --columns does not apply. Filled from LLaMA-Factory's "
                                "dataset_dir/dataset_info.json.")
    input_template: str = option("", "OpenRLHF: text around plain-text prompts, {} standing for the prompt, e.g. "
                                 "$'User: {}\\nAssistant: ' (message-list rows use the chat template instead).")
    apply_chat_template: bool = option(False, "OpenRLHF: plain-text rows become a user turn and assistant replies, so the "
                                       "chat template applies to them too (message-list rows always go through it).")
    max_row_mb: float = option(16.0, "Largest row read from a data file, in MiB (a JSONL line, a JSON array element, a CSV "
                               "record): a larger one is an error naming its line, found before it is held in memory.")
    pairing: str = option("best_vs_rest", "Pairs of a row with several scored completions (completions + scores or "
                          "ranks, UltraFeedback's raw rows): best_vs_rest = the best against each lower-scored one; "
                          "best_vs_worst; all_pairs = every pair of different scores. Ties are never paired. "
                          "ranking = the completions in score order as one ranking (ties refused): what "
                          "--loss_type plackett_luce always reads.")
    ultrafeedback_score: str = option("auto", "The score that ranks UltraFeedback's raw completions: fine-grained_score "
                                      "(mean of the aspect ratings), overall_score, ratings (mean of the numeric "
                                      "annotations' Rating), or auto (the first of these a completion has).")
    max_pixels: int = option(0, "Rows with images: the largest area of an image after resizing, in pixels, passed to the "
                             "model's image processor (ms-swift's name; 0: the MAX_PIXELS environment variable, else "
                             "the processor's own). Qwen2-VL's: refused for LLaVA, whose images take one fixed size.")
    min_pixels: int = option(0, "Rows with images: the smallest area of an image after resizing, in pixels (0: the "
                             "MIN_PIXELS environment variable, else the processor's own). Qwen2-VL's: refused for "
                             "LLaVA.")
    template_timeout: float = option(10.0, "Seconds the chat template may take to render one row (0: no limit): a longer "
                                     "rendering is an error naming the row and the template, not a silent hang.")

    def validate_reading(self) -> None:
        """The reading flags: choices and bounds, the chat template, columns and per-dataset readings."""
        from fastdpo.data.columns import check_row_flags
        from fastdpo.data.template import resolve_template

        check_choice("truncation_strategy", self.truncation_strategy, ("right", "left", "delete"))
        check_choice("pairing", self.pairing, PAIRINGS)
        check_choice("ultrafeedback_score", self.ultrafeedback_score, ULTRAFEEDBACK_SCORES)
        if self.max_length < 1:
            raise FastDPOError(f"--max_length must be >= 1, got {self.max_length}.")
        for name in ("max_prompt_length", "max_completion_length", "max_pixels", "min_pixels"):
            if getattr(self, name) < 0:
                raise FastDPOError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        if not self.max_row_mb > 0:
            raise FastDPOError(f"--max_row_mb must be > 0, got {self.max_row_mb}.")
        if not self.template_timeout >= 0:
            raise FastDPOError(f"--template_timeout must be >= 0 seconds (0: no limit), got {self.template_timeout}.")
        resolve_template(self.template)  # raises on an unknown name or a missing file
        check_row_flags(self)


@dataclass
class DataSection(DataReading):
    """Training's datasets and their order: the reading above, then which rows, cached how, shuffled how."""

    dataset: list = option([], "Datasets: JSONL/JSON/Parquet/CSV files or dirs, HF dataset ids or saved dirs "
                           "(`name:subset`); `path#N` takes N rows. Row formats: see the README. In Python also a list of "
                           "row dicts or an HF Dataset / DatasetDict / IterableDataset.", nargs="+")
    system: str = option("", "System prompt for conversational rows that have none.")
    max_samples: int = option(0, "Keep the first N rows of each dataset, --val_dataset's too, after `#N` sampling (0: all), "
                              "as LLaMA-Factory's and OpenRLHF's max_samples (OpenRLHF also caps several datasets' sum).")
    strict: bool = option(True, "Invalid rows stop the run with one error per dataset (true), or are skipped, counted by "
                          "reason and written to rejects.jsonl in --output_dir (false; ms-swift's default).")
    dataset_num_proc: int = option(1, "Processes that tokenise the dataset.")
    load_from_cache_file: bool = option(True, "Reuse tokenised data cached under a fingerprint of data, tokenizer, settings.")
    dataset_cache_dir: str = option("", "Tokenisation cache dir (default: $FASTDPO_CACHE_DIR, else ~/.cache/fastdpo).")
    streaming: bool = option(False, "Read and tokenise lazily, for data larger than memory; needs --max_steps.")
    shuffle: bool = option(True, "Shuffle the pairs each epoch (seeded by --seed); false keeps the dataset order.")
    shuffle_buffer_size: int = option(10000, "Pairs in the seeded shuffle buffer when streaming.")
    dataloader_num_workers: int = option(0, "Processes that read and tokenise ahead of training when streaming.")
    dataloader_drop_last: bool = option(False, "Skip each epoch's last step when it would have fewer pairs than the others "
                                        "(off: it trains on the pairs left). Ignored with --streaming.")

    def normalise_datasets(self) -> None:
        """dataset as a list of specs: a single path, rows in memory and HF datasets become specs."""
        from fastdpo.data.sources import dataset_specs

        self.dataset = dataset_specs(self.dataset, self.split, "dataset")

    def validate_datasets(self) -> None:
        """The data flags of this section (`TrainConfig.validate_data` adds those that other sections bound)."""
        self.normalise_datasets()  # set after construction too
        if not self.dataset:
            raise FastDPOError("--dataset is required: one or more dataset files, dirs or HF dataset ids.")
        at_least(self, 1, "dataset_num_proc", "shuffle_buffer_size")
        at_least(self, 0, "dataloader_num_workers", "max_samples")
