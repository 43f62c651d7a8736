"""Checks made before transformers loads a model or tokenizer, for the failures that would otherwise cost a minute
of download retries or end in a traceback: a misspelt local dir, a hub id the hub cannot be asked about, a weight
file cut short, and model or tokenizer code named by `auto_map` (run only with --trust_remote_code)."""

from __future__ import annotations

import difflib
import itertools
import json
import os
from pathlib import Path

from fastdpo.errors import FastDPOError

LOCAL_PREFIXES = (".", "/", "~")
_TRUE = ("1", "ON", "YES", "TRUE")
_reachable: set[str] = set()  # hub ids the hub answered for in this process: asked once, not per load


def looks_local(path: str) -> bool:
    """A path rather than a hub id (`org/name` or `name`)."""
    return Path(path).exists() or path.startswith(LOCAL_PREFIXES) or path.count("/") > 1 or "\\" in path


def close_dir(path: str) -> str | None:
    """An existing dir that `path` misses by a typo or two (each missing part matched among its parent's dirs)."""
    p = Path(path).expanduser()
    cur, rest = (Path(p.parts[0]), p.parts[1:]) if p.is_absolute() else (Path("."), p.parts)
    changed = False
    for part in rest:
        if (cur / part).is_dir():
            cur /= part
            continue
        try:
            names = [c.name for c in itertools.islice(cur.iterdir(), 10_000) if c.is_dir()]
        except OSError:
            return None
        match = difflib.get_close_matches(part, names, n=1, cutoff=0.75)
        if not match:
            return None
        cur, changed = cur / match[0], True
    return str(cur) if changed else None


def _no_local_dir(path: str) -> str:
    close = close_dir(path)
    return f"no local dir {path} exists" + (f" (did you mean {close}?)" if close else "")


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or any(os.environ.get(k, "").upper() in _TRUE
                                                 for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str)
               for name in ("config.json", "tokenizer_config.json", "adapter_config.json"))


def hub_problem(repo_id: str) -> str | None:
    """Why the hub cannot give `repo_id` (one request, no retries), or None when it answers for it."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=10)
    except GatedRepoError:  # transformers says how to get access
        return None
    except RepositoryNotFoundError:
        return "not found"
    except HfHubHTTPError:  # it answered: transformers reports the rest
        return None
    except Exception as e:  # noqa: BLE001 - httpx, OSError, ...: the hub is not reachable from here
        return f"unreachable ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


def check_source(path: str, flag: str = "model") -> None:
    """Refuse at once, with what to do, a `path` that is neither a local dir nor a hub id the hub (or the local HF
    cache) can give; transformers would otherwise retry for about a minute before a message that names neither."""
    if Path(path).expanduser().exists():
        return
    if looks_local(path):
        raise FastDPOError(f"--{flag} {path}: {_no_local_dir(path)}. Check the path.")
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except Exception:  # noqa: BLE001 - HFValidationError: no hub id looks like this
        raise FastDPOError(f"--{flag} {path}: {_no_local_dir(path)}, and it is not a hub id (org/name). Check "
                           "the path.") from None
    if path in _reachable or in_hub_cache(path):
        return
    if offline():
        raise FastDPOError(f"--{flag} {path}: {_no_local_dir(path)}, and the hub id {path} is not in the local HF "
                           "cache (HF_HUB_OFFLINE is set, so nothing is downloaded). Check the path or the id, or "
                           "download the model first where the hub can be reached.")
    problem = hub_problem(path)
    if problem == "not found":
        raise FastDPOError(f"--{flag} {path}: {_no_local_dir(path)}, and the hub has no model {path} (or it is "
                           "private: log in with `hf auth login`). Check the path or the id.")
    if problem:
        raise FastDPOError(f"--{flag} {path}: {_no_local_dir(path)}, and the Hugging Face hub could not be reached to "
                           f"download it: {problem}. If it is a local dir, check the path; if a hub id, check the id "
                           "and the network, or set HF_HUB_OFFLINE=1 to use only models downloaded before.")
    _reachable.add(path)


# ---------------------------------------------------------------- weight files


def safetensors_problem(f: Path) -> str | None:
    """What is wrong with a safetensors file's layout (cut short, header damaged), from its header alone; None if
    its size is what its header describes."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = fh.read(n) if 0 < n <= min(size - 8, 100 << 20) else b""
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if n < 0:
        return f"is {size} bytes, too short to be a safetensors file"
    if len(header) != n or n == 0:
        return f"is {size:,} bytes, but its header says the header alone takes {n:,}"
    try:
        meta = json.loads(header)
        end = max((int(t["data_offsets"][1]) for k, t in meta.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError):
        return "has a damaged header"
    if size != 8 + n + end:
        return f"is {size:,} bytes, but its header describes {8 + n + end:,}"
    return None


def check_weight_files(d: Path, hub_id: str = "") -> None:
    """Every safetensors file of model dir `d` is as long as its header says; a FastDPOError names the file."""
    for f in sorted(d.glob("*.safetensors")):
        problem = safetensors_problem(f)
        if problem:
            again = (f"Download it again (remove the damaged copy from the HF cache first: `hf cache rm {hub_id}`)."
                     if hub_id else "Copy or download it again.")
            raise FastDPOError(f"{f} {problem}: the weight file is damaged or was not copied or downloaded "
                               f"completely. {again}")


def hub_snapshot(repo_id: str) -> Path | None:
    """The local HF cache dir of a hub model, if it is there."""
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(repo_id, "config.json")
    return Path(got).parent if isinstance(got, str) else None


# ---------------------------------------------------------------- custom code


def _code_files(entries: dict) -> str:
    """`auto_map` entries -> the files holding that code ('org/repo--modeling_x.Cls' -> modeling_x.py)."""
    refs = [v for vs in entries.values() for v in (vs if isinstance(vs, (list, tuple)) else [vs]) if isinstance(v, str)]
    return ", ".join(sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs}))


def custom_code_error(path: str, file: str, auto_map: dict, what: str, builtin: str) -> FastDPOError:
    """The refusal of a model or tokenizer whose `file` names its own code, without --trust_remote_code."""
    return FastDPOError(
        f"{path}: its {file} names its own {what} code (auto_map: {', '.join(map(str, auto_map))} in "
        f"{_code_files(auto_map) or 'files of the model'}), which runs only with --trust_remote_code true; without it "
        f"transformers would quietly use {builtin} instead, which may differ. Read that code and pass "
        f"--trust_remote_code true if you trust it, or, to use {builtin}, remove auto_map from {file} in a copy of "
        "the model dir.")


def tokenizer_auto_map(path: str) -> tuple[str, dict] | None:
    """(file, auto_map) when the tokenizer of local dir `path` names its own code (AutoTokenizer in auto_map of
    tokenizer_config.json or config.json)."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            auto_map = json.loads((Path(path).expanduser() / name).read_text(encoding="utf-8")).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:
            return name, {"AutoTokenizer": auto_map["AutoTokenizer"]}
        if isinstance(auto_map, (list, tuple)) and name == "tokenizer_config.json" and auto_map:  # an old form
            return name, {"AutoTokenizer": list(auto_map)}
    return None
