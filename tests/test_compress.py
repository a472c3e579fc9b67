"""Compressed caches (``compress="lz4"|"zstd"``): the framed value form, its setting, tools, hostile frames."""

from __future__ import annotations

import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Compressible, assert_same, compressible_for, golden_samples, raw_cache, stored
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import samples, tensors
from test_cli import _flip_in_file, cli
from test_processes import run_script, wait_for_count

import lmdbcache
from lmdbcache import CachedDataset, CacheMismatchError, CorruptSampleError, InvalidOptionError, tools
from lmdbcache.codec import decode, encode
from lmdbcache.format._compress import Compressor
from lmdbcache.format._frames import FRAME, take

CODECS = ["lz4", "zstd"]
FRAMED = b"LMC\x03"
SPEC = "helpers:Compressible"
PAD = torch.arange(4096, dtype=torch.int64) % 5  # 32 KiB that every codec compresses


def framed(sample, codec: str, index: int = 7) -> bytes:
    value = Compressor(codec, 0 if codec == "lz4" else 3)(encode(sample, index))
    assert value[:4] == FRAMED
    return value


def check_cache(path, n: int) -> None:
    ds = CachedDataset.open(path)
    assert ds.cached_count == n
    for i in range(n):
        assert_same(ds[i], compressible_for(i))
    ds.close()


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=100, deadline=None)
@given(sample=samples)
def test_compressed_values_round_trip_every_sample_type(codec, sample):
    """Any supported sample (the msgpack form) comes back equal and of the same types from a compressed value."""
    value = framed({"sample": sample, "pad": PAD}, codec)
    assert_same(decode(value, 7), {"sample": sample, "pad": PAD})


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=50, deadline=None)
@given(t=tensors())
def test_compressed_flat_values_round_trip(codec, t):
    """A flat tuple with a compressed buffer: tensors come back with dtype, shape and bits, scalars in place."""
    out = decode(framed((t, 3, PAD, 1.5), codec), 7)
    assert_same(out, (t.contiguous(), 3, PAD, 1.5))
    out[2][0] = 9  # writable, and its own memory
    assert out[2][0] == 9


@pytest.mark.parametrize("codec", CODECS)
def test_buffers_that_do_not_pay_are_stored_raw(codec):
    """Random bytes do not compress: the value is stored exactly as encoded (the flat fast path keeps it)."""
    noise = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 3 * 64 * 64, dtype=np.uint8))
    value = encode((noise, 1), 7)
    assert Compressor(codec, 0 if codec == "lz4" else 3)(value) == value
    small = encode((torch.zeros(100), 1), 7)  # under the 4 KiB threshold
    assert Compressor(codec, 0 if codec == "lz4" else 3)(small) == small


@pytest.mark.parametrize("codec", CODECS)
def test_dataset_stores_its_setting_and_later_opens_use_it(cache_dir, codec):
    """compress= is stored in the metadata: a reopen without it compresses alike; another setting is refused."""
    ds = CachedDataset(Compressible(20), cache_dir, compress=codec)
    for i in range(10):
        assert_same(ds[i], compressible_for(i))
    ds.close()
    ds = CachedDataset(Compressible(20), cache_dir)  # None: the cache's own setting
    for i in range(20):
        assert_same(ds[i], compressible_for(i))
    ds.close()
    with raw_cache(cache_dir, write=False) as (txn, samples, _):
        assert all(stored(txn, samples, i)[:4] == FRAMED for i in range(20))
    assert tools.info(cache_dir).compress == f"{codec}:{0 if codec == 'lz4' else 3}"
    other = "zstd" if codec == "lz4" else "lz4"
    with pytest.raises(CacheMismatchError, match=f"built with compress='{codec}'.*overwrite=True"):
        CachedDataset(Compressible(20), cache_dir, compress=other)
    ds = CachedDataset(Compressible(20), cache_dir, compress=other, overwrite=True)
    assert ds.cached_count == 0 and tools.info(cache_dir).compress.startswith(other)
    ds.close()


