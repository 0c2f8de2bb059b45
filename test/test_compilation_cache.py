"""The persistent compilation cache stays writable when it holds entries written without an
access time (by a process without the size limit, such as an older sgl-jax): JAX's eviction
reads every entry's access time before each write."""

import pytest

from sgl_jax.cache import COMPILATION_CACHE_BYTES, date_undated_entries

lru_cache = pytest.importorskip("jax._src.lru_cache")  # the cache JAX writes through


def test_an_undated_entry_no_longer_blocks_writes(tmp_path):
    (tmp_path / "old-program-cache").write_bytes(b"compiled long ago")
    cache = lru_cache.LRUCache(str(tmp_path), max_size=COMPILATION_CACHE_BYTES)
    with pytest.raises(FileNotFoundError):  # what every write met before
        cache.put("new-program", b"just compiled")
    date_undated_entries(tmp_path)
    cache.put("new-program", b"just compiled")
    assert cache.get("new-program") == b"just compiled"
    assert cache.get("old-program") == b"compiled long ago"


def test_undated_entries_are_evicted_first(tmp_path):
    (tmp_path / "old-program-cache").write_bytes(b"x" * 40)
    date_undated_entries(tmp_path)
    cache = lru_cache.LRUCache(str(tmp_path), max_size=100)
    cache.put("recent", b"y" * 40)
    cache.put("newest", b"z" * 40)  # over the limit: the oldest entry goes
    assert cache.get("old-program") is None
    assert cache.get("recent") == b"y" * 40 and cache.get("newest") == b"z" * 40


def test_a_missing_directory_is_left_to_jax(tmp_path):
    date_undated_entries(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


def test_an_entry_added_after_a_pass_is_dated_by_the_next(tmp_path):
    cache_dir = tmp_path / "xla"
    cache_dir.mkdir()
    date_undated_entries(cache_dir)  # empty: only the stamp is written
    (cache_dir / "later-cache").write_bytes(b"written without an access time")
    date_undated_entries(cache_dir)
    assert (cache_dir / "later-atime").is_file()
