"""`fastdpo eval`: preference metrics of held-out pairs for a base and a tuned model, generations scored by a reward
function or reward model (mean rewards and the win rate), also on files of prompts alone, and lm-eval tasks. With a
vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA) the held-out pairs may hold images: they are read and prepared as
training prepares them (its processor), and scored through the same vision forward."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastdpo.config import DataReading
from fastdpo.config.fields import Section, check_choice, option
from fastdpo.config.sections.generation import GenerationArgs, ModelArgs
from fastdpo.config.sections.loss import registered_losses
from fastdpo.data.columns import RowOptions
from fastdpo.data.load import Row, load_rows, records_by_location
from fastdpo.data.prompts import PromptRow, first_record, is_prompt_only, load_prompts
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


# flags of a training run that say how it read its rows and prompts, and scored pairs: eval takes them from the run
RUN_READING = ("apply_chat_template", "input_template", "template", "system", "columns", "max_length",
               "truncation_strategy", "max_prompt_length", "max_completion_length", "max_pixels", "min_pixels", "beta")


@dataclass
class EvalData(DataReading):
    """The held-out rows `fastdpo eval` reads, read as training reads them (`DataReading`)."""

    dataset: list = option([], "Held-out preference files (prompt/chosen/rejected), like --dataset of train, or files of "
                           "prompts alone (prompt, messages ending in a user turn, query, instruction) to answer and "
                           "score with --reward_fn / --reward_model (not needed for --lm_eval_tasks alone).", nargs="+")
    dataset_dir: str = option("", "LLaMA-Factory: names in --dataset are entries of DIR/dataset_info.json, each read with "
                              "its own columns, format and tags, as training's dataset_dir and eval_dataset read them.")


@dataclass
class EvalPairs(Section):
    """The preference metrics of held-out pairs: the loss, rewards and KL against a reference."""

    name = "metrics"
    title = "Preference metrics"

    ref_model: str = option("", "Reference model. Default: the adapters switched off, or --model under a full --checkpoint.")
    loss_type: str = option("sigmoid", "Preference loss reported as `loss`.")
    beta: float = option(0.1, "DPO beta of the implicit rewards (use the training value).")
    label_smoothing: float = option(0.0, "Label smoothing of the reported loss.")
    desirable_weight: float = option(1.0, "kto / apo_zero_unpaired: weight of desirable rows in the reported loss.")
    undesirable_weight: float = option(1.0, "kto / apo_zero_unpaired: weight of undesirable rows in the reported loss.")
    per_device_eval_batch_size: int = option(8, "Pairs per packed micro-batch (kto: rows per KL batch).")
    max_tokens_per_batch: int = option(0, "Token budget per packed micro-batch (0: per_device_eval_batch_size pairs).")
    attn_impl: str = option("auto", "auto|flex|dense|padded, as in training.")
    kl: bool = option(True, "Also measure the per-token KL(policy || reference) on the held-out completions.")

    def trains_rankings(self) -> bool:
        """Whether --loss_type is listwise (plackett_luce): scored rows are then read as rankings."""
        return any(registered_losses()[name].listwise for name in self.loss_type.split(",")
                   if name in registered_losses())


@dataclass
class EvalScoring(Section):
    """Generated answers scored by a reward function or model, and lm-evaluation-harness tasks."""

    name = "scoring"
    title = "Reward function and lm-eval tasks"

    reward_fn: str = option("", "module:function (or path/file.py:function) scoring generated answers; with a base to "
                            "compare, also the win rate of tuned over base.")
    reward_model: str = option("", "Sequence-classification reward model (dir or hub id) scoring generated answers, like "
                               "--reward_fn: prompt + answer through its tokenizer's chat template, the score its "
                               "output. No code from it runs.")
    eval_limit: int = option(64, "Rows whose prompts are answered for --reward_fn / --reward_model (0: all).")
    lm_eval_tasks: str = option("", "Comma-separated lm-evaluation-harness tasks (needs `pip install lm-eval`).")
    lm_eval_limit: int = option(0, "Examples per lm-eval task (0: all).")
    lm_eval_include_path: str = option("", "Directory of extra lm-eval task YAMLs (e.g. local tasks).")


@dataclass
class EvalOutput(Section):
    """Where the report goes, and the flags of other tools' evaluation that name backends."""

    name = "output"
    title = "Output and backends"

    output_dir: str = option("eval_output", "Where eval_report.json and generations.jsonl go.")
    eval_backend: str = option("", "ms-swift's evaluation backend: only lm-evaluation-harness runs here (see "
                               "--lm_eval_tasks).")
    eval_dataset: str = option("", "ms-swift's benchmark list: name the tasks with --lm_eval_tasks instead.")
    infer_backend: str = option("pt", "pt: transformers generate (the one backend here).")
    vllm_max_model_len: int = option(0, "ms-swift's vLLM context length: vLLM is not used here (see --infer_backend).")
    num_gpus: int = option(0, "ms-swift's GPU count for evaluation: fastdpo eval runs on one device (--device).")


