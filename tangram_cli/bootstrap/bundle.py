"""The agent bundle uploaded to every node: a content-addressed zip of the agent's source.

Choice (issue 5): ``src.zip`` holds the ``agent`` and ``tangram`` packages (Python sources and
package data; not ``tangram_cli``, which the node never runs), written with fixed timestamps and
sorted names so the same tree always gives the same bytes and the same hash. On the node it is
extracted next to itself and a ``tangram-bundle.pth`` file in a ``--system-site-packages`` venv
puts it on ``sys.path``: no pip, no build step, nothing downloaded. The third-party modules the
agent imports (pyzmq, msgpack, and docker for the docker executor) come from the node's Python;
when the probe finds them missing, `up` installs them into the venv with pip (needs an index).

The bundle's directory on the node is ``<workdir>/<cluster>/bundles/<hash>/``; an upload is
skipped when its ``.complete`` marker already holds the hash (``ssh.upload``).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import agent
from tangram_cli.bootstrap import plan

PACKAGES = ("agent", "tangram")
SUFFIXES = (".py", ".yaml", ".json", ".typed")
FIXED_TIME = (2020, 1, 1, 0, 0, 0)

# Runs on the node with the venv's python: extract src.zip once, then point a .pth file at it.
SETUP_SCRIPT = r"""
import glob, os, sys, zipfile
bundle, venv = (os.path.expanduser(a) for a in sys.argv[1:3])
src = os.path.join(bundle, "src")
if not os.path.isfile(os.path.join(src, ".extracted")):
    tmp = src + ".tmp"
    zipfile.ZipFile(os.path.join(bundle, "src.zip")).extractall(tmp)
    open(os.path.join(tmp, ".extracted"), "w").close()
    if os.path.isdir(src):
        import shutil; shutil.rmtree(src)
    os.rename(tmp, src)
sites = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
if not sites:
    sys.exit("no site-packages in " + venv)
with open(os.path.join(sites[0], "tangram-bundle.pth"), "w") as f:
    f.write(src + "\n")
import importlib.util
missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
print(" ".join(missing))
"""


@dataclass(frozen=True)
class Bundle:
    digest: str
    files: dict[str, bytes]  # what is uploaded: {"src.zip": bytes}

    @property
    def short(self) -> str:
        return self.digest[:12]


def project_root() -> Path:
    """The directory holding the ``agent`` and ``tangram`` packages."""
    return Path(agent.__file__).resolve().parent.parent


def source_files(root: Path | None = None) -> dict[str, bytes]:
    root = root or project_root()
    out: dict[str, bytes] = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*")):
            if not p.is_file() or p.is_symlink() or "__pycache__" in p.parts:
                continue
            if p.suffix in SUFFIXES or p.name == "py.typed":
                out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def make_zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[name])
    return buf.getvalue()


def build(root: Path | None = None) -> Bundle:
    """The bundle for this checkout; its digest names the remote bundle directory."""
    data = make_zip(source_files(root))
    files = {"src.zip": data}
    return Bundle(plan.bundle_hash(files), files)
