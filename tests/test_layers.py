"""The package is built in floors: a module imports only from its own subpackage or from floors below it, and no
group of modules imports itself round in a circle. Imports inside functions count too (they are imports all the
same); only `if TYPE_CHECKING:` blocks are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "fastdpo"

# lowest first; subpackages on one floor may not import each other
FLOORS = [
    {"errors", "version"},
    {"data", "kernels", "losses"},
    {"config"},
    {"model", "optim"},
    {"observe"},
    {"dpo"},
    {"parallel"},
    {"checkpoint"},
    {"training"},
    {"commands"},
    {"cli", "trl"},
    {"__init__", "__main__"},
]
COMMANDS = "commands"


def unit_of(module: str) -> str:
    """'fastdpo.model.load' -> 'model'; 'fastdpo.cli' -> 'cli'; 'fastdpo' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of(unit: str) -> int:
    for i, units in enumerate(FLOORS):
        if unit in units:
            return i
    raise AssertionError(f"{unit!r} is on no floor: add it to FLOORS in {__file__}")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The fastdpo modules `path` imports, resolved to the module (not the name inside it)."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "fastdpo")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "fastdpo":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    return {name: imports_of(p, known) - {name} for name, p in files.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(g.items()):
        here = unit_of(mod)
        for dep in sorted(deps):
            there = unit_of(dep)
            if dep == "fastdpo" and mod != "fastdpo":
                bad.append(f"{mod} imports the package root (import what you need from its module)")
            elif there == here:
                if here == COMMANDS and dep != "fastdpo.commands" and mod != "fastdpo.commands":
                    bad.append(f"{mod} imports {dep}: a command does not import another")
            elif floor_of(there) >= floor_of(here):
                bad.append(f"{mod} ({here}, floor {floor_of(here)}) imports {dep} ({there}, floor {floor_of(there)})")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_upward_imports():
    bad = upward(graph())
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_few_top_level_modules():
    top = [p.name for p in ROOT.glob("*.py")]
    assert len(top) <= 12, top


def test_the_checks_can_fail(tmp_path):
    """A planted upward import and a planted cycle are both found."""
    pkg = tmp_path / "fastdpo"
    for sub in ("data", "model"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "a.py").write_text("from fastdpo.model.b import x\n")
    (pkg / "model" / "b.py").write_text("def f():\n    from fastdpo.data.a import y\n")
    g = graph(pkg)
    assert any("fastdpo.data.a (data, floor 1) imports fastdpo.model.b" in b for b in upward(g))
    assert cycles(g) == [["fastdpo.data.a", "fastdpo.model.b"]]


@pytest.mark.parametrize("unit", sorted(set().union(*FLOORS)))
def test_every_floor_exists(unit):
    assert (ROOT / unit).is_dir() or (ROOT / f"{unit}.py").is_file(), unit


# ---------------------------------------------------------------- no hidden couplings

# Private names (`_x`; dunders such as __version__ are public) taken from another module, still to be made public by
# those restructuring the modules that define them. Each entry is (importing module, name); remove an entry once its
# use is gone (a test fails while a stale one is left).
PENDING_PRIVATE: set[tuple[str, str]] = set()
# Modules outside parallel/ that still import torch.distributed, until their collectives move there. Remove an entry
# once its import is gone.
PENDING_DISTRIBUTED: set[str] = set()
DISTRIBUTED_HOME = "parallel"


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement of `path`, inside functions too."""
    return [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, (ast.Import, ast.ImportFrom))]


def private_imports(root: Path = ROOT) -> set[tuple[str, str]]:
    """(module, name) for every private name a fastdpo module takes from another fastdpo module: imported by name
    (`from fastdpo.a import _x`) or read off an imported module (`from fastdpo import a` ... `a._x`)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    out = set()
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        modules = {}  # local name -> the fastdpo module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == "fastdpo" and node.module != mod:
                out.update((mod, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
                modules.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in files})
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name in files})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and modules[node.value.id] != mod and node.attr.startswith("_") and not node.attr.startswith("__"):
                out.add((mod, node.attr))
    return out


def distributed_imports(root: Path = ROOT) -> set[str]:
    """The fastdpo modules outside parallel/ that import torch.distributed (or a module under it)."""
    out = set()
    for path in root.rglob("*.py"):
        mod = module_name(path, root)
        if unit_of(mod) == DISTRIBUTED_HOME:
            continue
        for node in _imports(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                f"{node.module}.{a.name}" for a in node.names] if node.module and node.level == 0 else []
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                out.add(mod)
    return out