@dataclass
class EvalConfig(EvalOutput, EvalScoring, EvalPairs, EvalData, ModelArgs, GenerationArgs):
    """`fastdpo eval`: the model to score (ModelArgs), how answers are generated (GenerationArgs), how rows are read
    (DataReading, the same section as training's), and what is measured."""

    def validate(self) -> None:
        from fastdpo.config import ATTN_IMPLS

        self.validate_model()
        self.validate_generation()
        if self.eval_backend and self.eval_backend.lower() not in ("lm_eval", "lm-eval", "lm_evaluation_harness"):
            raise FastDPOError(f"--eval_backend {self.eval_backend}: fastdpo eval scores held-out preference pairs "
                               "(--dataset) and runs lm-evaluation-harness tasks (--lm_eval_tasks, e.g. "
                               "gsm8k,mmlu). For OpenCompass, evaluate the exported model (fastdpo export) there.")
        if self.eval_dataset:
            raise FastDPOError(f"--eval_dataset {self.eval_dataset}: name benchmark tasks with --lm_eval_tasks "
                               "(lm-evaluation-harness names, e.g. gsm8k,mmlu) and held-out preference pairs with "
                               "--dataset.")
        if self.infer_backend != "pt":
            raise FastDPOError(f"--infer_backend {self.infer_backend}: fastdpo generates with transformers (pt); "
                               "drop the flag.")
        if self.vllm_max_model_len:
            raise FastDPOError(f"--vllm_max_model_len {self.vllm_max_model_len}: fastdpo eval does not run vLLM; "
                               "answers are generated with transformers, within the model's own context. Drop the "
                               "flag.")
        if self.num_gpus > 1:
            raise FastDPOError(f"--num_gpus {self.num_gpus}: fastdpo eval runs on one device (--device cuda:N); "
                               "drop the flag. To score several checkpoints at once, run one eval per GPU.")
        if self.reward_fn and self.reward_model:
            raise FastDPOError("Give --reward_fn or --reward_model, not both: one scorer per evaluation.")
        scorer = "--reward_fn" if self.reward_fn else "--reward_model" if self.reward_model else ""
        if not self.dataset and (scorer or not self.lm_eval_tasks):
            need = f"{scorer} answers the prompts of --dataset" if scorer else "--dataset is required"
            raise FastDPOError(f"{need}: held-out JSONL/JSON files with prompt/chosen/rejected, or prompts alone "
                               "with --reward_fn / --reward_model (or give only --lm_eval_tasks to run benchmarks "
                               "without preference data).")
        self._adopt_run_reading()
        self._resolve_dataset_names()
        self.validate_reading()
        check_choice("attn_impl", self.attn_impl, ATTN_IMPLS)
        for name in ("per_device_eval_batch_size",):
            if getattr(self, name) < 1:
                raise FastDPOError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.beta <= 0:
            raise FastDPOError(f"--beta must be > 0, got {self.beta}.")
        losses = registered_losses()
        for name in self.loss_type.split(","):
            if name not in losses:
                raise FastDPOError(f"--loss_type {name!r} is unknown. Choose from: {', '.join(sorted(losses))}.")
        if self.eval_limit < 0 or self.lm_eval_limit < 0:
            raise FastDPOError("--eval_limit and --lm_eval_limit must be >= 0 (0: all).")


    def _adopt_run_reading(self) -> None:
        """Under --adapters / --checkpoint from a fastdpo run, read rows and prompts as that run read them: its
        chat-template handling, template, system prompt, column mapping, length limits and beta, for each
        of these flags left at its default here (once: `_run_read` marks it done)."""
        import dataclasses

        from fastdpo.checkpoint.saved_run import run_config

        tuned = self.adapters or self.checkpoint
        if not tuned or getattr(self, "_run_read", False):
            return
        self._run_read = True
        trained, run = run_config(tuned)
        if trained is None:
            return
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(self)}
        adopted = []
        for name in RUN_READING:
            value = getattr(trained, name)
            if getattr(self, name) == defaults[name] and value != defaults[name]:
                setattr(self, name, value)
                adopted.append(f"--{name} {value}")
        if adopted:
            log.info("Read as the run in %s read its data (flags given here win): %s.", run, ", ".join(adopted))

    def _resolve_dataset_names(self) -> None:
        """--dataset_dir: the names in --dataset become their specs, their readings go to --dataset_info and a hub
        split other than train to --split (once: the names are gone afterwards)."""
        from fastdpo.data.dataset_info import load_info, resolve_names, split_names

        if not self.dataset_dir or getattr(self, "_names_resolved", False):
            return
        reading = dict(self.dataset_info)
        self.dataset, split, notes = resolve_names(split_names(self.dataset), load_info(self.dataset_dir),
                                                   self.dataset_dir, reading, "split")
        if split and self.split not in ("train", split):
            raise FastDPOError(f"--split {self.split}: the datasets named through --dataset_dir read split {split} "
                               "(their dataset_info.json entries). Drop --split.")
        self.split = split or self.split
        self.dataset_info, self._names_resolved = reading, True
        for note in notes:
            log.info("%s", note)


