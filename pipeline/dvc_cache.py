"""What a DVC pointer (`<dir>.dvc`, which git tracks) names, read from the local DVC cache: the files of
the version it records, without DVC's command (a second or more per call) or touching the workspace."""

from __future__ import annotations

import configparser
import json
import os
from pathlib import Path

import platformdirs
import yaml


def config_files(root: Path = Path(".")) -> list[Path]:
    """DVC's config files, the one that wins first: the checkout's (.dvc/config.local, .dvc/config), the
    user's (`dvc config --global`), the machine's (`--system`). A team's shared cache is often set globally."""
    user = os.environ.get("DVC_GLOBAL_CONFIG_DIR") or platformdirs.user_config_dir("dvc", "iterative")
    machine = os.environ.get("DVC_SYSTEM_CONFIG_DIR") or platformdirs.site_config_dir("dvc", "iterative")
    return [root / ".dvc" / "config.local", root / ".dvc" / "config", Path(user) / "config", Path(machine) / "config"]


def cache_dir(root: Path = Path(".")) -> Path:
    """The cache DVC uses here: the first `cache.dir` of `config_files` (relative to the file that sets it,
    `~` expanded, as DVC reads it), else .dvc/cache."""
    for path in config_files(root):
        config = configparser.ConfigParser()
        config.read(path)
        if config.has_option("cache", "dir"):
            return (path.parent / Path(config.get("cache", "dir")).expanduser()).resolve()
    return root / ".dvc" / "cache"


def _object(cache: Path, md5: str) -> Path:
    return cache / "files" / "md5" / md5[:2] / md5[2:]


def recorded_md5(pointer: Path) -> str | None:
    """The `<md5>.dir` (or file md5) the pointer records; None when it records none yet."""
    outs = (yaml.safe_load(pointer.read_text()) or {}).get("outs") or [{}]
    return outs[0].get("md5")


def recorded_files(pointer: Path) -> dict[str, Path] | None:
    """{relpath: cached file} of the directory version `pointer` records; None when the cache lacks its
    listing (`dvc fetch` brings it) or the pointer records no version."""
    md5 = recorded_md5(pointer)
    if not md5 or not md5.endswith(".dir"):
        return None
    cache = cache_dir()
    listing = _object(cache, md5)
    if not listing.is_file():
        return None
    return {e["relpath"]: _object(cache, e["md5"]) for e in json.loads(listing.read_text())}