def test_compressed_cache_reads_through_the_loader(cache_dir):
    """The loader's batches from a compressed cache equal those from an uncompressed one."""
    n = 40
    plain = CachedDataset(Compressible(n), cache_dir / "plain")
    packed = CachedDataset(Compressible(n), cache_dir / "zstd", compress="zstd")
    for a, b in zip(plain.loader(batch_size=8), packed.loader(batch_size=8)):
        assert_same(a, b)
    for a, b in zip(plain.loader(batch_size=8), packed.loader(batch_size=8)):  # now all hits
        assert_same(a, b)
    plain.close()
    packed.close()


def test_bad_compression_options_are_refused(cache_dir):
    """An unknown codec or a level out of range is InvalidOptionError before anything is created."""
    for kwargs in ({"compress": "gzip"}, {"compress": "zstd", "compress_level": 99}, {"compress_level": 3}):
        with pytest.raises(InvalidOptionError):
            CachedDataset(Compressible(4), cache_dir, **kwargs)
    assert not (cache_dir / "data.mdb").exists()
    result = cli("precompute", SPEC, str(cache_dir), "--compress", "zstd:x", check=2)
    assert "zstd:x" in result.stderr


def test_format_3_metadata_with_a_hostile_compress_field_is_refused(cache_dir):
    """A metadata record whose compress fields are not a codec and a level is CorruptCacheError, not a crash."""
    import msgpack

    CachedDataset(Compressible(4), cache_dir).close()
    for codec, level in (("brotli", 1), ("zstd", 10**9), (["zstd"], 1), ("lz4", "3")):
        with raw_cache(cache_dir) as (txn, _, meta_db):
            meta = msgpack.unpackb(txn.get(b"meta", db=meta_db))
            meta["compress"], meta["compress_level"] = codec, level
            txn.put(b"meta", msgpack.packb(meta), db=meta_db)
        lmdbcache.store._registry._stores.clear()
        with pytest.raises(lmdbcache.CorruptCacheError, match="compress"):
            CachedDataset.open(cache_dir)


def test_sigkilled_compressed_fill_keeps_every_committed_sample(cache_dir):
    """A process filling a zstd cache, SIGKILLed mid-fill: committed samples are intact; a reopen refills the rest."""
    n = 1000
    script = """
        import sys
        from helpers import Compressible
        from lmdbcache import CachedDataset
        ds = CachedDataset(Compressible(int(sys.argv[2]), delay=0.001), sys.argv[1], compress="zstd", commit_every=10)
        for i in range(len(ds)):
            ds[i]
    """
    with run_script(script, str(cache_dir), str(n), wait=False) as proc:
        wait_for_count(cache_dir, 100)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    ds = CachedDataset(Compressible(n), cache_dir)
    assert 100 <= ds.cached_count < n
    for i in range(n):
        assert_same(ds[i], compressible_for(i))
    ds.close()
    check_cache(cache_dir, n)
    result = tools.verify(cache_dir)
    assert result.intact and result.checked == n


def test_verify_detects_a_damaged_compressed_record_and_repair_refills(cache_dir):
    """A bit flipped inside a compressed frame: verify names the index, --repair deletes it, precompute refills it."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=30", "--compress", "zstd", "--quiet", "--workers", "0")
    value = framed(compressible_for(17), "zstd", 17)
    frame_at = 24 + struct.unpack_from("<I", value, 4)[0] + FRAME.size
    _flip_in_file(cache_dir / "data.mdb", value[frame_at + 8 : frame_at + 40])
    assert "1 damaged: 17." in cli("verify", str(cache_dir), "--quiet", check=1).stdout
    ds = CachedDataset.open(cache_dir)
    with pytest.raises(CorruptSampleError, match="index 17 is damaged"):
        ds[17]
    ds.close()
    lmdbcache.store._registry._stores.clear()
    assert "deleted 1 damaged (17)" in cli("verify", str(cache_dir), "--repair", "--quiet").stdout
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=30", "--quiet", "--workers", "0")
    check_cache(cache_dir, 30)
    assert "compress     zstd:3" in cli("info", str(cache_dir)).stdout


def test_merge_and_copy_keep_the_compression_setting(tmp_path):
    """merge builds its destination with the shards' setting and copies values as they are; so does copy."""
    n = 24
    for shard in range(2):
        precompute(Compressible(n), tmp_path / f"s{shard}", shard=(shard, 2), num_workers=0, compress="lz4", pack=0)
    tools.merge(tmp_path / "merged", [tmp_path / "s0", tmp_path / "s1"])
    tools.copy_cache(tmp_path / "merged", tmp_path / "copy")
    for path in ("merged", "copy"):
        assert tools.info(tmp_path / path).compress == "lz4:0"
        check_cache(tmp_path / path, n)
        with raw_cache(tmp_path / path, write=False) as (txn, samples, _):
            assert all(stored(txn, samples, i)[:4] == FRAMED for i in range(n))
    precompute(Compressible(n), tmp_path / "plain", shard=(0, 2), num_workers=0)
    with pytest.raises(CacheMismatchError, match="compress"):
        tools.merge(tmp_path / "mixed", [tmp_path / "s0", tmp_path / "plain"])


