"""Options as users type them: sizes as strings, and one clear error per bad option."""

from __future__ import annotations

import pytest
from helpers import Synthetic

import lmdbcache
from lmdbcache import CachedDataset


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"map_size": -1}, "map_size must be a positive number of bytes"),
        ({"map_size": "lots"}, "map_size='lots' is not a size"),
        ({"map_size": 8192}, "map_size must be at least 1,048,576 bytes"),
        ({"commit_every": 0}, "commit_every must be an integer >= 1"),
        ({"commit_interval": 0}, "commit_interval must be a number of seconds > 0"),
        ({"commit_bytes": -5}, "commit_bytes must be a positive number"),
        ({"max_readers": 0}, "max_readers must be an integer >= 1"),
        ({"checksum": "never"}, "checksum must be 'once' or 'always'"),
        ({"spot_check": -1}, "spot_check must be an integer >= 0"),
        ({"fingerprint": ""}, "fingerprint must be a non-empty string"),
    ],
)
def test_bad_options_are_one_clear_error(cache_dir, options, match):
    """Each out-of-range option is an InvalidOptionError (a ValueError) naming it and its range; nothing is created."""
    with pytest.raises(lmdbcache.InvalidOptionError, match=match) as info:
        CachedDataset(Synthetic(4), cache_dir, **options)
    assert isinstance(info.value, ValueError)
    assert not cache_dir.exists()


def test_sizes_accept_what_users_type(cache_dir):
    """map_size takes '1GB' or '64MiB' as well as an int."""
    with CachedDataset(Synthetic(4), cache_dir, map_size="1GiB") as ds:
        ds[0]
        assert ds._live_store().env_info()["map_size"] >= 1 << 30


def test_commit_bytes_takes_a_size_string(cache_dir):
    """commit_bytes='1GiB' is accepted and works (it was validated but then compared as a string)."""
    with CachedDataset(Synthetic(4), cache_dir, commit_bytes="1GiB") as ds:
        assert ds[0][1] == 0
        assert ds.flush() == 1
