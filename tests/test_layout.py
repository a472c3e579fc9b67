"""The package's shape: its parts, the one direction of their imports, and docs/architecture.md kept true.

Parsed with ``ast`` (nothing is imported): every ``import``/``from ... import`` of the package,
at module level, inside functions and under ``TYPE_CHECKING``, plus modules named in strings
passed to ``import_module``. Parts, lowest first::

    base     errors, _version, _options, _children (imports no other part)
    format   bytes <-> samples                     (base)
    store    one cache directory in one process    (format, base)
    dataset  CachedDataset                         (store, format, base)
    loader   batches                               (dataset, store, format, base)
    tools    whole caches, the command line        (dataset, store, format, base)
    face     lmdbcache/__init__, __main__, codec, _commit (compatibility aliases)
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lmdbcache"
DOCS = PACKAGE.parent / "docs"

RANK = {"base": 0, "format": 1, "store": 2, "dataset": 3, "loader": 4, "tools": 4, "face": 5}
# Calls made at run time, inside a function, from a lower part to a higher one: each with its reason.
ALLOWED_UPWARD = {
    # ``ds.loader(...)``: a thin method returning ``Loader(ds, ...)``, kept for existing code; the
    # import runs when it is called, so the dataset module itself never depends on the loader.
    ("lmdbcache.dataset", "lmdbcache.loader"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    names = module.split(".")
    if len(names) == 1:
        return "face"
    if names[1] in ("format", "store", "loader", "tools"):
        return names[1]
    if names[1] == "_native":
        return "store"  # the compiled core serves the read path
    if names[1] == "dataset":
        return "dataset"
    if names[1] in ("errors", "_version", "_options", "_children"):
        return "base"
    return "face"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import of the package in the file."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = modules()
    found: list[tuple[str, bool]] = []
    top_level = {id(n) for n in tree.body} | {
        id(child)
        for n in tree.body
        if isinstance(n, ast.If)  # TYPE_CHECKING blocks count as module level (type-only edges)
        for child in n.body
    }

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(tree):
        level = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), level) for a in node.names if a.name.startswith("lmdbcache")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("lmdbcache"):
                continue
            for alias in node.names:  # `from . import _fs` imports a module
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else resolve(target), level))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            # code in a string (a child process's -c, import_module's argument); docstrings name modules freely
            for name in re.findall(r"\blmdbcache(?:\.[A-Za-z_]+)+", node.value):
                if resolve(name) and resolve(name) != "lmdbcache":
                    found.append((resolve(name), False))
    return [(m, level) for m, level in found if m and m != module]


def graph() -> dict[str, set[tuple[str, bool]]]:
    return {m: set(imports(p, m)) for m, p in modules().items()}


def test_every_module_belongs_to_a_part_and_imports_only_downward():
    """No import from a lower part into a higher one (type-only imports included), but the allowed few."""
    upward = []
    for module, targets in graph().items():
        for target, _ in targets:
            a, b = part_of(module), part_of(target)
            if a == "face" or (module, target) in ALLOWED_UPWARD:
                continue
            if RANK[b] > RANK[a] or (RANK[b] == RANK[a] and a != b):
                upward.append(f"{module} ({a}) imports {target} ({b})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle_between_modules_or_parts():
    """No cycle among modules imported at module level, and none among parts counting every import."""
    g = graph()
    level = {m: {t for t, at_top in ts if at_top} for m, ts in g.items()}
    parts: dict[str, set[str]] = defaultdict(set)
    for m, ts in g.items():
        for t, _ in ts:
            if (m, t) not in ALLOWED_UPWARD and part_of(m) != part_of(t) and part_of(m) != "face":
                parts[part_of(m)].add(part_of(t))
    for edges in (level, parts):
        cycle = find_cycle(edges)
        assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph ``edges``, or None (depth-first, colouring the nodes)."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_each_part_says_what_it_is_and_what_it_may_import():
    """Every subpackage's __init__ has a docstring that names what the part may import."""
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init} does not say what it may import"


def test_modules_and_functions_stay_small():
    """No module over 480 lines, no function body over about 50 (the layout issue's ~450 and ~50; signatures and
    docstrings not counted: they are the documentation)."""
    big = []
    for module, path in modules().items():
        text = path.read_text()
        if text.count("\n") > 480:
            big.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
                if node.end_lineno - body[0].lineno + 1 > 55:  # "about 50"
                    big.append(f"{module}.{node.name}: a body of {node.end_lineno - body[0].lineno + 1} lines")
    assert not big, "\n".join(big)


def test_architecture_doc_names_every_module_and_part():
    """docs/architecture.md lists every module of the package under its part, and no module that is gone."""
    doc = (DOCS / "architecture.md").read_text()
    named = set(re.findall(r"`(lmdbcache/[\w/]+\.py)`", doc))
    actual = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")}
    assert actual - named == set(), f"not in docs/architecture.md: {sorted(actual - named)}"
    assert named - actual == set(), f"in docs/architecture.md but gone: {sorted(named - actual)}"


def test_a_dataset_pickled_before_the_move_still_unpickles_and_reads(tmp_path):
    """A CachedDataset pickled by main before the layout (0.3, commit 8c378a4; it names lmdbcache._commit.Policy)
    unpickles and reads its cache (tests/data/pickled-0.3: the pickle and the 12-sample cache it was opened on)."""
    import os
    import pickle
    import shutil

    from helpers import assert_same, sample_for

    data = Path(__file__).parent / "data" / "pickled-0.3"
    recorded = "/tmp/lmdbcache-pickled-by-0.3/cache.lmdb"  # the absolute path the pickle holds
    if os.path.exists(recorded):
        shutil.rmtree(recorded)
    os.makedirs(recorded)
    shutil.copy(data / "data.mdb", recorded)
    try:
        with open(data / "dataset.pkl", "rb") as f:
            ds = pickle.load(f)
        assert (ds.path, ds.fingerprint, len(ds)) == (recorded, "pickled-by-main-8c378a4", 12)
        for i in range(12):
            assert_same(ds[i], sample_for(i))  # index 0 from the cache, the others decoded and filled
        assert ds.cached_count == 12
        again = pickle.loads(pickle.dumps(ds))
        assert_same(again[5], sample_for(5))
        ds.close()
        again.close()
    finally:
        shutil.rmtree(os.path.dirname(recorded), ignore_errors=True)
