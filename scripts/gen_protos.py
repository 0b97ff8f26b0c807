"""Regenerate the Python stubs of the gRPC contract: the one command for protos/ -> tandem/v1/.

    python scripts/gen_protos.py          # (re)write tandem/v1/*_pb2.py[i], *_pb2_grpc.py[i]
    python scripts/gen_protos.py --check  # write nothing; exit 1 listing stale files

Every .proto under protos/ is compiled with grpc_tools.protoc (-I protos, output at the repo root),
so `protos/tandem/v1/common.proto` becomes the module `tandem.v1.common_pb2`, and because the protos
import each other as "tandem/v1/common.proto" the generated code imports absolutely
(`from tandem.v1 import common_pb2`). Type stubs (.pyi) come from mypy-protobuf's plugins
`protoc-gen-mypy` and `protoc-gen-mypy_grpc`, looked up next to the running interpreter, then on
PATH.

The output depends only on the .proto files and the versions of grpcio-tools and mypy-protobuf:
the stubs are generated into a temporary directory and then synchronized into the tree (changed
files rewritten, generated files whose .proto is gone removed). --check does the same comparison
without writing, which is what tests/test_protos.py runs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
# Suffixes of the files protoc writes for `x.proto`: x_pb2.py, x_pb2.pyi, x_pb2_grpc.py, ...
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")


def find_plugin(name: str) -> Path:
    """Path of a protoc plugin executable: next to sys.executable (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return beside
    found = shutil.which(name)
    if found is None:
        sys.exit(f"gen_protos: {name} not found next to {sys.executable} or on PATH "
                 "(pip install mypy-protobuf)")
    return Path(found)


def proto_files() -> list[Path]:
    """Every .proto under protos/, sorted so that protoc always sees the same order."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        sys.exit(f"gen_protos: no .proto files under {PROTO_ROOT}")
    return protos


def generate(out_dir: Path, protos: list[Path]) -> None:
    """Run protoc over `protos` with the Python, gRPC and mypy generators, writing under out_dir."""
    import grpc_tools  # imported here so that --help works without grpcio-tools installed

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    plugin_flags = [f"--plugin={name}={find_plugin(name)}" for name in PLUGINS]
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known}",
        *plugin_flags,
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p) for p in protos),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"gen_protos: protoc failed ({result.returncode}):\n{result.stderr}")


def expected_paths(protos: list[Path]) -> set[Path]:
    """Repo-relative paths of every generated file, e.g. tandem/v1/common_pb2.py."""
    paths = set()
    for proto in protos:
        stem = proto.relative_to(PROTO_ROOT).with_suffix("")
        paths.update(stem.parent / f"{stem.name}{suffix}" for suffix in GENERATED_SUFFIXES)
    return paths


def committed_paths(protos: list[Path]) -> set[Path]:
    """Repo-relative paths of generated-looking files now in the output packages (e.g. tandem/v1/)."""
    package_dirs = {proto.relative_to(PROTO_ROOT).parent for proto in protos}
    return {
        path.relative_to(REPO)
        for package_dir in package_dirs
        if (REPO / package_dir).is_dir()
        for path in (REPO / package_dir).iterdir()
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the committed stubs with fresh ones; exit 1 if any is stale")
    args = parser.parse_args(argv)

    protos = proto_files()
    expected = expected_paths(protos)
    with tempfile.TemporaryDirectory(prefix="tandem-protos-") as tmp:
        out_dir = Path(tmp)
        generate(out_dir, protos)
        produced = {p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file()}
        if produced != expected:  # a plugin missing or misnaming files would break the contract
            sys.exit(f"gen_protos: protoc produced {sorted(map(str, produced))}, "
                     f"expected {sorted(map(str, expected))}")

        changed = sorted(
            rel for rel in expected
            if not (REPO / rel).is_file() or (REPO / rel).read_bytes() != (out_dir / rel).read_bytes()
        )
        orphaned = sorted(committed_paths(protos) - expected)

        if args.check:
            if changed or orphaned:
                print("gen_protos: stale generated files (run `python scripts/gen_protos.py`):")
                for rel in changed:
                    print(f"  {rel}  ({'differs' if (REPO / rel).exists() else 'missing'})")
                for rel in orphaned:
                    print(f"  {rel}  (no .proto generates it)")
                return 1
            print(f"gen_protos: {len(expected)} generated files are up to date")
            return 0

        for rel in changed:
            (REPO / rel).parent.mkdir(parents=True, exist_ok=True)
            (REPO / rel).write_bytes((out_dir / rel).read_bytes())
        for rel in orphaned:
            (REPO / rel).unlink()
    for rel in changed:
        print(f"wrote   {rel}")
    for rel in orphaned:
        print(f"removed {rel}")
    print(f"gen_protos: {len(expected)} generated files, {len(changed)} written, "
          f"{len(orphaned)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
