"""The package's layering: a module may import another module's public
names and the internal modules (those whose names start with "_": the call
layer _dispatch, the checks, the storage table, the compiled _core), but
never a private name ("_name") from another module.  This walks the import
statements of every module of the installed package."""
import ast
import pathlib

import pytest

import fastattn

ROOT = pathlib.Path(fastattn.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))


def is_module(package, name):
    folder = ROOT.joinpath(*package.split(".")[1:])
    return ((folder / f"{name}.py").exists() or (folder / name).is_dir()
            or any(folder.glob(f"{name}.*.so")) or any(folder.glob(f"{name}.pyx")))


def private_imports(text, package):
    """(line, module, name) of each private name that the source text, a
    module of package, imports from a module of fastattn."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # relative: from the module's own package upwards
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        if source != "fastattn" and not source.startswith("fastattn."):
            continue
        for alias in node.names:
            name = alias.name
            if name.startswith("_") and not name.startswith("__") and not is_module(source, name):
                found.append((node.lineno, source, name))
    return found


def package_of(path):
    return ".".join(("fastattn",) + path.relative_to(ROOT).parent.parts)


def test_the_walk_sees_the_modules():
    names = {p.name for p in MODULES}
    assert {"attention.py", "paged.py", "paged_cache.py", "_dispatch.py", "cli.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_modules(path):
    assert private_imports(path.read_text(), package_of(path)) == []


def test_the_walk_finds_a_private_import():
    text = ("from . import _core, _checks as C\nfrom ._dispatch import route\n"
            "from .attention import merge_attention, _hidden\n"
            "from fastattn.paged import _secret\nfrom .. import _extras\n")
    assert private_imports(text, "fastattn") == [(3, "fastattn.attention", "_hidden"),
                                                 (4, "fastattn.paged", "_secret")]
    assert private_imports("from .._storage import _fp8_encode\n", "fastattn.bench") == [
        (1, "fastattn._storage", "_fp8_encode")]
