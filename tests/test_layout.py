"""The package's layers (ARCHITECTURE.md): every import, lazy ones inside functions included,
goes to the same layer or one below it; no import cycle; no module of the package imports a name
through a package __init__ that re-exports it."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxrl_agent"

# Lowest first. A module's layer is its first dotted component below jaxrl_agent.
LAYERS = [
    ("env",),
    ("config", "structs", "program_store"),
    ("chat_template", "tokenizer", "trajectory", "row_layout", "advantages"),
    ("losses",),
    ("model", "hf"),
    ("sampling",),
    ("train",),
    ("agent",),
    ("loops",),
    ("cli", "__main__"),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ("jaxrl_agent",) + p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of the package in `path`, lazy ones included;
    `from pkg import name` counts as the submodule when `name` is one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("jaxrl_agent")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxrl_agent"):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the package imports absolutely"
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.append((sub if sub in MODULES else node.module, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {d for d, _ in _imports(p) if d in MODULES and d != m} for m, p in MODULES.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if m != "jaxrl_agent" and _layer(m) is None)
    assert not missing, f"add these to LAYERS here and to ARCHITECTURE.md: {missing}"


def test_imports_go_down_the_layers():
    bad = []
    for m, p in MODULES.items():
        for dep, line in _imports(p):
            if dep in MODULES and _layer(m) is not None and _layer(dep) is not None and _layer(dep) > _layer(m):
                bad.append(f"{p.relative_to(ROOT.parent)}:{line} ({LAYERS[_layer(m)][0]}) imports {dep}")
    assert not bad, "imports up the layers:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def _reexports(package: str) -> set[str]:
    """Names a package's __init__ binds by importing them from elsewhere."""
    tree = ast.parse(MODULES[package].read_text())
    return {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}


def test_no_name_through_a_package_init():
    """One import path per name inside the package: a name comes from the module defining it,
    never through a package __init__ that re-exports it (`jaxrl_agent.losses` re-exports the
    kernel API for users, DESIGN §4; the package itself imports `losses.kernels`)."""
    bad = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in PACKAGES:
                names = [a.name for a in node.names
                         if a.name in _reexports(node.module) and f"{node.module}.{a.name}" not in MODULES]
                if names:
                    bad.append(f"{p.relative_to(ROOT.parent)}:{node.lineno} from {node.module} import {names}")
    assert not bad, "import these from their defining module:\n" + "\n".join(bad)


def test_env_imports_no_jax():
    """env/ runs in the sandbox workers' minimal processes: no JAX, no flax, nothing above it."""
    bad = []
    for m, p in MODULES.items():
        if _layer(m) != 0:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{m}: {n}" for n in names if n.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax")]
    assert not bad
