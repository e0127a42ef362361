"""Settings of the shared tier: LAZYTRITON_SHARED, LAZYTRITON_SIGNING_KEY, LAZYTRITON_SHARED_TIMEOUT_MS and their
configure() twins; errors name the variable and the value; the key never shows in a repr; every variable is
documented in config.py and the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lazytriton import config, runtime
from lazytriton.store.redis_tier import RedisTier
from lazytriton.store.shared import SharedURL, parse_url
from lazytriton.store.shared_dir import SharedDirTier

REPO = Path(__file__).resolve().parents[1]


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
])
def test_bad_shared_urls_are_refused_naming_the_value(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_url(url)


def test_the_environment_is_read_and_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
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