def precompute(dataset, path, **kwargs):
    return lmdbcache.precompute(dataset, path, progress=False, check_determinism=0, **kwargs)


@pytest.mark.parametrize(("codec", "module"), [("zstd", "zstandard"), ("lz4", "lz4")])
def test_missing_extra_is_a_clear_error(cache_dir, codec, module):
    """Creating or reading a compressed cache without its module fails naming the extra to install."""
    CachedDataset(Compressible(4), cache_dir / "made", compress=codec).close()
    script = f"""
        import sys
        sys.modules["{module}"] = None  # as if not installed
        sys.modules["{module}.block"] = None
        from helpers import Compressible
        from lmdbcache import CachedDataset, MissingExtraError
        for make in (lambda: CachedDataset(Compressible(4), sys.argv[1] + "/new", compress="{codec}"),
                     lambda: CachedDataset.open(sys.argv[1] + "/made")):
            try:
                make()
            except MissingExtraError as exc:
                assert isinstance(exc, ImportError)
                print(exc)
            else:
                raise AssertionError("no error")
    """
    out = run_script(script, str(cache_dir)).stdout.splitlines()
    assert len(out) == 2 and all(f"pip install 'lmdbcache[{codec}]'" in line for line in out), out
    assert "made' is compressed with" in out[1]


# ------------------------------------------------------------------------- hostile frames


def _frames(value: bytes) -> tuple[int, int, int]:
    """(where the first frame starts, its kind, its stored length)."""
    at = 24 + struct.unpack_from("<I", value, 4)[0]
    return (at, *FRAME.unpack_from(value, at))


def _with_frame(value: bytes, kind: int, payload: bytes) -> bytes:
    at, _, stored = _frames(value)
    return value[:at] + FRAME.pack(kind, len(payload)) + payload + value[at + FRAME.size + stored :]


