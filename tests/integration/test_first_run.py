"""A fresh checkout: `expost migrate` and `expost demo` work in an empty directory (no ./var yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_migrate_and_demo_in_an_empty_directory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPOST_")}
    expost = str(Path(sys.executable).parent / "expost")
    for command in (["migrate"], ["demo"], ["demo"], ["ledger", "verify"]):
        done = subprocess.run(
            [expost, *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (command, done.stderr)
    assert (tmp_path / "var" / "expost.db").exists()
    keys = json.loads((tmp_path / "var" / "demo-keys.json").read_text())
    assert keys["dataset"].startswith("ds_")
    assert keys["learning_dataset"].startswith("ds_")
    assert keys["learning_dataset"] != keys["dataset"]
    assert {"admin", "analyst", "viewer"} <= set(keys)
    assert oct((tmp_path / "var" / "demo-keys.json").stat().st_mode & 0o777) == "0o600"
