"""A parameter typed with a config section reads only that section: a function that takes `OptimizerSection` cannot
reach `cfg.beta`. The check parses every module of the package, so an annotation that stops telling the truth fails
here, not in a run."""

import ast
import dataclasses
import importlib
import pkgutil
from pathlib import Path

import fastdpo
from fastdpo.config.fields import Section

SRC = Path(fastdpo.__file__).parent


def _section_classes() -> dict[str, type]:
    for info in pkgutil.walk_packages([str(SRC / "config")], "fastdpo.config."):
        importlib.import_module(info.name)
    for name in ("evaluate", "export", "infer"):
        importlib.import_module(f"fastdpo.commands.{name}")
    found, todo = {}, [Section]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def _annotation_name(node) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("|")[0].strip()
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.BinOp):  # Section | None
        return _annotation_name(node.left)
    return None


def _members(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} | {n for n in dir(cls) if not n.startswith("__")}


def section_reads(source: str, sections: dict[str, type]) -> list[tuple[str, str, str, str]]:
    """(function, parameter, section, attribute) for each read of a section-typed parameter that the section lacks."""
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        typed = {a.arg: sections[n] for a in fn.args.args + fn.args.kwonlyargs
                 if (n := _annotation_name(a.annotation)) in sections}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in typed
                    and node.attr not in _members(typed[node.value.id])):
                bad.append((fn.name, node.value.id, typed[node.value.id].__name__, node.attr))
    return bad


def typed_parameters(source: str, sections: dict[str, type]) -> list[tuple[str, str]]:
    return [(fn.name, n) for fn in ast.walk(ast.parse(source)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for a in fn.args.args + fn.args.kwonlyargs if (n := _annotation_name(a.annotation)) in sections]


def test_section_typed_parameters_read_only_their_section():
    sections = _section_classes()
    bad, typed = [], []
    for path in sorted(SRC.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        bad += [(str(path.relative_to(SRC)), *b) for b in section_reads(source, sections)]
        typed += typed_parameters(source, sections)
    assert not bad, "a section-typed parameter reads what its section does not hold:\n" + "\n".join(map(str, bad))
    narrow = {name for _, name in typed if name not in ("TrainConfig", "EvalConfig", "ExportConfig", "InferConfig")}
    # functions below the training floor take the one section they read
    assert {"OptimizerSection", "ParallelSection", "MonitoringSection", "BatchingSection"} <= narrow, narrow


def test_the_check_sees_a_read_from_another_section():
    sections = _section_classes()
    source = ("def f(opt: OptimizerSection, cfg: 'LossSection | None'):\n"
              "    return opt.learning_rate, opt.beta, cfg.beta, cfg.warmup_steps\n")
    assert section_reads(source, sections) == [("f", "opt", "OptimizerSection", "beta"),
                                               ("f", "cfg", "LossSection", "warmup_steps")]
