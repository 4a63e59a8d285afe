"""The package's layers: every import, at the top of a module or inside a function, goes to the importer's own layer
or one below it, never above. The layers are the numbered list in docs/development.md's Layout section, read from
there, so the order is written in one place; every room of the package (a folder of src/kvbench or a top-level
module) is in exactly one layer."""

import ast
import re
from pathlib import Path

import kvbench

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "development.md"
SRC = Path(kvbench.__file__).resolve().parent  # the package under test: PYTHONPATH chooses which tree


def layers() -> dict[str, int]:
    """Room -> its layer (1 is the bottom), from the Layout section's numbered list of layers."""
    section = DOC.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = section.split("Layers, bottom up", 1)[1].split("```", 2)[1]
    out: dict[str, int] = {}
    for line in block.splitlines():
        m = re.match(r"\s*(\d+)\.\s+(.*)", line)
        if m:
            for name in m.group(2).split():
                assert name.rstrip("/") not in out, f"{name} is in two layers"
                out[name.rstrip("/")] = int(m.group(1))
    assert out, "no layers found in docs/development.md's Layout section"
    return out


def room(module: str) -> str | None:
    """kvbench.bench.settings -> bench; kvbench.validate -> validate; the package itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str) -> str | None:
    """The kvbench module `name` names (`from kvbench.caches import get_cache_spec` -> kvbench.caches)."""
    parts = name.split(".")
    while parts:
        p = SRC.parent.joinpath(*parts)
        if p.with_suffix(".py").is_file() or (p / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def imports(path: Path) -> set[tuple[int, str]]:
    """(line, kvbench module) for every import in `path`, anywhere in it (functions, TYPE_CHECKING blocks)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from pkg import submodule` too
        for n in names:
            if n.startswith("kvbench.") and (m := resolve(n)) is not None:
                out.add((node.lineno, m))
    return out


def rooms() -> set[str]:
    return {r for p in SRC.rglob("*.py") if (r := room(module_name(p))) is not None}


def test_every_room_is_in_one_layer():
    assert rooms() <= set(layers()), f"not in docs/development.md's layers: {sorted(rooms() - set(layers()))}"
    assert set(layers()) <= rooms(), f"layers name what the package lacks: {sorted(set(layers()) - rooms())}"


def test_no_import_runs_up_a_layer():
    layer = layers()
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        src = room(module_name(path))
        if src is None:
            continue
        for line, target in sorted(imports(path)):
            dst = room(target)
            if dst is not None and dst != src and layer.get(dst, 0) > layer.get(src, 0):
                rel = path.relative_to(SRC)
                upward.append(f"{rel}:{line} ({src}, layer {layer.get(src)}) imports {target} (layer {layer.get(dst)})")
    assert not upward, "imports running up a layer:\n" + "\n".join(upward)


def test_the_layers_read_from_the_doc_are_in_their_stated_order():
    """A check of the reader: the order docs/development.md states is the one the code is held to."""
    layer = layers()
    assert layer["errors"] == 1 and layer["validate"] == 1
    assert layer["memory"] < layer["model"] < layer["caches"] < layer["decode"] < layer["hf"] < layer["check"]
    assert layer["check"] < layer["bench"] < layer["results"] < layer["cli"]
