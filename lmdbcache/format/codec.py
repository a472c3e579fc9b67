"""Turn one sample into bytes and back, exactly, with one copy out of the memory map.

The value format, version 2 (and 3)
===================================

One LMDB value holds one sample and is bound to the index it is stored under. All
integers are little-endian::

    offset  size  field
    0       3     magic b"LMC"
    3       1     version: 2; 3 for a value whose buffers are framed (see "Compressed values"
                  below); 1 is still read, see "Format 1"
    4       4     S, the length of the structure (u32, at least 1)
    8       8     structure checksum: xxh3_64 of the structure, seed = the index
    16      8     data checksum: xxh3_64 chained over the buffers in order, each hashed
                  with the previous hash as its seed and the first with seed = the index
                  (so it is the index itself when there are no buffers)
    24      S     structure: a flat structure or one msgpack object (below)
    24+S    ...   buffers: the raw bytes of every tensor, array and image in the sample,
                  concatenated in the order their records appear in the structure (depth
                  first, left to right), unpadded. The value ends exactly where the last
                  buffer ends.

The index (0 <= index < 2**64; any other raises ``InvalidOptionError``) seeds both
checksums, so a value read under any other key fails its structure checksum: a flipped bit
in a key never serves another index's sample.
``decode`` verifies the structure checksum on every call, before parsing anything, and the
data checksum over the copies it makes unless the caller passes ``verify_data=False`` (a
value it has verified before). Every count, length, dtype and mode read from a value is
checked against the value before it sizes an allocation; whatever is wrong raises
``CorruptSampleError``, never another exception and never a damaged sample. Nothing read
from a value is ever unpickled or handed to msgpack-numpy.

The structure
-------------
msgpack's own nil, bool, int (-2**63 .. 2**64-1), float (written as double), str (UTF-8,
lone surrogates passed through), bin (bytes), array (decoded as ``tuple``: samples are
usually tuples, so the common case needs no record) and map (decoded as ``dict``; keys are
str, int, the other scalars here, or tuples of them). Everything else is an ext record::

    code  type                 ext payload
    1     list                 empty: a marker, the first element of a msgpack array whose
                               other elements are the list's items
    2     torch.Tensor         <B dtype code><B ndim><Q nbytes> then ndim x <q dim>
    3     numpy.ndarray        <B ndim><Q nbytes> then ndim x <q dim>, then the dtype string
                               (below) in ASCII
    4     numpy scalar         as 3 with ndim 0; decoded as ``array[()]``
    6     PIL.Image.Image      msgpack [mode, width, height, nbytes, palette mode or nil,
                               palette bytes or nil]; the pixels (``Image.tobytes()``) in a buffer
    8     structured numpy     msgpack [shape, nbytes, dtype description (below), is scalar];
          array or np.void     the array's bytes, padding bytes included, in a buffer
    9     int beyond 64 bits   two's complement, little-endian, in the fewest bytes that hold
                               the number and its sign

A list is a marker rather than (as in format 1) a record holding its packed items, so that
nested lists decode in one msgpack call: format 1 unpacked each level in a call of its own,
~40 KiB of C stack apiece. Codes 5 and 7 belong to format 1 and are corrupt in a format-2
value. A tensor, array or structured record owns the next ``nbytes`` of the buffers, and
``nbytes`` must equal the product of its shape times its itemsize. Tensor dtype codes are
positions in ``TORCH_DTYPES`` (append-only); dtypes numpy lacks (bfloat16, float8, ...)
travel as an unsigned integer of the same width.

A dtype string is the ``dtype.str`` of a plain fixed-size numpy dtype, and only these are
read (``_dtypes.PLAIN_DTYPE``): an optional byte order ``<``, ``>``, ``|`` or ``=``, then ``b1``,
``i`` or ``u`` with 1, 2, 4 or 8, ``f`` with 2, 4, 8 or 16, ``c`` with 8, 16 or 32, ``S``,
``U`` or ``V`` with a size, or ``M8`` / ``m8`` with an optional ``[<count><unit>]``. Object
arrays, numpy's StringDType, dtypes with metadata and any other dtype are refused when
writing (``UnsupportedSampleError``) and corrupt when reading.

A dtype description (code 8) is a dtype string, a map for a structured dtype::

    {"names": [str], "formats": [description], "offsets": [int], "titles": [str or nil] or nil,
     "itemsize": int, "aligned": bool}

or a map ``{"base": description, "shape": [int]}`` for a subarray field. It is rebuilt
with ``np.dtype({names, formats, offsets, titles, itemsize}, align=aligned)`` from checked
pieces, so offsets, padding, titles, nested structures, subarrays and ``isalignedstruct``
come back as written. A structured dtype that this does not rebuild exactly (a
``np.record`` dtype, for one) is refused when writing.

The flat form. A sample that is a tuple of 1 to 255 items, each a tensor, an int that fits
in int64, a float or a bool (``(image, label)``, ``(features, target, weight)``), has a
structure in a second form, told apart by its first byte 0xC1 (a byte msgpack never
uses)::

    0xC1, <H signature length L>, signature (L bytes), scalars

    signature: per item, b"T" + the tensor's ext payload (as code 2), or a struct code
               b"q" (int64), b"d" (float64), b"?" (bool)
    scalars:   the scalar items, packed as struct "<" + their codes, in order

A tuple whose signature would pass 65535 bytes is written in the msgpack form; a flat
structure with no items, more than 255, or lengths that do not add up to S and to the
value's length is corrupt. Decoding the
flat form costs one cached lookup of the signature and one struct unpack, with no msgpack
call or ext hook: for small samples that is most of the per-sample overhead.

Limits. Writing beyond one raises ``UnsupportedSampleError`` naming where in the sample;
reading a value beyond one raises ``CorruptSampleError``:

- a value is at most 2**32 - 1 bytes (LMDB's largest value);
- containers (tuples, lists, dicts, tuple keys) nest at most 200 deep;
- tensors and arrays have at most 64 dimensions, none negative, and the product of the
  nonzero dimensions times the itemsize (1 if 0) is below 2**63 (numpy's own limit);
- an array of a zero-byte dtype (``V0``, a structured dtype without fields) holds at most
  2**20 elements;
- a structured dtype nests at most 32 deep;
- PIL images have one of the modes in ``_format.PIL_BITS``, sides below 2**31, a palette of mode
  RGB or RGBA of at most 1024 bytes (kept for modes P and PA only), and an image without
  pixels is at most 65535 on either side.

Arrays are stored C-contiguous: a non-contiguous tensor or array comes back contiguous
with the same shape and values; 0-d and empty arrays are ordinary cases (ndim 0, nbytes
0). A ``numpy.memmap`` comes back as a plain ``numpy.ndarray``; a PIL image of a subclass
(``PngImageFile``, ``JpegImageFile``, ...) comes back as a plain ``PIL.Image.Image`` with
its mode, size, pixels and palette (not its ``info`` or file); every other type comes back
as exactly the type that went in. Decoded tensors and arrays are writable and own their
memory: each buffer is copied once out of the value (``bytearray``) and nothing else is
copied.

Compressed values
-----------------
Format 3 (``FORMAT_VERSION``) writes uncompressed values exactly as format 2 did (version
byte 2). A cache created with ``compress="lz4"`` or ``"zstd"`` (the metadata's ``compress``
field, see ``_metadata``) stores a value in the framed form when compressing pays: the same
header with version byte 3, the same structure and the same checksums (the data checksum is
over the buffers' raw bytes, so a damaged frame fails it once decompressed), and then, in
place of the buffers, one frame per buffer in the same order::

    <B kind><I stored length> stored bytes
    kind 0: the buffer's raw bytes (stored length = the record's nbytes)
    kind 1: an LZ4 block (no size prefix) of the buffer
    kind 2: one zstd frame of the buffer, with its content size in the frame header

The value ends exactly where the last frame ends. The writer (``_compress``) compresses a
buffer of at least 4096 bytes and keeps the result only under 0.95 of its size and within
the kind's largest ratio (255 for LZ4, 2**15 for zstd); a value none of whose buffers is
compressed is stored in the version-2 form, which keeps the flat fast path. The reader
takes each buffer's size from its record (checked against its shape and dtype as above),
refuses a frame that would expand beyond the kind's ratio before allocating, decompresses
into a buffer of exactly that size (a zstd frame must declare that content size) and
checks the length it got. Any mismatch, an unknown kind or a stream the codec rejects is
``CorruptSampleError``; a value of kind 1 or 2 read without ``lz4`` or ``zstandard``
installed raises ``MissingExtraError`` naming the extra (``pip install 'lmdbcache[zstd]'``).

Format 1
--------
Written by lmdbcache 0.1.0, and still read: the same header with version byte 1, and both
checksums seeded with 0 instead of the index (such a value is not bound to its key and
decodes under any index). Its records are those of format 2 except::

    code  type                 ext payload
    1     list                 a msgpack array of the items (read at most 32 lists deep:
                               each level costs msgpack ~40 KiB of C stack)
    5     int beyond 64 bits   its decimal digits in ASCII (read up to 4300 digits)
    7     structured ndarray   msgpack [is scalar, bin: msgpack-numpy's map of the array]

A code-7 map is parsed here, never by msgpack-numpy: exactly the keys b"nd" (true),
b"kind" (b"V"), b"type" (the ``dtype.descr`` list: [name, format] or [name, format,
shape], each format a dtype string or a nested list), b"shape" and b"data" (the bytes,
exactly shape x itemsize). It decodes to what 0.1.0 returned: ``np.dtype(descr)``, so
padding comes back as extra fields and titled fields cannot be read. Any other kind (b"O"
carries a pickle) is corrupt. Codes 8 and 9 are corrupt in a format-1 value.

Why not msgpack-numpy's own array encoding: it stores array bytes inside msgpack ``bin``
objects, which unpack into immutable ``bytes`` (one copy) that must be copied again to be
writable; that costs about a third of the throughput on image-sized samples. And its
reader unpickles object arrays, which a cache file must never make us do.
"""

from __future__ import annotations

# Where the format is written (_encode), read (_decode, _records), and what both share
# (_format, _dtypes). decode and encode are bound here as they are, with no layer around
# them: decode runs once per sample read and is measured in microseconds.
from ._decode import decode
from ._encode import encode
from ._format import TORCH_DTYPES

__all__ = ["TORCH_DTYPES", "decode", "encode"]
