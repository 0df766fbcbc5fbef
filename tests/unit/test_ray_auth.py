"""The per-install Ray token: made once, readable by its owner only, refused if others can read it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from riskserve.operations.ray_auth import install_token, token_mode_env
from riskserve.platform.errors import ConfigError


def test_the_token_is_made_once_with_owner_only_modes(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    path = install_token(directory)
    token = path.read_text()
    assert len(token) == 64
    int(token, 16)  # hex
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert install_token(directory).read_text() == token  # the same install keeps its token
    assert token_mode_env(path) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def test_a_token_others_can_read_is_refused(tmp_path: Path) -> None:
    path = install_token(tmp_path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        install_token(tmp_path)
