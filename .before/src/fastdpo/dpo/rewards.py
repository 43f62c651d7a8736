"""Pluggable reward functions for generation metrics (`--reward_fn module:function`) and the win rate of the tuned
model over the base under them.

A reward function follows TRL's convention: called with keyword arguments `prompts` (list of str), `completions`
(list of str) and every column of the evaluated rows as a list (`chosen`, `rejected`, and any extra field such as
`answer`), it returns one number per completion:

    def exact_answer(prompts, completions, answer, **kwargs):
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from fastdpo.errors import FastDPOError

RewardFn = Callable[..., list]


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve `module:function` (an importable module, or a path to a .py file) to a callable, with errors that say
    what is wrong and how to fix it."""
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise FastDPOError(f"--reward_fn {spec!r}: expected module:function, e.g. my_rewards:exact_answer or "
                           "path/to/rewards.py:exact_answer.")
    module = _import(module_name, spec)
    fn = getattr(module, fn_name, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise FastDPOError(f"--reward_fn {spec!r}: {module_name} has no {fn_name!r}. "
                           f"Functions there: {', '.join(names) or 'none'}.")
    if not callable(fn):
        raise FastDPOError(f"--reward_fn {spec!r}: {fn_name} is a {type(fn).__name__}, not a function.")
    return fn


def _import(module_name: str, spec: str):
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise FastDPOError(f"--reward_fn {spec!r}: file {module_name} not found.")
        loader_spec = importlib.util.spec_from_file_location(f"fastdpo_reward_{path.stem}", path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:  # the user's module failed at import: say where
            raise FastDPOError(f"--reward_fn {spec!r}: importing {module_name} failed: "
                               f"{_describe(e, str(path))}") from None
        return module
    sys.path.insert(0, str(Path.cwd()))  # like `python -m`: modules next to where the command runs
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise FastDPOError(f"--reward_fn {spec!r}: no module named {module_name!r}. Put it on PYTHONPATH or in "
                               "the current directory, or give a file path (path/to/rewards.py:function).") from None
        raise FastDPOError(f"--reward_fn {spec!r}: importing {module_name} failed: {_describe(e)}") from None
    except Exception as e:  # the user's module failed at import: say where
        raise FastDPOError(f"--reward_fn {spec!r}: importing {module_name} failed: "
                           f"{_describe(e, _origin(module_name))}") from None
    finally:
        sys.path.remove(str(Path.cwd()))


def _origin(module_name: str) -> str | None:
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return found.origin if found is not None else None


def _describe(e: BaseException, user_file: str | None = None) -> str:
    """`Type: message (file:line)` at the innermost frame in `user_file` (the innermost frame when not given or not
    found), so a failure inside a library the user calls still points at the user's line."""
    where = ""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if user_file and Path(f.filename) == Path(user_file)]
    if isinstance(e, SyntaxError) and e.filename:
        where = f" ({e.filename}:{e.lineno})"
    elif mine or frames:
        frame = (mine or frames)[-1]
        where = f" ({frame.filename}:{frame.lineno})"
    return f"{type(e).__name__}: {e}{where}"


def score(fn: RewardFn, spec: str, prompts: list[str], completions: list[str], columns: dict[str, list]) -> list[float]:
    """Call the reward function once on all completions; check it returned one finite number per completion."""
    try:
        values = fn(prompts=prompts, completions=completions, **columns)
    except Exception as e:  # the user's function failed: report it as their error, with where
        raise FastDPOError(f"--reward_fn {spec} raised {_describe(e, _source_file(fn))} on {len(completions)} completions. "
                           f"It is called as fn(prompts=..., completions=..., {', '.join(columns)}) with lists; "
                           "accept **kwargs for columns you do not use.") from None
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise FastDPOError(f"--reward_fn {spec} returned a {type(values).__name__}; it must return a list with one "
                           f"number per completion ({len(completions)}).")
    if len(values) != len(completions):
        raise FastDPOError(f"--reward_fn {spec} returned {len(values)} values for {len(completions)} completions; "
                           "return one number per completion.")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise FastDPOError(f"--reward_fn {spec} returned {v!r} for completion {i}; every value must be a finite "
                               "number.")
        out.append(float(v))
    return out


def _source_file(fn) -> str | None:
    try:
        return inspect.getsourcefile(fn)
    except TypeError:
        return None


def win_rate(base: list[float], tuned: list[float]) -> dict:
    """Pairwise comparison of rewards on the same prompts: a tie counts half (as in AlpacaEval / MT-Bench)."""
    assert len(base) == len(tuned) and base, "one base and one tuned reward per prompt"
    wins = sum(t > b for b, t in zip(base, tuned))
    ties = sum(t == b for b, t in zip(base, tuned))
    n = len(base)
    return {"win_rate": (wins + 0.5 * ties) / n, "wins": wins, "ties": ties, "losses": n - wins - ties}
