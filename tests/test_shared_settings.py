"""Settings of the shared tier: LAZYTRITON_SHARED, LAZYTRITON_SIGNING_KEY, LAZYTRITON_SHARED_TIMEOUT_MS and their
configure() twins; errors name the variable and the value; the key never shows in a repr; every variable is
documented in config.py and the README."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from sharedlib import make_entry

from lazytriton import config, runtime
from lazytriton.store.lease import LockUnavailable
from lazytriton.store.redis_tier import RedisTier
from lazytriton.store.shared import SharedURL, parse_url
from lazytriton.store.shared_dir import SharedDirTier

REPO = Path(__file__).resolve().parents[1]
KEY = "a1" * 16


@pytest.mark.parametrize(("url", "parsed"), [
    ("file:///mnt/nfs/lazytriton", SharedURL("file", "/mnt/nfs/lazytriton")),
    ("file:///mnt/x?lease_s=2.5", SharedURL("file", "/mnt/x", 2.5)),
    ("redis://10.0.0.5:6379/0", SharedURL("redis", "redis://10.0.0.5:6379/0")),
    ("rediss://:secret@cache.internal:6380/2?prefix=team-a&lease_s=60",
     SharedURL("rediss", "rediss://:secret@cache.internal:6380/2", 60.0, "team-a")),
])
def test_shared_urls_parse(url: str, parsed: SharedURL) -> None:
    assert parse_url(url) == parsed


@pytest.mark.parametrize(("url", "message"), [
    ("s3://bucket/x", "must start with file://, redis:// or rediss://"),
    ("/mnt/nfs", "must start with file://"),
    ("file://relative/path", "file:///absolute/path"),
    ("redis:///0", "needs a host"),
    ("redis://h:6379/0?timeout=5", "unknown parameter 'timeout'"),
    ("file:///x?prefix=a", "unknown parameter 'prefix'"),
    ("redis://h/0?lease_s=soon", "lease_s must be a number of seconds, got 'soon'"),
    ("redis://h/0?lease_s=0", "lease_s must be within"),
    ("redis://h/0?prefix=a/b", "prefix must be"),
    ("redis://h/0?prefix=caf\u00e9", "prefix must be"),
    ("redis://h:99999", "a Redis port must be a number within 1..65535, got '99999'"),
    ("redis://h:0/0", "within 1..65535, got '0'"),
    ("redis://h:/0", "within 1..65535, got ''"),
    ("redis://h:port/0", "within 1..65535, got 'port'"),
    ("redis://[::1]:70000", "within 1..65535, got '70000'"),
    ("redis://h:6379/x", "a Redis database is a number"),
    ("redis://h:6379/-1", "a Redis database is a number"),
    ("redis://h:6379/0/1", "a Redis database is a number"),
    ("redis://h/0?lease_s=1&lease_s=2", "parameter 'lease_s' given twice"),
    ("redis://h/0?lease_s", "name=value pairs"),
    ("redis://h/0?lease_s=nan", "lease_s must be within 0.05..3600 seconds, got 'nan'"),
    ("file:///x?lease_s=inf", "lease_s must be within"),
    ("redis://h/0#frag", "no #fragment"),
])
def test_bad_shared_urls_are_refused_naming_the_value(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        parse_url(url)
    assert str(raised.value).startswith("LAZYTRITON_SHARED")


def test_a_bad_port_is_refused_by_configure_and_the_password_never_shows() -> None:
    with pytest.raises(ValueError, match="LAZYTRITON_SHARED: a Redis port must be") as raised:
        config.configure(shared="redis://:hunter2@h:99999/0")
    assert "hunter2" not in str(raised.value) and ":***@h:99999" in str(raised.value)
    config.reset()


def test_a_missing_shared_directory_is_never_created(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "mnt" / "nfs" / "lazytriton"
    config.configure(shared=f"file://{missing}")
    with caplog.at_level(logging.WARNING, "lazytriton"):
        rt = runtime.get()
    assert rt.shared is None and [tier.name for tier in rt.chain.tiers] == ["image", "local"]
    assert "does not exist (not mounted?)" in caplog.text and str(missing) in caplog.text
    assert not (tmp_path / "mnt").exists(), "nothing of the path was created"
    tier = SharedDirTier(missing)  # used directly: misses, refuses to publish, gives no lease, creates nothing
    entry = make_entry(KEY)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.get(KEY) is None and not tier.put(KEY, entry) and list(tier.keys()) == []
        with pytest.raises(LockUnavailable):
            tier.try_lease(KEY)
    assert "not mounted?" in caplog.text
    assert not (tmp_path / "mnt").exists()
    config.reset()


def test_the_environment_is_read_and_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv("LAZYTRITON_SHARED", f"file://{tmp_path}/shared?lease_s=3")
    monkeypatch.setenv("LAZYTRITON_SIGNING_KEY", "k" * 20)
    monkeypatch.setenv("LAZYTRITON_SHARED_TIMEOUT_MS", "12.5")
    config.reset()
    settings = config.settings()
    assert settings.shared == f"file://{tmp_path}/shared?lease_s=3"
    assert settings.signing_key == b"k" * 20 and settings.shared_timeout_s == 0.0125
    assert "kkkk" not in repr(settings), "the signing key never shows in a repr or a log"
    rt = runtime.get()
    assert isinstance(rt.shared, SharedDirTier) and rt.shared.lease_s == 3 and rt.shared.signing_key == b"k" * 20
    assert [tier.name for tier in rt.chain.tiers] == ["image", "local", "shared"]


@pytest.mark.parametrize(("name", "value", "message"), [
    ("LAZYTRITON_SHARED", "ftp://x", "LAZYTRITON_SHARED must start with"),
    ("LAZYTRITON_SIGNING_KEY", "short", "LAZYTRITON_SIGNING_KEY: signing_key must be at least 16 bytes, got 5"),
    ("LAZYTRITON_SHARED_TIMEOUT_MS", "fast", "LAZYTRITON_SHARED_TIMEOUT_MS must be a number of milliseconds"),
    ("LAZYTRITON_SHARED_TIMEOUT_MS", "0", "got '0'"),
])
def test_bad_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str) -> None:
    monkeypatch.setenv(name, value)
    config.reset()
    with pytest.raises(ValueError, match=re.escape(message)):
        config.settings()


def test_configure_is_the_twin_of_the_variables(tmp_path: Path) -> None:
    settings = config.configure(shared="redis://127.0.0.1:6379/0", signing_key="s" * 16, shared_timeout_ms=20)
    assert (settings.shared, settings.signing_key, settings.shared_timeout_s) == (
        "redis://127.0.0.1:6379/0", b"s" * 16, 0.02)
    rt = runtime.get()
    assert isinstance(rt.shared, RedisTier) and rt.shared.timeout_s == 0.02
    assert rt.shared.calls == 0, "building the runtime sends nothing to Redis"
    settings = config.configure(shared="", signing_key="")
    assert settings.shared is None and settings.signing_key is None and runtime.get().shared is None
    with pytest.raises(ValueError, match="must start with"):
        config.configure(shared="nfs://x")
    with pytest.raises(ValueError, match="signing_key must be at least 16 bytes, got 3"):
        config.configure(signing_key=b"abc")
    with pytest.raises(ValueError, match="shared_timeout_ms must be in"):
        config.configure(shared_timeout_ms=-1)


def test_every_variable_is_documented_in_config_and_the_readme() -> None:
    documented = set(re.findall(r"``(LAZYTRITON_[A-Z_]+)``", config.__doc__ or ""))
    readme = (REPO / "README.md").read_text()
    for name in ("LAZYTRITON_SHARED", "LAZYTRITON_SIGNING_KEY", "LAZYTRITON_SHARED_TIMEOUT_MS",
                 "LAZYTRITON_CACHE_MAX_BYTES"):
        assert name in documented, f"{name} is missing from config.py's table"
        assert f"`{name}`" in readme, f"{name} is missing from the README's settings table"