def run_eval(cfg: EvalConfig, console=None) -> dict:
    """`fastdpo eval`: held-out preference metrics, generation metrics under --reward_fn, lm-eval tasks; writes
    output_dir/eval_report.json (and generations.jsonl) and prints a table."""
    from fastdpo.dpo.reference import Reference
    from fastdpo.dpo.rewards import load_reward_fn
    from fastdpo.losses import LossParams, needs_prompt_targets, trains_rankings, trains_unpaired
    from fastdpo.model.backend import choose_backend, micro_batch_budget, prepare_packed
    from fastdpo.model.generate import load_for_generation
    from fastdpo.model.load import load_model, resolve_device, resolve_dtype
    from fastdpo.training.evaluate import held_out_metrics, pair_logps, token_kl

    cfg.validate()
    reward_fn = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else None  # fail fast, before loading models
    read = RowOptions.from_config(cfg)
    prompts_only = bool(cfg.dataset) and prompt_only_data(cfg, read)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    scorer = None
    if reward_fn is not None:
        scorer = functools.partial(_score_with, reward_fn, cfg.reward_fn)
    elif cfg.reward_model:
        from fastdpo.model.reward_model import RewardModel

        reward_model = RewardModel(cfg.reward_model, device, resolve_dtype(cfg.torch_dtype, device))
        scorer = reward_model.score
    loaded = load_for_generation(cfg, need_base=bool(cfg.dataset))
    model, tok = loaded.model, loaded.tokenizer
    if not cfg.dataset:  # benchmarks only (--lm_eval_tasks without preference data)
        report = {"model": cfg.model, "adapters": cfg.adapters, "checkpoint": cfg.checkpoint,
                  "lm_eval": run_lm_eval(model, tok, cfg)}
        return _write_report(report, out, console)
    ref_model = load_model(cfg.ref_model, resolve_dtype(cfg.torch_dtype, device), device, cfg.trust_remote_code,
                           flag="ref_model").eval() if cfg.ref_model else loaded.base
    if prompts_only:  # answers scored, no pairs: no preference metrics
        rows = load_prompts(cfg.dataset, cfg.seed, cfg.split, read)
        base = ref_model if not loaded.tuned else None
        generation = generation_metrics(cfg, loaded, base, [r.prompt for r in rows], prompt_columns(rows), scorer,
                                        out / "generations.jsonl")
        report = {"model": cfg.model, "adapters": cfg.adapters, "checkpoint": cfg.checkpoint, "dataset": cfg.dataset,
                  "scorer": cfg.reward_fn or cfg.reward_model, "prompts": generation["prompts"],
                  "generation": generation}
        if cfg.lm_eval_tasks:
            report["lm_eval"] = run_lm_eval(model, tok, cfg)
        return _write_report(report, out, console)
    if ref_model is not None:
        reference = Reference("separate", ref_model)
    elif hasattr(model, "disable_adapter"):
        reference = Reference("adapter_off", None)
    else:
        reference = Reference("none", None)
        if trains_unpaired(cfg.loss_type.split(",")):
            raise FastDPOError(f"--loss_type {cfg.loss_type}: KTO's metrics are log-ratios against a reference, and "
                               f"{cfg.model} is evaluated alone. Give --adapters or --checkpoint (their base is the "
                               "reference), or --ref_model.")
    backend = choose_backend(model, cfg.attn_impl, True, device)
    if backend.name != "padded":
        prepare_packed(model, backend)
        if ref_model is not None:
            prepare_packed(ref_model, backend)

    terms = [(name, 1.0) for name in cfg.loss_type.split(",")]
    rows, pairs = scored_pairs(cfg, read, tok, [name for name, _ in terms], loaded.processor)
    if scorer is not None and any(r.images for r in rows):
        raise FastDPOError(f"{next(r for r in rows if r.images).source}: --reward_fn / --reward_model answer the "
                           "prompts as text, and these rows hold images. Score rows with images by their preference "
                           "metrics alone (drop the scorer), or answer them with `fastdpo infer --val_dataset`.")
    pad_id = tok.pad_token_id or 0
    in_order = trains_unpaired(name for name, _ in terms) or trains_rankings(name for name, _ in terms)
    budget = 0 if in_order else micro_batch_budget(backend, cfg.max_tokens_per_batch, pairs,
                                                   cfg.per_device_eval_batch_size)
    args = (backend, pad_id, device, budget, cfg.per_device_eval_batch_size)
    x = pair_logps(model, reference, pairs, *args, prompt_targets=needs_prompt_targets(name for name, _ in terms))
    params = LossParams(cfg.beta, cfg.label_smoothing, desirable_weight=cfg.desirable_weight,
                        undesirable_weight=cfg.undesirable_weight)
    metrics = held_out_metrics(x, pairs, params, terms)
    if cfg.kl and reference.strategy != "none" and "kl" not in metrics:  # KTO reports its own KL estimate as kl
        metrics["kl"] = token_kl(model, reference, pairs, *args)
    report = {"model": cfg.model, "adapters": cfg.adapters, "checkpoint": cfg.checkpoint, "dataset": cfg.dataset,
              "reference": reference.strategy, "pairs": len(pairs), "metrics": metrics}

    if scorer is not None:
        base = ref_model if not loaded.tuned else None  # with no tuned model on top, compare against --ref_model
        rows = rows[: cfg.eval_limit] if cfg.eval_limit else rows
        report["scorer"] = cfg.reward_fn or cfg.reward_model
        report["generation"] = generation_metrics(cfg, loaded, base, [r.prompt for r in rows], row_columns(rows),
                                                  scorer, out / "generations.jsonl")
    if cfg.lm_eval_tasks:
        report["lm_eval"] = run_lm_eval(model, tok, cfg)
    return _write_report(report, out, console)