@pytest.mark.parametrize("codec", CODECS)
def test_hostile_frames_are_corrupt_sample_errors(codec):
    """Garbage streams, wrong claimed sizes, unknown kinds, truncation: CorruptSampleError, no big allocation."""
    sample = (PAD.clone(), 1)
    value = framed(sample, codec)
    at, kind, stored = _frames(value)
    payload = value[at + FRAME.size : at + FRAME.size + stored]
    other = framed((torch.arange(8192, dtype=torch.int64) % 3, 1), codec)  # a valid frame of another size
    o_at, _, o_stored = _frames(other)
    hostile = {
        "garbage": _with_frame(value, kind, bytes(range(256)) * 8),
        "flipped": _with_frame(value, kind, payload[:10] + bytes([payload[10] ^ 0xFF]) + payload[11:]),
        "truncated stream": _with_frame(value, kind, payload[: len(payload) // 2]),
        "another size": _with_frame(value, kind, other[o_at + FRAME.size : o_at + FRAME.size + o_stored]),
        "raw of the wrong size": _with_frame(value, 0, b"\0" * 100),
        "unknown kind": _with_frame(value, 9, payload),
        "bomb": _with_frame(value, kind, b"\0" * 4),  # 4 bytes claiming 32 KiB: past any codec's ratio
        "cut": value[: at + 3],
        "runs past the end": value[:at] + FRAME.pack(kind, 10**6) + payload,
        "trailing bytes": value + b"\0",
    }
    for name, bad in hostile.items():
        for verify in (True, False):
            with pytest.raises(CorruptSampleError):
                decode(bad, 7, verify_data=verify)
                pytest.fail(f"{name} decoded (verify_data={verify})")
    big = FRAME.pack(kind, 64) + b"\0" * 64  # a 64-byte frame for a record that claims 2**40 bytes
    with pytest.raises(CorruptSampleError, match="claims a buffer"):
        take(memoryview(big), 0, 1 << 40)
    assert decode(value, 7)[1] == 1


def test_decompression_is_bounded_by_the_record_size():
    """Every stream decompresses into exactly the buffer the record sizes; a frame claiming more is refused."""
    import zstandard

    payload = zstandard.ZstdCompressor().compress(b"\0" * 100_000)
    frame = memoryview(FRAME.pack(2, len(payload)) + payload)
    assert len(take(frame, 0, 100_000)[0]) == 100_000
    for nbytes in (99_999, 100_001):
        with pytest.raises(CorruptSampleError):
            take(frame, 0, nbytes)


def test_cli_precompute_compress_option(cache_dir):
    """`lmdbcache precompute --compress zstd:5` builds a zstd cache at level 5; a bad codec is one clear line."""
    cli("precompute", SPEC, str(cache_dir), "--arg", "n=8", "--compress", "zstd:5", "--quiet", "--workers", "0")
    assert tools.info(cache_dir).compress == "zstd:5"
    check_cache(cache_dir, 8)
    result = cli("precompute", SPEC, str(cache_dir), "--compress", "gzip", check=2)
    assert "argument --compress: 'gzip' is not lz4 or zstd" in result.stderr and "Traceback" not in result.stderr


def test_golden_compressed_cache_still_reads(tmp_path):
    """tests/data/golden-v3-zstd (written by format 3 with compress="zstd") decodes to exactly its samples."""
    copy = tmp_path / "golden"
    copy.mkdir()
    shutil.copy(Path(__file__).parent / "data" / "golden-v3-zstd" / "data.mdb", copy / "data.mdb")
    expected = golden_samples("3-zstd")
    with raw_cache(copy, write=False) as (txn, samples, _):
        versions = [stored(txn, samples, i)[3] for i in range(len(expected))]
    assert versions[-2:] == [3, 3] and set(versions[:-2]) == {2}  # only the last two pay to compress
    ds = CachedDataset.open(copy)
    assert tools.info(copy).compress == "zstd:3" and len(ds) == len(expected) and ds.is_complete
    for i, sample in enumerate(expected):
        assert_same(ds[i], sample)
    ds.close()


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_damaged_compressed_values_never_decode_wrong(codec, data):
    """Bytes of a framed value overwritten or cut at random: CorruptSampleError, or (bytes unused) the same sample."""
    sample = {"pad": PAD, "t": (torch.arange(3000, dtype=torch.int16) % 11, 2)}
    value = bytearray(framed(sample, codec))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(value) - 1))
        value[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del value[data.draw(st.integers(0, len(value) - 1)) :]
    try:
        out = decode(bytes(value), 7)
    except CorruptSampleError:
        return
    assert_same(out, sample)


@pytest.mark.parametrize("codec", CODECS)
def test_buffers_the_codec_cannot_take_are_stored_raw(codec, monkeypatch):
    """A buffer over lz4's input limit (~2.1 GB; lowered here) or one the codec refuses is stored raw, never a
    raw OverflowError (found by the attack: a 2.15 GB tensor with compress='lz4')."""
    import lmdbcache.format._compress as compress_module

    compressible = (torch.zeros(4096), 1)  # 16 KiB of zeros: pays with either codec
    value = encode(compressible, 7)
    assert Compressor(codec, 0 if codec == "lz4" else 3)(value) != value
    monkeypatch.setattr(compress_module, "_MAX_INPUT", 8192)
    assert Compressor(codec, 0 if codec == "lz4" else 3)(value) == value
    monkeypatch.undo()
    refusing = Compressor(codec, 0 if codec == "lz4" else 3)

    def refuse(data):
        raise OverflowError("Input too large for LZ4 API")

    monkeypatch.setattr(refusing, "_compress", lambda: refuse)
    assert refusing(value) == value
