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