def scored_pairs(cfg: EvalConfig, read: RowOptions, tok, names: list[str], processor=None) -> tuple[list[Row], list]:
    """The rows of --dataset and their pairs, read and tokenised exactly as training does for the losses `names`
    (KTO's KL completions in batches of --per_device_eval_batch_size rows, Plackett-Luce's whole rankings). With a
    vision-language model's `processor`, rows with images are read and go through it, images and all (as training
    prepares them); without one they are refused."""
    import dataclasses

    from fastdpo.data.prepare import DataOptions, tokenize_rows
    from fastdpo.training.setup import pairs_for_loss, rows_for_loss

    opts = DataOptions.for_scoring(cfg)
    if processor is not None:
        read = dataclasses.replace(read, images=True)
        opts = dataclasses.replace(opts, read=read)
    rows = load_rows(cfg.dataset, cfg.seed, cfg.split, read=read)
    rows = rows_for_loss(rows, names)
    pairs, _ = tokenize_rows(rows, tok, opts, processor=processor)
    return rows, pairs_for_loss(pairs, rows, names, cfg.per_device_eval_batch_size, cfg.max_length)


def _write_report(report: dict, out: Path, console) -> dict:
    (out / "eval_report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    if console is not None:
        show_report(console, report)
        console.print(f"report in {out / 'eval_report.json'}")
    return report


def prompt_only_data(cfg: EvalConfig, read: RowOptions) -> bool:
    """Whether --dataset holds prompts alone (its first row has a prompt and no chosen/rejected); such a file needs a
    reward function or model to score the answers."""
    first = first_record(cfg.dataset, cfg.split, read)
    if first is None or not is_prompt_only(first[1]):
        return False
    if not (cfg.reward_fn or cfg.reward_model):
        raise FastDPOError(f"{first[0]}: a prompt without chosen/rejected, so there are no pairs for preference "
                           "metrics. To evaluate on prompts alone, add --reward_fn FILE.py:function (your reward "
                           "function) or --reward_model DIR (a sequence-classification reward model): the tuned and "
                           "the base model answer each prompt, and their answers are scored and compared.")
    return True


def prompt_columns(rows: list[PromptRow]) -> dict[str, list]:
    """Columns handed to a reward function: every field that all prompt rows carry (e.g. a reference `answer`)."""
    shared = set.intersection(*(set(r.fields) for r in rows)) if rows else set()
    return {k: [r.fields[k] for r in rows] for k in sorted(shared)}


def _score_with(reward_fn, spec: str, prompts: list, completions: list[str], columns: dict) -> list[float]:
    from fastdpo.dpo.rewards import score

    return score(reward_fn, spec, prompts, completions, columns)


def generation_metrics(cfg: EvalConfig, loaded, base, prompts: list, columns: dict[str, list], scorer,
                       path: Path) -> dict:
    """Answer the prompts with the tuned model (and the base: adapters off, the base of a full checkpoint, or `base`),
    each prompt going in as training read it (`answers_as_read`), score every answer with `scorer(prompts,
    completions, columns)`, and compare: mean rewards and the win rate of tuned over base (a tie counts half)."""
    from fastdpo.dpo.rewards import win_rate
    from fastdpo.model.generate import answers_as_read

    if cfg.eval_limit:
        prompts, columns = prompts[: cfg.eval_limit], {k: v[: cfg.eval_limit] for k, v in columns.items()}
    tuned_answers = answers_as_read(loaded.model, loaded.tokenizer, prompts, cfg)
    tuned_text = tuned_answers.texts
    tuned = scorer(prompts, tuned_text, columns)
    result = {"prompts": len(prompts), "reward/tuned": sum(tuned) / len(tuned), **answer_counts("tuned", tuned_answers)}
    records = [{"prompt": p, "response": t, "reward": s} for p, t, s in zip(prompts, tuned_text, tuned)]
    problems = [tuned_answers.problems("tuned", cfg)]
    if loaded.tuned or base is not None:
        with loaded.base_model() if loaded.tuned else contextlib.nullcontext(base) as base_model:
            base_answers = answers_as_read(base_model, loaded.tokenizer, prompts, cfg)
        base_text = base_answers.texts
        result.update(answer_counts("base", base_answers))
        problems.append(base_answers.problems("base", cfg))
        base_scores = scorer(prompts, base_text, columns)
        result["reward/base"] = sum(base_scores) / len(base_scores)
        result.update(win_rate(base_scores, tuned))
        for r, t, s in zip(records, base_text, base_scores):
            r.update(base_response=t, base_reward=s)
    warn_answers([p for p in problems if p], prompts, cfg, loaded.tokenizer, path)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return result


def answer_counts(who: str, answers) -> dict:
    return {f"empty/{who}": answers.empty, f"truncated/{who}": sum(answers.truncated)}


def warn_answers(problems: list[str], prompts: list, cfg: EvalConfig, tokenizer, path: Path) -> None:
    """A loud warning when answers are empty or cut off: their rewards (and a win rate of 0.5 between two sets of
    empty answers) say nothing of the models."""
    if not problems:
        return
    plain = sum(isinstance(p, str) for p in prompts)
    hint = ""
    if plain and getattr(tokenizer, "chat_template", None):
        hint = (f" {plain} prompts are plain text and went in as training reads plain text, without the chat template; "
                "a chat model may answer nothing to them: if the run was trained through the template, pass "
                "--apply_chat_template true (as `fastdpo infer --prompts` formats prompts).")
    log.warning("GENERATIONS: %s. The rewards and win rate of such answers are not a measure of the models "
                "(answers in %s).%s Raise --max_new_tokens for cut answers.", "; ".join(problems), path, hint)


def row_columns(rows: list[Row]) -> dict[str, list]:
    """Columns handed to a reward function: chosen, rejected, and every other field that all rows' source records
    carry (e.g. a reference `answer`), read back from the JSON/JSONL files the rows came from."""
    columns: dict[str, list] = {"chosen": [r.chosen for r in rows], "rejected": [r.rejected for r in rows]}
    records: dict[str, dict[str, object]] = {}
    extras = []
    for r in rows:
        where = r.source.split(" (dataset ", 1)[0]  # `path:line` or `path:line index K`, without --dataset_info's name
        path = where.rpartition(":")[0]
        if path not in records:
            p = Path(path)
            records[path] = records_by_location(p) if path and p.is_file() and p.suffix in (".json", ".jsonl") else {}
        rec = records[path].get(where)
        extras.append(rec if isinstance(rec, dict) else {})
    shared = set.intersection(*(set(e) for e in extras)) - {"prompt", "chosen", "rejected"} if extras else set()
    for key in sorted(shared):
        columns[key] = [e[key] for e in extras]
    return columns


def run_lm_eval(model, tokenizer, cfg: EvalConfig) -> dict:
    """Standard benchmarks through lm-evaluation-harness on the in-memory model; returns its per-task results."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise FastDPOError("--lm_eval_tasks needs lm-evaluation-harness: pip install lm-eval") from None
    from fastdpo.model.backend import use_model_attention

    use_model_attention(model)
    model.eval()
    tasks = [t.strip() for t in cfg.lm_eval_tasks.split(",") if t.strip()]
    manager = _task_manager(cfg.lm_eval_include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise FastDPOError(f"--lm_eval_tasks: unknown task(s) {', '.join(unknown)}. List them with `lm-eval ls tasks`"
                           " (add --lm_eval_include_path for local task YAMLs).")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.per_device_eval_batch_size,
              max_length=cfg.max_length)
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=cfg.lm_eval_limit or None, task_manager=manager,
                                      random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed)
    return {task: {k: v for k, v in res.items() if isinstance(v, (int, float, str))}
            for task, res in results["results"].items()}


@functools.cache
def _task_manager(include_path: str):
    """lm-eval's task index (it reads thousands of task files: built once per process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path or None)


def show_report(console, report: dict) -> None:
    from rich.table import Table

    if "pairs" in report:
        title = f"held-out pairs: {report['pairs']} (reference: {report['reference']})"
    elif "prompts" in report:
        title = f"prompts: {report['prompts']} (answers scored by {report['scorer']})"
    else:
        title = "benchmarks (no preference data)"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in report.get("metrics", {}).items():
        table.add_row(k, f"{v:.4f}")
    for k, v in report.get("generation", {}).items():
        label = f"generation {k}" + (" (tuned over base, ties count half)" if k == "win_rate" else "")
        table.add_row(label, f"{v:.4f}" if isinstance(v, float) else str(v))
    for task, res in report.get("lm_eval", {}).items():
        for k, v in res.items():
            if isinstance(v, float):
                table.add_row(f"{task} {k}", f"{v:.4f}")
    console.print(table)
