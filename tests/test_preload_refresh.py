"""A daemon's restart never puts its config's preload back over data put under the key by
hand since (a nightly ``shmcache put NEW --key K --overwrite``); a changed config source
is loaded; the log says which and why."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

from service_helpers import app_client, wait_job
from source_times import age

import shmcache
from shmcache._disk.layout import Layout


def _sources(tmp_path: Path) -> dict[str, Path]:
    folders = {}
    for name, value in (("today", 1.0), ("new", 2.0), ("v2", 3.0)):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        np.save(folders[name] / "x.npy", np.full(4, value))
    age(*folders.values())  # else racily clean: loaded again at every start
    return folders


def _config(tmp_path: Path, root: Path, source: Path) -> Path:
    config = tmp_path / "shmcache.toml"
    config.write_text(f'root = "{root}"\n\n[[datasets]]\nkey = "today"\nsource = "{source}"\n')
    return config


def _start(root: Path, config: Path) -> list[str]:
    """Start the daemon once, wait for its preload jobs; the jobs' sources."""
    with app_client(root, config_file=config) as client:
        jobs = client.get("/v1/jobs").json()
        for job in jobs:
            assert wait_job(client, job["id"])["state"] == "done"
        return [job["source"] for job in jobs]


def _x(root: Path) -> list[float]:
    return shmcache.Store(root).open_array("today/x").tolist()  # type: ignore[no-any-return]


def test_a_restart_keeps_a_refresh_put_by_hand(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shmcache.service")
    sources = _sources(tmp_path)
    config = _config(tmp_path, root, sources["today"])
    assert _start(root, config) == [str(sources["today"])]
    assert _x(root) == [1.0] * 4
    shmcache.Store(root).put_file("today", sources["new"], overwrite=True)  # the nightly refresh
    caplog.clear()
    assert _start(root, config) == []  # nothing loaded back over it
    assert _x(root) == [2.0] * 4
    assert f"preload today: kept today/x, put from {sources['new'] / 'x.npy'} at " in caplog.text
    again = f"to load the preload again, evict today and restart (or put {sources['today']} under it"
    assert again in caplog.text
    shmcache.Store(root).put_array("today/x", np.zeros(4), overwrite=True)  # from memory: kept too
    caplog.clear()
    assert _start(root, config) == [] and _x(root) == [0.0] * 4
    assert "kept today/x, put from memory (put_array) at " in caplog.text
    shmcache.Store(root).evict("today/x")  # what the log says to do: the preload loads again
    assert _start(root, config) == [str(sources["today"])] and _x(root) == [1.0] * 4


def test_a_changed_config_source_is_loaded(root: Path, tmp_path: Path) -> None:
    sources = _sources(tmp_path)
    assert _start(root, _config(tmp_path, root, sources["today"])) == [str(sources["today"])]
    assert _start(root, _config(tmp_path, root, sources["v2"])) == [str(sources["v2"])]
    assert _x(root) == [3.0] * 4
    record = json.loads(Layout(root).preloads.read_text())
    assert record == {"today": [str(sources["today"]), str(sources["v2"])]}
    assert _start(root, _config(tmp_path, root, sources["v2"])) == []  # unchanged: skipped


def test_a_changed_preload_source_file_is_reloaded_and_a_damaged_record_ignored(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sources = _sources(tmp_path)
    config = _config(tmp_path, root, sources["today"])
    assert _start(root, config) == [str(sources["today"])]
    np.save(sources["today"] / "x.npy", np.full(4, 5.0))  # the preload's own files changed
    age(sources["today"])
    assert _start(root, config) == [str(sources["today"])] and _x(root) == [5.0] * 4
    Layout(root).preloads.write_text("{not json")
    caplog.set_level(logging.INFO, logger="shmcache.service")
    np.save(sources["today"] / "x.npy", np.full(4, 6.0))
    age(sources["today"])
    assert _start(root, config) == [str(sources["today"])] and _x(root) == [6.0] * 4
    assert "preloads load as on a first start" in caplog.text
    assert json.loads(Layout(root).preloads.read_text()) == {"today": [str(sources["today"])]}


def test_a_root_without_a_record_loads_a_changed_config_as_before(root: Path, tmp_path: Path) -> None:
    """Entries preloaded by a daemon that kept no record (an upgrade), then a config that
    names another source: loaded, not taken for a refresh by hand."""
    sources = _sources(tmp_path)
    shmcache.Store(root).put_file("today", sources["today"])  # what the older daemon loaded
    assert _start(root, _config(tmp_path, root, sources["v2"])) == [str(sources["v2"])]
    assert _x(root) == [3.0] * 4


def test_a_failed_load_of_a_new_source_does_not_make_the_old_entries_a_refresh(
    root: Path, tmp_path: Path
) -> None:
    sources = _sources(tmp_path)
    assert _start(root, _config(tmp_path, root, sources["today"])) == [str(sources["today"])]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.npy").write_bytes(b"not an npy file")
    age(broken)
    with app_client(root, config_file=_config(tmp_path, root, broken)) as client:
        (job,) = client.get("/v1/jobs").json()
        assert wait_job(client, job["id"])["state"] == "failed"
    assert _x(root) == [1.0] * 4  # the old entries stay, and are the preload's own:
    assert _start(root, _config(tmp_path, root, sources["v2"])) == [str(sources["v2"])]


def test_a_url_preload_keeps_its_secrets_out_of_the_record_and_the_log(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shmcache.service")
    url = "https://deploy:s3cr3t@127.0.0.1:9/data/x.npy?token=abc"  # nothing listens on port 9
    config = tmp_path / "shmcache.toml"
    config.write_text(f'root = "{root}"\n\n[[datasets]]\nkey = "x"\nsource = "{url}"\n')
    with app_client(root, config_file=config) as client:
        for job in client.get("/v1/jobs").json():
            wait_job(client, job["id"])
    assert "preload x" in caplog.text
    assert "s3cr3t" not in caplog.text and "token=abc" not in caplog.text
    if Layout(root).preloads.exists():
        assert "s3cr3t" not in Layout(root).preloads.read_text()