def test_no_private_names_imported_across_modules():
    bad = sorted(private_imports() - PENDING_PRIVATE)
    assert not bad, "private names imported from another module (make them public):\n" + "\n".join(map(str, bad))


def test_pending_private_imports_are_still_there():
    gone = sorted(PENDING_PRIVATE - private_imports())
    assert not gone, f"these imports are gone: remove them from PENDING_PRIVATE in {__file__}:\n" + "\n".join(
        map(str, gone))


def test_torch_distributed_only_in_parallel():
    bad = sorted(distributed_imports() - PENDING_DISTRIBUTED)
    assert not bad, "torch.distributed imported outside parallel/ (use or add a collective there):\n" + "\n".join(bad)


def test_pending_distributed_imports_are_still_there():
    gone = sorted(PENDING_DISTRIBUTED - distributed_imports())
    assert not gone, f"remove these from PENDING_DISTRIBUTED in {__file__}: {gone}"


def test_the_coupling_checks_can_fail(tmp_path):
    """A planted private import and a planted torch.distributed import are both found; a dunder and parallel/'s
    own imports are not."""
    pkg = tmp_path / "fastdpo"
    for sub in ("data", "model", "parallel"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "a.py").write_text("from fastdpo.version import __version__\n")
    (pkg / "model" / "b.py").write_text("from fastdpo.data import a\n\n\ndef f():\n    from fastdpo.data.a import _hidden\n"
                                        "    return a._inner, a.__name__\n")
    (pkg / "model" / "c.py").write_text("from torch import distributed\nimport torch.distributed.checkpoint as dcp\n")
    (pkg / "parallel" / "d.py").write_text("import torch.distributed as dist\n")
    assert private_imports(pkg) == {("fastdpo.model.b", "_hidden"), ("fastdpo.model.b", "_inner")}
    assert distributed_imports(pkg) == {"fastdpo.model.c"}


# the rooms inside floors

KERNEL_HELPERS = {"__init__", "launch", "warmup"}  # shared by every op: the launcher checks and the builds ahead


def section_imports(root: Path = ROOT) -> set[tuple[str, str]]:
    """(section module, config module) for each import a config section makes of the config floor beyond the
    field helpers and the other sections: a section stands alone, the joined configs are built from it."""
    files = {module_name(p, root) for p in root.rglob("*.py")}
    out = set()
    for path in (root / "config" / "sections").glob("*.py"):
        mod = module_name(path, root)
        for target in imports_of(path, files):
            if target.startswith("fastdpo.config") and target not in ("fastdpo.config.fields",) \
                    and not target.startswith("fastdpo.config.sections"):
                out.add((mod, target))
    return out


def test_config_sections_stand_alone():
    bad = sorted(section_imports())
    assert not bad, "a config section imports the configs built on it:\n" + "\n".join(map(str, bad))


def test_the_section_check_can_fail(tmp_path):
    pkg = tmp_path / "fastdpo"
    (pkg / "config" / "sections").mkdir(parents=True)
    for rel in ("__init__.py", "config/__init__.py", "config/fields.py", "config/train.py", "config/sections/__init__.py"):
        (pkg / rel).write_text("")
    (pkg / "config" / "sections" / "loss.py").write_text(
        "from fastdpo.config.fields import option\nfrom fastdpo.config.train import TrainConfig\n")
    assert section_imports(pkg) == {("fastdpo.config.sections.loss", "fastdpo.config.train")}


def test_each_kernel_op_has_its_file_test_and_benchmark():
    """One op per file in kernels/ (Triton kernels, launcher, autograd Function), with a test file of its own under
    tests/kernels/ and a benchmark of its own under benchmarks/kernels/."""
    tests_dir = Path(__file__).resolve().parent / "kernels"
    bench_dir = ROOT.parents[1] / "benchmarks" / "kernels"
    ops = sorted(p.stem for p in (ROOT / "kernels").glob("*.py") if p.stem not in KERNEL_HELPERS)
    assert len(ops) >= 7, ops
    missing = [op for op in ops if not list(tests_dir.glob(f"test_{op}*.py"))]
    missing += [f"benchmarks/kernels/{op}.py" for op in ops if not (bench_dir / f"{op}.py").is_file()]
    assert not missing, f"kernel ops without their own test or benchmark: {missing}"
