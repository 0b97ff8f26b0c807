"""The layout's import rules, checked on the source (ast), transitively through the project:

- the engine (tandem/engine), the kernels and the domain cores of the services import neither grpc
  nor protobuf nor the generated stubs (tandem.v1), nor protoconv, which converts to them; what
  they exchange with other services are the dataclasses of tandem.serving.messages;
- nothing but tools imports tandem.tools (a service never depends on the CLI, bench or distill);
- the engine does not import the serving layer or the services (it is the layer below them).

A rule is broken also when a module reaches a forbidden one through another project module, so
a core cannot launder grpc through a helper.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package lives in the tree (pyproject.toml's package-dir).
ROOTS = {"tandem.kernels": ROOT / "kernels", "tandem.services": ROOT / "services", "tandem": ROOT / "tandem"}

CORES = [
    "tandem.services.verifier.core",
    "tandem.services.verifier.drafting",
    "tandem.services.gateway.core",
    "tandem.services.drafter.core",
]
WIRE = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "tandem.v1", "tandem.serving.protoconv")


def module_path(name: str) -> Path | None:
    for prefix, folder in ROOTS.items():
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".").split(".") if name != prefix else []
            base = folder.joinpath(*rest)
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def all_modules() -> list[str]:
    names = []
    for prefix, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "tandem" and parts[:1] == ["v1"]:
                continue  # generated stubs
            if module_path(name) == path:  # skip `tandem/...` shadows of other roots
                names.append(name)
    return sorted(set(names))


def imports_of(name: str) -> Iterator[str]:
    """Every module `name` imports, anywhere in the file (function-level imports included)."""
    path = module_path(name)
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod
            for alias in node.names:  # `from tandem.v1 import common_pb2` imports tandem.v1.common_pb2
                yield f"{mod}.{alias.name}"


def reach(start: str) -> dict[str, str]:
    """Every module reachable from `start` -> the project module that imports it first found."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        for imported in imports_of(name):
            if imported in seen:
                continue
            seen[imported] = name
            if module_path(imported) is not None and not imported.startswith("tandem.v1"):
                todo.append(imported)
    return seen


def hits(reached: dict[str, str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{mod} (imported by {by})" for mod, by in reached.items()
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    )


def test_the_tree_maps_to_modules() -> None:
    names = all_modules()
    assert "tandem.engine.spec" in names and "tandem.services.verifier.core" in names
    assert "tandem.kernels.triton_verify" in names and "tandem.tools.cli" in names
    assert module_path("tandem.services.gateway.core") == ROOT / "services/gateway/core.py"


@pytest.mark.parametrize("core", CORES)
def test_domain_cores_are_protocol_free(core: str) -> None:
    assert hits(reach(core), WIRE + ("tandem.tools",)) == []


@pytest.mark.parametrize("name", [n for n in all_modules() if n.startswith(("tandem.engine", "tandem.kernels"))])
def test_engine_and_kernels_import_no_wire_services_or_tools(name: str) -> None:
    assert hits(reach(name), WIRE + ("tandem.tools", "tandem.services", "tandem.serving")) == []


@pytest.mark.parametrize("name", [n for n in all_modules() if not n.startswith("tandem.tools")])
def test_only_tools_import_tools(name: str) -> None:
    assert hits(reach(name), ("tandem.tools",)) == []


def test_the_rule_catches_a_violation(tmp_path, monkeypatch) -> None:
    """The checker itself: a core that reaches grpc through a helper is caught."""
    pkg = tmp_path / "services"
    (pkg / "x").mkdir(parents=True)
    (pkg / "x" / "core.py").write_text("from . import helper\n")
    (pkg / "x" / "helper.py").write_text("def f():\n    import grpc\n")
    monkeypatch.setitem(ROOTS, "tandem.services", pkg)
    assert hits(reach("tandem.services.x.core"), WIRE) == ["grpc (imported by tandem.services.x.helper)"]


def test_the_wheel_carries_every_file_the_code_reads(tmp_path) -> None:
    """An installed package (the container image's `pip install .`, not this editable checkout) has
    the C sources of our CPU kernels, which are compiled on first use, and the bundled prompt sets.
    A C file missing from the wheel once meant the image's services could not start."""
    import shutil
    import subprocess
    import sys
    import zipfile

    # From a copy of what the image's build context holds: setuptools builds in-tree (build/), and
    # a stale build/ in the checkout would hide a file the package data no longer names.
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    for name in ("tandem", "services", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("tandem_spec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tandem" / "engine").glob("*.c"))
    assert sources and all(s in names for s in sources), sorted(set(sources) - names)
    assert any(n.startswith("tandem/tools/prompts/") and n.endswith(".jsonl") for n in names)
    assert "tandem/kernels/reference.py" in names and "tandem/services/gateway/tools.py" in names


def test_the_kernels_folder_does_not_shadow_a_package_of_that_name() -> None:
    """From a checkout's root (`python -m ...` puts it first on sys.path) the bare name `kernels` is
    Hugging Face's package, which transformers 5.25+ imports while loading a model; our folder is
    only `tandem.kernels`. Without that package installed, the bare import fails saying so."""
    import importlib.metadata
    import subprocess
    import sys

    code = ("import kernels, sys; from tandem import kernels as ours; "
            "print(kernels.__file__); print(ours.__name__, hasattr(ours, 'greedy_accept'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    try:
        installed = bool(importlib.metadata.version("kernels"))
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:
        assert res.returncode == 0, res.stderr
        first, second = res.stdout.splitlines()
        assert not first.startswith(str(ROOT / "kernels")) and second == "tandem.kernels True"
    else:
        assert res.returncode != 0 and "imported as tandem.kernels" in res.stderr
