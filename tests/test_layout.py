"""The layout's import rules, checked on the source (ast), transitively through the project:

- the engine (tandem/engine), the kernels and the domain cores of the services import neither grpc
  nor protobuf nor the generated stubs (tandem.v1), nor protoconv, which converts to them; what
  they exchange with other services are the dataclasses of tandem.serving.messages;
- nothing but tools imports tandem.tools (a service never depends on the CLI, bench or distill);
- the engine does not import the serving layer or the services (it is the layer below them);
- the contract (tandem.contract), the vocabulary every tier shares, imports no torch, grpc or
  transformers, and nothing of the project but itself;
- the engine's layers import only downward: native (C kernels, their build) < model (loading, the
  forward) < speculation (proposers, verification) < scheduler (sequences, the step loop);
- no import cycles anywhere in the product;
- the gateway process imports no torch (checked in a subprocess that serves a request).

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
    assert "tandem.engine.scheduler.generate" in names and "tandem.services.verifier.core" in names
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


LAYERS = ("native", "model", "speculation", "scheduler")  # bottom first


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    if parts[:2] == ["tandem", "engine"] and len(parts) > 2 and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


def edges(name: str) -> set[str]:
    """Project modules `name` imports, less its own parent packages (importing a submodule runs
    its package's __init__ first, which is no dependency of the design)."""
    parents = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
    return {m for m in imports_of(name) if module_path(m) is not None and not m.startswith("tandem.v1")
            and m != name and m not in parents}


@pytest.mark.parametrize("name", [n for n in all_modules() if n.startswith("tandem.contract")])
def test_the_contract_is_torch_grpc_and_transformers_free(name: str) -> None:
    forbidden = ("torch", "grpc", "transformers", "tandem.engine", "tandem.kernels", "tandem.serving",
                 "tandem.services", "tandem.tools", "tandem.v1")
    assert hits(reach(name), forbidden) == []


def test_every_engine_module_sits_in_a_layer() -> None:
    loose = [n for n in all_modules() if n.startswith("tandem.engine.") and layer_of(n) is None]
    assert loose == []


@pytest.mark.parametrize("name", [n for n in all_modules() if layer_of(n) is not None])
def test_engine_layers_import_only_downward(name: str) -> None:
    up = sorted(m for m in edges(name) if (layer_of(m) or -1) > layer_of(name))
    assert up == [], f"{name} (layer {LAYERS[layer_of(name)]}) imports a layer above it"


def cycles(modules: list[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), any import counted."""
    graph = {m: edges(m) & set(modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in modules:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_product() -> None:
    assert cycles(all_modules()) == []


def fake_services(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """`tandem.services.x.<name>` modules with these sources, in place of the real services."""
    pkg = tmp_path / "services"
    (pkg / "x").mkdir(parents=True)
    for name, source in files.items():
        (pkg / "x" / f"{name}.py").write_text(source)
    monkeypatch.setitem(ROOTS, "tandem.services", pkg)


def test_the_cycle_check_finds_one(tmp_path, monkeypatch) -> None:
    fake_services(tmp_path, monkeypatch, {"a": "from tandem.services.x import b\n",
                                          "b": "def f():\n    from tandem.services.x.a import g\n"})
    assert cycles(["tandem.services.x.a", "tandem.services.x.b"]) == [["tandem.services.x.a", "tandem.services.x.b"]]


def test_the_rule_catches_a_violation(tmp_path, monkeypatch) -> None:
    """The checker itself: a core that reaches grpc through a helper is caught."""
    fake_services(tmp_path, monkeypatch, {"core": "from . import helper\n", "helper": "def f():\n    import grpc\n"})
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
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tandem" / "engine").rglob("*.c"))
    assert sources and all(s in names for s in sources), sorted(set(sources) - names)
    assert any(n.startswith("tandem/tools/prompts/") and n.endswith(".jsonl") for n in names)
    assert "tandem/kernels/reference.py" in names and "tandem/services/gateway/tool_calls.py" in names


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


def test_the_gateway_process_imports_no_torch(tiny_dir) -> None:
    """A real gateway process (`tandem gateway`, as `tandem up` starts it) loads its model's
    tokenizer, answers a chat request (503 here: its one verifier is not there) and stops on
    SIGTERM, and torch was never imported: the gateway tier needs no torch, its start stays quick."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    http_port, grpc_port, dead = port(), port(), port()
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('TORCH', 'torch' in sys.modules, flush=True))\n"
            "from tandem.tools.cli import app\n"
            "app()\n")
    args = ["gateway", "--model", str(tiny_dir), "--verifier", f"127.0.0.1:{dead}", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--metrics-port", "0"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = f"http://127.0.0.1:{http_port}"
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                           json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}]})
        assert reply.status_code == 503, reply.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "TORCH False" in out, out[-3000:]


def test_command_help_imports_no_torch() -> None:
    """`tandem <command> --help` runs nothing, so it answers without importing torch (it took ~2 s
    with torch on the 2-core host, 0.2-0.4 s without)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from tandem.tools.cli import app\n"
            "try:\n"
            "    app()\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    for args in (["--help"], ["up", "--help"], ["bench", "--help"], ["verifier", "--help"]):
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
        assert "Usage" in res.stdout and res.stdout.rstrip().endswith("TORCH False"), (args, res.stdout[-300:], res.stderr)
