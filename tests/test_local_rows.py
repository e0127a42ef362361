"""Any row planted in the local tier's index is an entry, a miss or damage: never an exception, never a decode.

A property test (hypothesis) of the local tier's row reader, the decoder of
the untrusted bytes in its directory (issue 13, finding 1).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from test_local_trust import KEY, Payload, fake_entry

from lazytriton.store.local import LocalTier

# --- any row: an entry, a miss or damage, never an exception or a decode --------------------------------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
SQL_VALUES = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=80),
                       st.binary(max_size=300))
ROWS = st.lists(st.tuples(st.one_of(st.just(KEY), st.just("f" * 32), SQL_VALUES),  # key
                          st.one_of(st.sampled_from([0, 1]), SQL_VALUES),  # raw
                          st.one_of(st.integers(0, 5), SQL_VALUES),  # mode
                          st.one_of(st.none(), st.just("ab/cd/" + "0" * 28 + ".val"), st.text(max_size=40)),  # filename
                          SQL_VALUES),  # value
                min_size=1, max_size=6)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(rows=ROWS)
def test_any_row_is_an_entry_a_miss_or_damage(rows: list[tuple[Any, ...]]) -> None:
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        entries = Path(directory) / "entries"
        marker = Path(directory) / "pwned"
        tier = LocalTier(entries)
        assert tier.put("e" * 32, fake_entry("e" * 32))
        tier.close()
        (entries / "ab" / "cd").mkdir(parents=True)
        (entries / "ab" / "cd" / ("0" * 28 + ".val")).write_bytes(pickle.dumps(Payload(marker)))
        with sqlite3.connect(entries / "cache.db") as con:
            for key, raw, mode, filename, value in rows:
                con.execute("INSERT OR IGNORE INTO Cache (key, raw, store_time, access_time, mode, filename, value) "
                            "VALUES (?, ?, 0, 0, ?, ?, ?)", (key, raw, mode, filename, value))
            con.execute("INSERT OR IGNORE INTO Cache (key, raw, mode, value) VALUES (?, 0, 4, ?)",
                        (pickle.dumps(Payload(marker)), pickle.dumps(Payload(marker))))
        tier = LocalTier(entries)
        for key in (KEY, "f" * 32):
            assert tier.get(key) is None or tier.get(key) == fake_entry(key)
            assert tier.peek(key) is None or isinstance(tier.peek(key), bytes)
        assert tier.get("e" * 32) == fake_entry("e" * 32)
        assert all(isinstance(key, str) for key in tier.keys())
        assert all(row.data is None or isinstance(row.data, bytes) for row in tier.scan())
        tier.drop_damaged()
        assert all(row.problem == "" for row in tier.scan())
        assert tier.get("e" * 32) == fake_entry("e" * 32)
        tier.close()
        assert not marker.exists()
