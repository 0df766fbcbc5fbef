"""Each peer in its own venv under a cache directory, installed once from the package registry, pinned.

Their generated ``inference.*`` protobuf modules clash in one process, and their dependency pins clash
with riskserve's, so every peer gets a venv of its own: ``$RISKSERVE_PEERS_CACHE`` or
``~/.cache/riskserve/peers/<name>``. A venv is (re)installed only when its stamp file does not hold the
exact requirement list below; the installed versions are read back with ``pip freeze`` and reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PEERS", "Peer", "ensure", "installed"]

STAMP = ".riskserve-peer"


@dataclass(frozen=True)
class Peer:
    """A peer's venv: its name and the requirements installed into it."""

    name: str
    pins: tuple[str, ...]


PEERS = {
    "mlserver": Peer("mlserver", ("mlserver==1.7.1", "mlserver-sklearn==1.7.1", "mlserver-xgboost==1.7.1")),
    "kserve": Peer("kserve", ("kserve==0.21.0", "xgboost==3.2.0", "scikit-learn==1.9.1")),
    "pytriton": Peer("pytriton", ("nvidia-pytriton==0.7.0", "xgboost==3.2.0", "scikit-learn==1.9.1")),
}


def cache_dir() -> Path:
    """Where the venvs live."""
    default = Path.home() / ".cache" / "riskserve" / "peers"
    return Path(os.environ.get("RISKSERVE_PEERS_CACHE", default))


def ensure(name: str) -> Path:
    """The venv of peer ``name``, created and installed first if its stamp is missing or stale."""
    peer = PEERS[name]
    venv = cache_dir() / name
    stamp = venv / STAMP
    wanted = "\n".join(peer.pins) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return venv
    print(f"[peers] installing {name} into {venv}: {' '.join(peer.pins)}", file=sys.stderr, flush=True)
    if not (venv / "bin" / "python").exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *peer.pins], check=True)
    stamp.write_text(wanted)
    return venv


def installed(name: str) -> dict[str, str]:
    """Package -> version of what a peer's venv holds for its pinned packages (``pip freeze``)."""
    venv = ensure(name)
    frozen = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wanted = {p.split("==")[0].lower().replace("_", "-") for p in PEERS[name].pins}
    out = {}
    for line in frozen.splitlines():
        package, _, version = line.partition("==")
        if package.lower().replace("_", "-") in wanted:
            out[package] = version
    return out
