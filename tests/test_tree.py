"""The tests mirror the package: a test file lives in the folder named after the subpackage it tests
(tests/data/ for src/fastdpo/data/, ...), or here at the top for what spans the package (its API, the CLI, TRL's
drop-in, packaging, docs, layers). What tests share besides fixtures is in tests/*_helpers.py, never imported from
conftest.py (fixtures and hooks only) nor from another test file."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "src" / "fastdpo"

# test files of the package as a whole (or of its top-level modules: cli.py, trl.py)
TOP_LEVEL = {"test_api.py", "test_cli.py", "test_cli_reference.py", "test_demo.py", "test_layers.py",
             "test_packaging.py", "test_tree.py", "test_trl_dropin.py", "test_cli_startup.py", "test_guides.py"}


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def collected_files() -> list[Path]:
    return [p for p in python_files() if p.name.startswith("test_")]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module name) of each import in `path`, in functions too; relative imports as '.'."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." if node.level else node.module.split(".")[0]))
    return out


def test_each_test_file_lives_in_the_folder_of_the_subpackage_it_tests():
    misplaced = []
    for path in collected_files():
        folder = path.parent.relative_to(TESTS)
        if folder == Path("."):
            if path.name not in TOP_LEVEL:
                misplaced.append(f"{path.name}: move it into the folder of the subpackage it tests, or add it to "
                                 f"TOP_LEVEL in {__file__} if it tests the package as a whole")
        elif not (PACKAGE / folder / "__init__.py").is_file():
            misplaced.append(f"{path.relative_to(TESTS)}: src/fastdpo/{folder.as_posix()} is no subpackage")
    assert not misplaced, "\n".join(misplaced)
    assert {p.name for p in collected_files() if p.parent == TESTS} == TOP_LEVEL, "a TOP_LEVEL file is gone: remove it"


def test_test_file_names_are_unique_and_no_folder_is_a_package():
    """pytest imports each test file by its base name (rootdir-relative, no __init__.py): two files of one name in
    different folders would collide."""
    names = [p.name for p in collected_files()]
    assert sorted(set(n for n in names if names.count(n) > 1)) == []
    assert [str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py")] == []


def test_only_helpers_and_conftest_sit_beside_the_test_files():
    """Shared code is in tests/*_helpers.py at the top: there, every test file imports it by the same name."""
    odd = [str(p.relative_to(TESTS)) for p in python_files() if not p.name.startswith("test_")
           and not (p.parent == TESTS and (p.name == "conftest.py" or p.name.endswith("_helpers.py")))]
    assert not odd, f"move these into tests/*_helpers.py or rename them test_*.py: {odd}"


def test_no_test_module_imports_conftest_or_another_test_module():
    test_modules = {p.stem for p in collected_files()}
    found = []
    for path in python_files():
        for line, name in imported_modules(path):
            if name == "conftest" or name in test_modules or name == ".":
                found.append(f"{path.relative_to(TESTS)}:{line} imports {name}")
    assert not found, "import shared code from a tests/*_helpers.py module instead:\n" + "\n".join(found)


def test_conftest_holds_only_fixtures_and_hooks():
    """conftest.py defines fixtures (decorated with pytest.fixture) and pytest_* hooks; helper functions, classes and
    constants go to a helper module."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    defined = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defined.append(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            if not fixture and not node.name.startswith("pytest_"):
                defined.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            defined.append(ast.unparse(node).split("=")[0].strip())
    assert not defined, f"move these from conftest.py into a tests/*_helpers.py module: {defined}"
