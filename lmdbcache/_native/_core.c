/* lmdbcache._native._core: the compiled core of lmdbcache's read path (issue #24).
 *
 * Plain C11 against the CPython C API and the buffer protocol; no third-party source.
 * Everything read from a cache file is untrusted: every offset and length is checked
 * against the mapped length before the byte it names is read, and failures come back
 * as error codes that lmdbcache/_native turns into the library's exceptions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#define HAVE_ADVICE 1
#endif

/* ------------------------------------------------------------------------------------------
 * XXH3-64, written from the published specification (xxHash's doc/xxhash_spec.md, "XXH3
 * algorithm"): the codec's structure and data checksums (``xxhash.xxh3_64_intdigest``).
 * Checked against the xxhash package on every length 0..2000 and larger ones (tests/test_native_core.py).
 */

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define SECRET_SIZE 192
#define STRIPE 64
#define MIDSIZE_MAX 240

/* The specification's default secret ("kSecret"). */
static _Alignas(64) const uint8_t K_SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Little-endian loads that are correct on any byte order and alignment (memcpy compiles to one load). */
static inline uint32_t le32(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#else
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
#endif
}

static inline uint64_t le64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
#endif
}

static inline void put_le64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 8); /* one store (the byte loop below is 8) */
#else
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
#endif
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint32_t swap32(uint32_t x) {
    return (x << 24) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) | (x >> 24);
}

static inline uint64_t swap64(uint64_t x) { return (uint64_t)swap32((uint32_t)x) << 32 | swap32((uint32_t)(x >> 32)); }

/* The 128-bit product of two u64, its halves xored ("fold"). */
static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    uint64_t hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    uint64_t lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    uint64_t hi_hi = (a >> 32) * (b >> 32);
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX_1;
    return h ^ (h >> 32);
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + len;
    h *= PMX_2;
    return h ^ (h >> 28);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec, uint64_t seed) {
    return mul128_fold64(le64(in) ^ (le64(sec) + seed), le64(in + 8) ^ (le64(sec + 8) - seed));
}

/* Inputs of 0 to 16 bytes: four cases, each keyed by a different part of the secret. */
static uint64_t xxh3_0to16(const uint8_t *in, size_t len, const uint8_t *sec, uint64_t seed) {
    if (len > 8) {
        uint64_t lo = le64(in) ^ ((le64(sec + 24) ^ le64(sec + 32)) + seed);
        uint64_t hi = le64(in + len - 8) ^ ((le64(sec + 40) ^ le64(sec + 48)) - seed);
        return xxh3_avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
    }
    if (len >= 4) {
        seed ^= (uint64_t)swap32((uint32_t)seed) << 32;
        uint64_t joined = le32(in + len - 4) + ((uint64_t)le32(in) << 32);
        return rrmxmx(joined ^ ((le64(sec + 8) ^ le64(sec + 16)) - seed), len);
    }
    if (len > 0) {
        uint32_t combined = (uint32_t)in[0] << 16 | (uint32_t)in[len >> 1] << 24 | (uint32_t)in[len - 1] |
                            (uint32_t)len << 8;
        return xxh64_avalanche((uint64_t)combined ^ ((uint64_t)(le32(sec) ^ le32(sec + 4)) + seed));
    }
    return xxh64_avalanche(seed ^ le64(sec + 56) ^ le64(sec + 64));
}

/* 17 to 128 bytes: pairs of 16-byte blocks from both ends, working inwards. */
static uint64_t xxh3_17to128(const uint8_t *in, size_t len, const uint8_t *sec, uint64_t seed) {
    uint64_t acc = len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, sec + 96, seed);
                acc += mix16(in + len - 64, sec + 112, seed);
            }
            acc += mix16(in + 32, sec + 64, seed);
            acc += mix16(in + len - 48, sec + 80, seed);
        }
        acc += mix16(in + 16, sec + 32, seed);
        acc += mix16(in + len - 32, sec + 48, seed);
    }
    acc += mix16(in, sec, seed);
    acc += mix16(in + len - 16, sec + 16, seed);
    return xxh3_avalanche(acc);
}

/* 129 to 240 bytes: eight blocks, an avalanche, the rest at a 3-byte secret offset, then the last 16 bytes. */
static uint64_t xxh3_129to240(const uint8_t *in, size_t len, const uint8_t *sec, uint64_t seed) {
    uint64_t acc = len * P64_1;
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, sec + 16 * i, seed);
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < rounds; i++) acc += mix16(in + 16 * i, sec + 16 * (i - 8) + 3, seed);
    acc += mix16(in + len - 16, sec + 136 - 17, seed);
    return xxh3_avalanche(acc);
}

/* One 64-byte stripe into the eight accumulators: lane i gains the product of the low and high halves of
 * (input ^ secret) lane i, and the input of lane i ^ 1. With SSE2 (every x86-64), two lanes per instruction:
 * a whole first read of a 150 KB sample is hashed about twice as fast as the scalar loop below. */
#if defined(__SSE2__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#include <emmintrin.h>
static inline void accumulate128(uint64_t *acc, __m128i d, const uint8_t *sec) {
    __m128i k = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(const void *)sec));
    __m128i hi = _mm_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)); /* each lane's high half, low */
    __m128i sum = _mm_add_epi64(_mm_mul_epu32(k, hi), _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2)));
    __m128i *a = (__m128i *)(void *)acc;
    _mm_storeu_si128(a, _mm_add_epi64(_mm_loadu_si128(a), sum));
}

static inline void accumulate512(uint64_t *acc, const uint8_t *in, const uint8_t *sec) {
    for (int i = 0; i < 4; i++)
        accumulate128(acc + 2 * i, _mm_loadu_si128((const __m128i *)(const void *)(in + 16 * i)), sec + 16 * i);
}

/* accumulate512 of the stripe at src, stored to dst from the same registers: the hash of what was stored. */
static inline void accumulate512_copy(uint64_t *acc, uint8_t *dst, const uint8_t *src, const uint8_t *sec) {
    for (int i = 0; i < 4; i++) {
        __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 16 * i));
        _mm_storeu_si128((__m128i *)(void *)(dst + 16 * i), d);
        accumulate128(acc + 2 * i, d, sec + 16 * i);
    }
}
#else
static inline void accumulate512(uint64_t *acc, const uint8_t *in, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = le64(in + 8 * i);
        uint64_t k = v ^ le64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

static inline void accumulate512_copy(uint64_t *acc, uint8_t *dst, const uint8_t *src, const uint8_t *sec) {
    memcpy(dst, src, STRIPE);
    accumulate512(acc, dst, sec); /* from the copy, still in L1 */
}
#endif

/* How far ahead of a one-pass copy and hash (xxh3_long_copy) its source is prefetched: the map's pages are
 * scattered in physical memory, and the hardware prefetchers stop at each 4 KiB page's end. The copy first
 * prefetches its source's first `ahead` bytes (a value shorter than that is prefetched whole), then each
 * stripe prefetches the one `ahead` bytes on, while that is still the source's: past its end lies another
 * value's memory, which the copy would pull in for nothing. Measured (python -m bench.hash_copy [--shuffled],
 * beside builds with LMDBCACHE_CFLAGS=-DCOPY_AHEAD=N), as the copy's time against glibc's memcpy of the same
 * bytes: 150 KB samples on a Xeon, 512 to 2048 bytes ahead 0.71-0.78x (1024 best), no prefetch 0.89-0.92x; on
 * an AMD EPYC (Zen), 1024 ahead 1.24-1.39x, 4096 0.87-0.97x, 6144-8192 0.81x, and with the first window
 * 0.83x shuffled (1.18x for 1024 without it); 3 KB samples read at random from a 3 GB map 0.99x with the
 * window, 1.07-1.15x without. So the distance is chosen at import (PyInit__core): 6144 on AMD, 1024 elsewhere,
 * or COPY_AHEAD when a build sets it. */
#ifndef COPY_AHEAD
#define COPY_AHEAD 0
#endif
static size_t copy_ahead = 1024;

static inline void scramble(uint64_t *acc, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= le64(sec + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* The accumulators merged into the 64-bit result (the spec's merge starts 11 bytes into the secret). */
static uint64_t merge_acc(const uint64_t *acc, size_t len, const uint8_t *sec) {
    uint64_t result = len * P64_1;
    for (int i = 0; i < 4; i++) {
        const uint8_t *k = sec + 11 + 16 * i;
        result += mul128_fold64(acc[2 * i] ^ le64(k), acc[2 * i + 1] ^ le64(k + 8));
    }
    return xxh3_avalanche(result);
}

/* Over 240 bytes: blocks of 16 stripes (the secret advancing 8 bytes a stripe), a scramble after each block,
 * the remaining whole stripes, the input's last 64 bytes, then the accumulators merged. */
static uint64_t xxh3_long(const uint8_t *in, size_t len, const uint8_t *sec) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    const size_t stripes_per_block = (SECRET_SIZE - STRIPE) / 8;
    const size_t block = STRIPE * stripes_per_block;
    size_t blocks = (len - 1) / block;
    for (size_t n = 0; n < blocks; n++) {
        for (size_t s = 0; s < stripes_per_block; s++) accumulate512(acc, in + n * block + s * STRIPE, sec + s * 8);
        scramble(acc, sec + SECRET_SIZE - STRIPE);
    }
    size_t stripes = ((len - 1) - block * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++) accumulate512(acc, in + blocks * block + s * STRIPE, sec + s * 8);
    accumulate512(acc, in + len - STRIPE, sec + SECRET_SIZE - STRIPE - 7);
    return merge_acc(acc, len, sec);
}

/* The same long hash of ``len`` bytes at ``src``, copied to ``dst`` on the way: each stripe is loaded once,
 * stored to dst and hashed from the same registers (accumulate512_copy), so the hash costs no second read of
 * the bytes (a copy from the page cache runs at memory speed, and the hash's arithmetic fits in the wait). The
 * bytes after the last whole stripe are copied by memcpy, and the final stripe (the input's last 64 bytes) is
 * read back from dst: the stripes, blocks and scrambles are xxh3_long's, in its order, over the copy, so the
 * result equals xxh3_long(dst, len, sec). */
static uint64_t xxh3_long_copy(uint8_t *dst, const uint8_t *src, size_t len, const uint8_t *sec) {
    const size_t ahead = copy_ahead;
    for (size_t at = 0; at < ahead && at < len; at += 64) __builtin_prefetch(src + at); /* the first window */
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    const size_t stripes_per_block = (SECRET_SIZE - STRIPE) / 8;
    const size_t block = STRIPE * stripes_per_block;
    size_t blocks = (len - 1) / block;
    for (size_t n = 0; n < blocks; n++) {
        for (size_t s = 0; s < stripes_per_block; s++) {
            size_t at = n * block + s * STRIPE;
            if (at + ahead < len) __builtin_prefetch(src + at + ahead);
            accumulate512_copy(acc, dst + at, src + at, sec + s * 8);
        }
        scramble(acc, sec + SECRET_SIZE - STRIPE);
    }
    size_t stripes = ((len - 1) - block * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++) {
        size_t at = blocks * block + s * STRIPE;
        accumulate512_copy(acc, dst + at, src + at, sec + s * 8);
    }
    size_t done = blocks * block + stripes * STRIPE; /* len - 64 <= done < len */
    memcpy(dst + done, src + done, len - done);
    accumulate512(acc, dst + len - STRIPE, sec + SECRET_SIZE - STRIPE - 7);
    return merge_acc(acc, len, sec);
}

/* The same long hash, eight lanes per stripe in two AVX2 registers (about 1.7x SSE2's speed here). Compiled
 * for AVX2 whatever the build's baseline (target attribute) and used only when the CPU has it
 * (xxh3_long_best, chosen at import). The steps are the
 * SSE2 ones above, and the scramble: acc ^= acc >> 47, ^= secret, *= PRIME32_1 (as two 32x32 products). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(LMDBCACHE_NO_AVX2)
#include <immintrin.h>
#define HAVE_AVX2_HASH 1
#define ACC_LANES(a, d, k)                                                                                     \
    do {                                                                                                       \
        __m256i dk = _mm256_xor_si256(d, k);                                                                   \
        __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32)); /* each lane's high half: a shift */  \
        a = _mm256_add_epi64(a, _mm256_add_epi64(prod, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));    \
    } while (0)
#define STRIPE_AT(p, k)                                                                                        \
    do {                                                                                                       \
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(const void *)(p));                                   \
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(const void *)((p) + 32));                            \
        __asm__("" : "+x"(d0), "+x"(d1)); /* each input byte loaded once (a load split across lines is slow) */ \
        ACC_LANES(a0, d0, _mm256_loadu_si256((const __m256i *)(const void *)(k)));                             \
        ACC_LANES(a1, d1, _mm256_loadu_si256((const __m256i *)(const void *)((k) + 32)));                      \
    } while (0)
/* STRIPE_AT of the stripe at src, which is stored to dst from the same registers: the hash of what was stored. */
#define STRIPE_COPY(dst, src, k)                                                                               \
    do {                                                                                                       \
        __m256i d0 = _mm256_loadu_si256((const __m256i *)(const void *)(src));                                 \
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(const void *)((src) + 32));                          \
        __asm__("" : "+x"(d0), "+x"(d1));                                                                      \
        _mm256_storeu_si256((__m256i *)(void *)(dst), d0);                                                     \
        _mm256_storeu_si256((__m256i *)(void *)((dst) + 32), d1);                                              \
        ACC_LANES(a0, d0, _mm256_loadu_si256((const __m256i *)(const void *)(k)));                             \
        ACC_LANES(a1, d1, _mm256_loadu_si256((const __m256i *)(const void *)((k) + 32)));                      \
    } while (0)
#define SCRAMBLE(a, k)                                                                                         \
    do {                                                                                                       \
        __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)),                            \
                                     _mm256_loadu_si256((const __m256i *)(const void *)(k)));                  \
        __m256i lo = _mm256_mul_epu32(x, prime);                                                               \
        __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(x, _MM_SHUFFLE(0, 3, 0, 1)), prime);                \
        a = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));                                                   \
    } while (0)

/* merge_acc of the AVX2 accumulators. */
__attribute__((target("avx2"))) static inline uint64_t merge_avx2(__m256i a0, __m256i a1, size_t len,
                                                                   const uint8_t *sec) {
    uint64_t acc[8];
    _mm256_storeu_si256((__m256i *)(void *)acc, a0);
    _mm256_storeu_si256((__m256i *)(void *)(acc + 4), a1);
    /* Said here: gcc left it out of xxh3_long_avx2 (merge_acc is called as its tail), and the upper halves left
     * dirty slowed the SSE code after every hash: 300 bytes hashed in 161 ns against SSE2's 55. */
    _mm256_zeroupper();
    return merge_acc(acc, len, sec);
}

__attribute__((target("avx2"))) static uint64_t xxh3_long_avx2(const uint8_t *in, size_t len, const uint8_t *sec) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    __m256i a0 = _mm256_loadu_si256((const __m256i *)(const void *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(const void *)(acc + 4));
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    const size_t stripes_per_block = (SECRET_SIZE - STRIPE) / 8;
    const size_t block = STRIPE * stripes_per_block;
    size_t blocks = (len - 1) / block;
    for (size_t n = 0; n < blocks; n++) {
        for (size_t s = 0; s < stripes_per_block; s++) STRIPE_AT(in + n * block + s * STRIPE, sec + s * 8);
        SCRAMBLE(a0, sec + SECRET_SIZE - STRIPE);
        SCRAMBLE(a1, sec + SECRET_SIZE - STRIPE + 32);
    }
    size_t stripes = ((len - 1) - block * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++) STRIPE_AT(in + blocks * block + s * STRIPE, sec + s * 8);
    STRIPE_AT(in + len - STRIPE, sec + SECRET_SIZE - STRIPE - 7);
    return merge_avx2(a0, a1, len, sec);
}

/* xxh3_long_copy with xxh3_long_avx2's steps: the result equals xxh3_long_avx2(dst, len, sec). */
__attribute__((target("avx2"))) static uint64_t xxh3_long_copy_avx2(uint8_t *dst, const uint8_t *src, size_t len,
                                                                     const uint8_t *sec) {
    const size_t ahead = copy_ahead;
    for (size_t at = 0; at < ahead && at < len; at += 64) __builtin_prefetch(src + at); /* the first window */
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    __m256i a0 = _mm256_loadu_si256((const __m256i *)(const void *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(const void *)(acc + 4));
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    const size_t stripes_per_block = (SECRET_SIZE - STRIPE) / 8;
    const size_t block = STRIPE * stripes_per_block;
    size_t blocks = (len - 1) / block;
    for (size_t n = 0; n < blocks; n++) {
        for (size_t s = 0; s < stripes_per_block; s++) {
            size_t at = n * block + s * STRIPE;
            if (at + ahead < len) __builtin_prefetch(src + at + ahead);
            STRIPE_COPY(dst + at, src + at, sec + s * 8);
        }
        SCRAMBLE(a0, sec + SECRET_SIZE - STRIPE);
        SCRAMBLE(a1, sec + SECRET_SIZE - STRIPE + 32);
    }
    size_t stripes = ((len - 1) - block * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++) {
        size_t at = blocks * block + s * STRIPE;
        STRIPE_COPY(dst + at, src + at, sec + s * 8);
    }
    size_t done = blocks * block + stripes * STRIPE; /* len - 64 <= done < len */
    memcpy(dst + done, src + done, len - done);
    STRIPE_AT(dst + len - STRIPE, sec + SECRET_SIZE - STRIPE - 7);
    return merge_avx2(a0, a1, len, sec);
}
#undef ACC_LANES
#undef STRIPE_AT
#undef STRIPE_COPY
#undef SCRAMBLE

#endif

/* The long hash this CPU runs best: set at import (PyInit__core); LMDBCACHE_HASH_SIMD=sse2 keeps SSE2's. */
static uint64_t (*xxh3_long_best)(const uint8_t *, size_t, const uint8_t *) = xxh3_long;
static uint64_t (*xxh3_long_copy_best)(uint8_t *, const uint8_t *, size_t, const uint8_t *) = xxh3_long_copy;

/* A seeded long hash uses the default secret with the seed added to (and subtracted from) each u64 pair. */
static inline void seeded_secret(uint8_t *secret, uint64_t seed) {
#if defined(__SSE2__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const __m128i add = _mm_set_epi64x((long long)(0 - seed), (long long)seed); /* (+seed, -seed) per pair */
    for (int i = 0; i < SECRET_SIZE / 16; i++)
        _mm_store_si128((__m128i *)(void *)(secret + 16 * i),
                        _mm_add_epi64(_mm_load_si128((const __m128i *)(const void *)(K_SECRET + 16 * i)), add));
#else
    for (int i = 0; i < SECRET_SIZE / 16; i++) {
        put_le64(secret + 16 * i, le64(K_SECRET + 16 * i) + seed);
        put_le64(secret + 16 * i + 8, le64(K_SECRET + 16 * i + 8) - seed);
    }
#endif
}

/* XXH3-64 of ``len`` bytes at ``in`` with ``seed``; touches exactly those bytes. */
static uint64_t xxh3_64(const uint8_t *in, size_t len, uint64_t seed) {
    if (len <= 16) return xxh3_0to16(in, len, K_SECRET, seed);
    if (len <= 128) return xxh3_17to128(in, len, K_SECRET, seed);
    if (len <= MIDSIZE_MAX) return xxh3_129to240(in, len, K_SECRET, seed);
    if (seed == 0) return xxh3_long_best(in, len, K_SECRET);
    _Alignas(64) uint8_t secret[SECRET_SIZE]; /* aligned: fewer of the secret's loads split across lines */
    seeded_secret(secret, seed);
    return xxh3_long_best(in, len, secret);
}

/* memcpy(dst, src, len) and then xxh3_64(dst, len, seed), in one pass over the bytes for a long input (see
 * xxh3_long_copy): the digest of what dst holds. dst and src must not overlap. */
static uint64_t xxh3_64_copy(uint8_t *dst, const uint8_t *src, size_t len, uint64_t seed) {
    if (len <= MIDSIZE_MAX) {
        memcpy(dst, src, len);
        return xxh3_64(dst, len, seed);
    }
    if (seed == 0) return xxh3_long_copy_best(dst, src, len, K_SECRET);
    _Alignas(64) uint8_t secret[SECRET_SIZE];
    seeded_secret(secret, seed);
    return xxh3_long_copy_best(dst, src, len, secret);
}

/* Bytes from which a hash releases the GIL (below, taking it back costs more than the hash). */
#define NOGIL_MIN (64 * 1024)

/* The optional seed at args[at] (0 when absent): like xxhash, any int taken modulo 2**64 (a negative one wraps). */
static int seed_arg(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at, uint64_t *seed) {
    *seed = nargs > at ? PyLong_AsUnsignedLongLongMask(args[at]) : 0;
    return *seed == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(py_xxh3_64_doc,
             "xxh3_64(buffer, seed=0, /) -> int\n\n"
             "XXH3-64 of a bytes-like object: the same integer as xxhash.xxh3_64_intdigest(buffer, seed).");

static PyObject *py_xxh3_64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "xxh3_64() takes a buffer and an optional seed");
        return NULL;
    }
    uint64_t seed;
    if (seed_arg(args, nargs, 1, &seed) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h;
    if (view.len >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = xxh3_64(view.buf, (size_t)view.len, seed);
        Py_END_ALLOW_THREADS
    } else {
        h = xxh3_64(view.buf, (size_t)view.len, seed);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(py_xxh3_64_copy_doc,
             "xxh3_64_copy(dest, source, seed=0, /) -> int\n\n"
             "Copy ``source`` into ``dest`` (a writable buffer of the same length, not overlapping it) and return\n"
             "xxh3_64 of the copy, in the one pass the read path uses for a first read's data checksum.");

static PyObject *py_xxh3_64_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "xxh3_64_copy() takes a destination, a source and an optional seed");
        return NULL;
    }
    uint64_t seed;
    if (seed_arg(args, nargs, 2, &seed) < 0) return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    const uint8_t *d = dst.buf, *s = src.buf;
    if (dst.len != src.len || (src.len && d < s + src.len && s < d + dst.len)) {
        PyErr_SetString(PyExc_ValueError, "xxh3_64_copy(): the destination must have the source's length and not "
                                          "overlap it");
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    uint64_t h;
    if (src.len >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = xxh3_64_copy(dst.buf, src.buf, (size_t)src.len, seed);
        Py_END_ALLOW_THREADS
    } else {
        h = xxh3_64_copy(dst.buf, src.buf, (size_t)src.len, seed);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLongLong(h);
}

/* ------------------------------------------------------------------------------------------
 * Reading one LMDB snapshot straight from the map, every byte range checked first.
 *
 * The layout is LMDB 0.9's (mdb.c; data format version 1, unchanged since 2011) or LMDB 1.0's (data format 3),
 * little-endian 64-bit builds; all of it read from the file, so all of it untrusted. Which one a file has is named
 * by the caller (``header``: the engine py-lmdb opened it with, lmdbcache/store/_engine.py); the meta page must
 * agree (its version). With H the page header's size and B where a page's offsets count from:
 *
 *                           LMDB 0.9                          LMDB 1.0
 *   page header             H = 16: u64 pgno; u16 pad;        H = 24: u64 pgno; u64 txnid; then the same
 *                           u16 flags; u16 lower, u16 upper   (lower, upper: free space bounds; or u32 pages
 *                                                             of an overflow page)
 *   offsets (lower, upper,  from the page's start (B = 0):    from the header's end (B = H): lower / 2
 *   the u16 node offsets    (lower - 16) / 2 nodes            nodes, node i at p + H + offset i
 *   after the header)
 *   a leaf's data           right after the key               after the key padded to an even length
 *   F_BIGDATA data          u64 overflow page number          MDB_ovpage: u64 page number, u64 txnid,
 *                                                             u64 pages (24 bytes)
 *   a named database's key  its name                          its name and a NUL (the caller's name has it)
 *
 * The same in both:
 *   node (8 bytes + key)    u16 lo, u16 hi, u16 flags, u16 ksize; key; then the data (leaf) -- a branch
 *                           node's child page number is lo | hi << 16 | flags << 32, a leaf's data size
 *                           lo | hi << 16; F_BIGDATA: the value lies on the overflow page after its header;
 *                           F_SUBDATA: the data is a named database's MDB_db
 *   MDB_db (48 bytes)       u32 pad; u16 flags; u16 depth; u64 branch, leaf, overflow pages; u64 entries;
 *                           u64 root (~0: empty)
 *   meta page (pages 0, 1)  header; u32 magic 0xBEEFC0DE; u32 version (1 or 3); u64 address; u64 mapsize;
 *                           MDB_db free, main (at byte H + 72); u64 last page; u64 txnid (at byte H + 128)
 *
 * A named database is a record of the main database (F_SUBDATA). Keys compare as LMDB's default: bytes, then
 * length. A failed check returns an LK_* code and touches nothing beyond.
 */

enum {
    LK_OK = 0,
    LK_NOTFOUND = 1,
    LK_RETRY = 2,     /* the meta page of this transaction was reused (two commits since): begin another */
    LK_META = 16,     /* no sound meta page */
    LK_PAGE = 17,     /* a page number past the end of the mapped file */
    LK_HEADER = 18,   /* a page header that does not hold together (its own number, flags, free-space bounds) */
    LK_NODE = 19,     /* a node offset outside its page */
    LK_KEY = 20,      /* a key that runs past its page */
    LK_DATA = 21,     /* inline data that runs past its page, or data of the wrong kind */
    LK_OVERFLOW = 22, /* an overflow span past the end of the mapped file or of its pages */
    LK_TREE = 23,     /* a tree deeper than its database says, or a branch page where a leaf belongs */
    LK_DB = 24,       /* the named database's record is not a database LMDB would open */
};

#define HEADER_09 16 /* LMDB 0.9's page header; data format 1 */
#define HEADER_10 24 /* LMDB 1.0's (a u64 txnid after the page number); data format 3 */
#define P_BRANCH 0x01
#define P_LEAF 0x02
#define P_OVERFLOW 0x04
#define P_META 0x08
#define P_LEAF2 0x20
#define F_BIGDATA 0x01
#define F_SUBDATA 0x02
#define F_DUPDATA 0x04
#define MDB_DUPSORT 0x04
#define MDB_DB_SIZE 48
#define MAX_DEPTH 32 /* LMDB's CURSOR_STACK: no sound tree is deeper */
#define NO_ROOT UINT64_MAX

static inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* The mapped file as far as it may be read: [base, base + len), pages of psize bytes in the layout of ``hdr``. */
typedef struct {
    const uint8_t *base;
    uint64_t len;
    uint64_t psize;
    uint64_t npages; /* whole pages in len */
    uint64_t hdr;    /* H: HEADER_09 or HEADER_10 (map_pages); 0: a map of spans only (map_from), no page parsed */
    uint64_t pbase;  /* B: 0 (0.9) or H (1.0) */
    uint64_t ovp;    /* F_BIGDATA data: 8 bytes (0.9) or 24 (1.0) */
    int even;        /* 1.0: a leaf's data follows its key padded to an even length */
} Map;

/* A page's flags: the u16 before lower and upper, the header's last 4 bytes. */
static inline uint16_t page_flags(const Map *m, const uint8_t *p) { return le16(p + m->hdr - 6); }

/* Where the data of leaf node ``nd`` of page ``p`` starts, from the page's start (its key checked inside the page by
 * node_at: the result is at most psize + 1). */
static inline uint64_t node_data(const Map *m, const uint8_t *p, const uint8_t *nd) {
    uint64_t ks = le16(nd + 6);
    return (uint64_t)(nd - p) + 8 + (m->even ? (ks + 1) & ~1ULL : ks);
}

/* A page of the tree: ``p`` points at it once its number and header are checked. */
static int page_at(const Map *m, uint64_t pgno, const uint8_t **out) {
    if (pgno >= m->npages) return LK_PAGE;
    const uint8_t *p = m->base + pgno * m->psize;
    if (le64(p) != pgno) return LK_HEADER; /* every page LMDB writes carries its own number */
    *out = p;
    return LK_OK;
}

/* The number of nodes of a branch or leaf page: its pointer array must lie inside the page. Only what a
 * read needs is checked, as LMDB reads (NUMKEYS is (B + lower - H) / 2; ``upper`` is free-space
 * bookkeeping a read never uses): a file LMDB and the Python path read must read here too (the attack). */
static int page_keys(const Map *m, const uint8_t *p, unsigned *n) {
    uint64_t lower = le16(p + m->hdr - 4);
    if (lower + m->pbase < m->hdr || lower + m->pbase > m->psize) return LK_HEADER; /* the offsets inside the page */
    *n = (unsigned)((lower + m->pbase - m->hdr) / 2);
    return LK_OK;
}

/* Node ``i`` of page ``p`` (i < its key count) and its key, checked to lie within the page. */
static int node_at(const Map *m, const uint8_t *p, unsigned i, const uint8_t **node, const uint8_t **key,
                   unsigned *ksize) {
    uint64_t off = le16(p + m->hdr + 2 * i) + m->pbase; /* i < page_keys' n: the offset lies inside the page */
    if (off + 8 > m->psize) return LK_NODE; /* the node's header inside the page */
    const uint8_t *nd = p + off;
    unsigned ks = le16(nd + 6);
    if (off + 8 + ks > m->psize) return LK_KEY;
    *node = nd;
    *key = nd + 8;
    *ksize = ks;
    return LK_OK;
}

/* LMDB's default key order (mdb_cmp_memn): bytes, then the shorter first. */
static inline int key_cmp(const uint8_t *a, size_t alen, const uint8_t *b, size_t blen) {
    if (alen == 8 && blen == 8) { /* an index's key (big-endian): one comparison, not a call to memcmp */
        uint64_t x = swap64(le64(a)), y = swap64(le64(b));
        return (x > y) - (x < y);
    }
    int c = memcmp(a, b, alen < blen ? alen : blen);
    if (c) return c;
    return alen < blen ? -1 : alen > blen;
}

/* Find ``key`` in the tree under ``root``: its leaf node, or LK_NOTFOUND, or an error. Branch pages are
 * followed down to a leaf, as LMDB's search does (the stored ``depth`` is not relied on: a file whose depth
 * field is off by one reads on both paths), for at most MAX_DEPTH levels (a cycle of pages ends there). */
static int tree_find(const Map *m, uint64_t root, unsigned depth, const uint8_t *key, size_t klen,
                     const uint8_t **leaf_page, const uint8_t **leaf_node) {
    (void)depth;
    if (root == NO_ROOT) return LK_NOTFOUND;
    uint64_t pgno = root;
    for (unsigned level = 0;; level++) {
        const uint8_t *p, *nd, *k;
        unsigned n, ks;
        int rc = page_at(m, pgno, &p);
        if (rc) return rc;
        uint16_t flags = page_flags(m, p);
        if ((rc = page_keys(m, p, &n))) return rc;
        if (flags & P_BRANCH) {
            /* A branch: the last node whose key is <= key (node 0's key stands for "anything lower"). */
            if ((flags & (P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)) || n == 0 || level + 1 >= MAX_DEPTH) return LK_TREE;
            unsigned lo = 1, hi = n, best = 0; /* search [lo, hi) */
            while (lo < hi) {
                unsigned mid = lo + (hi - lo) / 2;
                if ((rc = node_at(m, p, mid, &nd, &k, &ks))) return rc;
                if (key_cmp(k, ks, key, klen) <= 0) {
                    best = mid;
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            if ((rc = node_at(m, p, best, &nd, &k, &ks))) return rc;
            pgno = (uint64_t)le16(nd) | (uint64_t)le16(nd + 2) << 16 | (uint64_t)le16(nd + 4) << 32;
            continue;
        }
        /* The leaf level: an exact match or nothing. */
        if (!(flags & P_LEAF) || (flags & (P_BRANCH | P_LEAF2 | P_OVERFLOW | P_META))) return LK_TREE;
        unsigned lo = 0, hi = n;
        while (lo < hi) {
            unsigned mid = lo + (hi - lo) / 2;
            if ((rc = node_at(m, p, mid, &nd, &k, &ks))) return rc;
            int c = key_cmp(k, ks, key, klen);
            if (c == 0) {
                *leaf_page = p;
                *leaf_node = nd;
                return LK_OK;
            }
            if (c < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        return LK_NOTFOUND;
    }
}

/* Where a plain value (no F_SUBDATA / F_DUPDATA) of a leaf node lies in the file: (offset, size). */
static int leaf_value_lazy(const Map *m, const uint8_t *p, const uint8_t *nd, uint64_t *offset, uint64_t *size,
                           int *unchecked);
static int leaf_value(const Map *m, const uint8_t *p, const uint8_t *nd, uint64_t *offset, uint64_t *size) {
    return leaf_value_lazy(m, p, nd, offset, size, NULL);
}

/* leaf_value; with ``unchecked`` not NULL, the first overflow page's own number is not read (that would touch
 * the page: the location table's walk touches only the tree's pages) but left to the reader: *unchecked set,
 * overflow_header() must pass before any byte of the value is used. */
static int leaf_value_lazy(const Map *m, const uint8_t *p, const uint8_t *nd, uint64_t *offset, uint64_t *size,
                           int *unchecked) {
    uint16_t flags = le16(nd + 4);
    uint64_t sz = (uint64_t)le16(nd) | (uint64_t)le16(nd + 2) << 16;
    uint64_t data = node_data(m, p, nd); /* at most psize + 1 (node_at) */
    if (flags & (F_SUBDATA | F_DUPDATA)) return LK_DATA;
    if (flags & F_BIGDATA) {
        if (data + m->ovp > m->psize) return LK_DATA; /* the page number (1.0: all of MDB_ovpage) inside the page */
        uint64_t pgno = le64(p + data);
        const uint8_t *ov;
        if (unchecked != NULL) {
            if (pgno >= m->npages) return LK_OVERFLOW; /* page_at's first check; its second is overflow_header's */
            *unchecked = 1;
        } else {
            int rc = page_at(m, pgno, &ov);
            if (rc) return rc == LK_PAGE ? LK_OVERFLOW : rc;
            (void)ov;
        }
        /* The value must lie inside the mapped file. Its page count (mp_pages) is not relied on: LMDB's read
         * does not use it either, and a file the Python path reads must read here too. */
        if (sz > m->len - (pgno * m->psize + m->hdr)) return LK_OVERFLOW;
        *offset = pgno * m->psize + m->hdr;
        *size = sz;
        return LK_OK;
    }
    if (data + sz > m->psize) return LK_DATA;
    *offset = (uint64_t)(p - m->base) + data;
    *size = sz;
    return LK_OK;
}

/* The check leaf_value_lazy left to the reader: the overflow page of the value at ``offset`` (its page's start
 * plus the header, below m->len) carries its own number (page_at's second check, worded as leaf_value words it). */
static inline int overflow_header(const Map *m, uint64_t offset) {
    uint64_t start = offset - m->hdr;
    return le64(m->base + start) == start / m->psize ? LK_OK : LK_HEADER;
}

/* A named database's root, depth and flags, read from the meta page of ``txnid`` and the main database. */
typedef struct {
    uint64_t root;
    unsigned depth;
    unsigned flags;
} Tree;

static int open_tree(const Map *m, uint64_t txnid, const uint8_t *name, size_t nlen, Tree *out) {
    if (m->npages < 2) return LK_META;
    const uint8_t *meta = m->base + (txnid & 1) * m->psize; /* LMDB writes txn t's meta to page t & 1 */
    const uint8_t *mm = meta + m->hdr; /* MDB_meta, after the page header */
    const volatile uint8_t *vtx = mm + 128;
    if (le32(mm) != 0xBEEFC0DEU || le32(mm + 4) != (m->hdr == HEADER_10 ? 3 : 1) || !(page_flags(m, meta) & P_META))
        return LK_META; /* psize >= 512 holds the header and all of MDB_meta */
    /* Seqlock-style: a writer two commits on rewrites this page in place; a txnid read equal before and
     * after the copy means the copy is this snapshot's (see the docstring of lmdbcache/_native/__init__.py
     * for the one window this cannot see). */
    uint64_t before = le64((const uint8_t *)vtx);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t root = le64(mm + 72 + 40); /* the main database's MDB_db: md_root, md_depth */
    unsigned depth = le16(mm + 72 + 6);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t after = le64((const uint8_t *)vtx);
    if (before != txnid || after != txnid) return LK_RETRY;
    const uint8_t *p, *nd;
    int rc = tree_find(m, root, depth, name, nlen, &p, &nd);
    if (rc) return rc;
    uint16_t flags = le16(nd + 4);
    uint64_t data = node_data(m, p, nd);
    uint64_t size = (uint64_t)le16(nd) | (uint64_t)le16(nd + 2) << 16;
    if (!(flags & F_SUBDATA) || (flags & F_BIGDATA) || size != MDB_DB_SIZE || data + MDB_DB_SIZE > m->psize)
        return LK_DB;
    const uint8_t *db = p + data;
    out->flags = le16(db + 4);
    out->depth = le16(db + 6);
    out->root = le64(db + 40);
    if (out->flags & ~0x7fu || (out->flags & MDB_DUPSORT) || out->flags & 0x08 /* MDB_INTEGERKEY */ ||
        out->flags & 0x02 /* MDB_REVERSEKEY */)
        return LK_DB; /* keys here compare as plain bytes; lmdbcache opens its databases with no flags */
    /* The depth is reported, not relied on (tree_find walks to a leaf). */
    return LK_OK;
}

/* The Map of a (base address, usable length, page size) triple from Python, or -1 with an exception set: a map of
 * spans only (the batch copy's), whose pages are never parsed (hdr 0). */
static int map_from(Map *m, unsigned long long base, unsigned long long len, unsigned long long psize) {
    if (base == 0 || psize < 512 || psize > 65536 || (psize & (psize - 1))) {
        PyErr_SetString(PyExc_ValueError, "a mapping needs a base address and a power-of-two page size");
        return -1;
    }
    m->base = (const uint8_t *)(uintptr_t)base;
    m->len = len;
    m->psize = psize;
    m->npages = len / psize;
    m->hdr = m->pbase = m->ovp = 0;
    m->even = 0;
    return 0;
}

/* map_from for a map whose pages are read, with the page header size ``hdr`` of the file's LMDB (HEADER_09 or
 * HEADER_10: the Python side asks the environment's engine, lmdbcache/store/_engine.py), or -1 with an exception
 * set. Any other value is refused: a page is never parsed in a layout nobody named. */
static int map_pages(Map *m, unsigned long long base, unsigned long long len, unsigned long long psize,
                     unsigned long long hdr) {
    if (hdr != HEADER_09 && hdr != HEADER_10) {
        PyErr_Format(PyExc_ValueError, "a page header is %d (LMDB 0.9) or %d (LMDB 1.0) bytes, not %llu", HEADER_09,
                     HEADER_10, hdr);
        return -1;
    }
    if (map_from(m, base, len, psize) < 0) return -1;
    int v10 = hdr == HEADER_10;
    m->hdr = hdr;
    m->pbase = v10 ? HEADER_10 : 0;
    m->ovp = v10 ? 24 : 8;
    m->even = v10;
    return 0;
}

PyDoc_STRVAR(py_open_tree_doc,
             "open_tree(base, length, psize, header, txnid, name, /) -> (code, root, depth)\n\n"
             "The root page and depth of the named database ``name`` (its main-database key: under LMDB 1.0\n"
             "with a NUL) in the snapshot of the read transaction ``txnid``, read from the file mapped at\n"
             "``base`` (``length`` bytes of it readable, pages of ``psize`` with ``header``-byte headers: 16 for\n"
             "LMDB 0.9's format, 24 for 1.0's). ``code`` is 0, NOTFOUND (no such database), RETRY (the\n"
             "snapshot's meta page was reused: begin a new transaction) or an error code (see CODES).");

static PyObject *py_open_tree(PyObject *self, PyObject *args) {
    unsigned long long base, len, psize, hdr, txnid;
    Py_buffer name;
    Map m;
    Tree t = {NO_ROOT, 0, 0};
    if (!PyArg_ParseTuple(args, "KKKKKy*:open_tree", &base, &len, &psize, &hdr, &txnid, &name)) return NULL;
    if (map_pages(&m, base, len, psize, hdr) < 0) {
        PyBuffer_Release(&name);
        return NULL;
    }
    int rc = open_tree(&m, txnid, name.buf, (size_t)name.len, &t);
    PyBuffer_Release(&name);
    return Py_BuildValue("iKI", rc, (unsigned long long)t.root, t.depth);
}

PyDoc_STRVAR(py_newest_txnid_doc,
             "newest_txnid(base, length, psize, header, /) -> int\n\n"
             "The newest committed transaction id of the file mapped at ``base``: the larger txnid of its two\n"
             "meta pages (0 if the map is too short to hold them). A read transaction whose id this is sees\n"
             "every commit made so far, so a key it does not find is not stored (the dataset's misses).");

static PyObject *py_newest_txnid(PyObject *self, PyObject *args) {
    unsigned long long base, len, psize, hdr;
    Map m;
    if (!PyArg_ParseTuple(args, "KKKK:newest_txnid", &base, &len, &psize, &hdr)) return NULL;
    if (map_pages(&m, base, len, psize, hdr) < 0) return NULL;
    uint64_t at = m.hdr + 128; /* the meta page's txnid: byte 144 (0.9) or 152 (1.0) */
    if (m.len < m.psize + at + 8) return PyLong_FromLong(0); /* both meta pages' txnid must lie inside */
    /* A writer may be rewriting the older page: a torn value is larger than ours or not, and either way a
       wrong answer only makes a miss look again in a new transaction, or (a value equal to ours, torn from
       a newer one: not possible, the newer id is larger in its high bytes or equal in all) nothing. */
    uint64_t a = le64(m.base + at), b = le64(m.base + m.psize + at);
    return PyLong_FromUnsignedLongLong(a > b ? a : b);
}

PyDoc_STRVAR(py_locate_doc,
             "locate(base, length, psize, header, root, depth, key, /) -> (code, offset, size)\n\n"
             "Where the value of ``key`` lies in the mapped file (offset from ``base``), in the tree of\n"
             "``root`` and ``depth`` (open_tree): code 0, NOTFOUND or an error code; nothing outside\n"
             "[base, base + length) is read.");

static PyObject *py_locate(PyObject *self, PyObject *args) {
    unsigned long long base, len, psize, hdr, root;
    unsigned int depth;
    Py_buffer key;
    Map m;
    if (!PyArg_ParseTuple(args, "KKKKKIy*:locate", &base, &len, &psize, &hdr, &root, &depth, &key)) return NULL;
    if (map_pages(&m, base, len, psize, hdr) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    const uint8_t *p, *nd;
    uint64_t offset = 0, size = 0;
    int rc = tree_find(&m, root, depth, key.buf, (size_t)key.len, &p, &nd);
    if (rc == LK_OK) rc = leaf_value(&m, p, nd, &offset, &size);
    PyBuffer_Release(&key);
    return Py_BuildValue("iKK", rc, (unsigned long long)offset, (unsigned long long)size);
}

/* ------------------------------------------------------------------------------------------
 * The loader's batch path: locate every index of a batch (locate_batch), then copy each slice
 * of it into the batch tensors (fill), both with the GIL released. A batch's spans travel
 * between the two as a bytearray of SPAN-byte records: u64 offset, u64 size, u64 index,
 * u8 check (verify the data checksum), 7 bytes of padding.
 */

#define SPAN 32
#define LK_PACK 25 /* a pack whose header does not hold the index's value (lmdbcache/_pack.py) */
#define LK_GROUP 26 /* a pointer whose group is missing or does not hold its span (lmdbcache/format/_group.py) */
#define GROUP_POINTER 20

static inline void put_be64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* The value of ``index`` in the pack at [offset, offset + size) of the file, for a chunk of ``n`` values
 * starting at ``first``: the checks of _pack.span (magic, count, the pair within the values). */
static int pack_value(const Map *m, uint64_t offset, uint64_t size, uint64_t j, uint64_t n, uint64_t *at,
                      uint64_t *len) {
    const uint8_t *v = m->base + offset; /* [offset, offset + size) was checked against the map by leaf_value */
    if (size < 8 + 8 * n || memcmp(v, "LMPK", 4) || le32(v + 4) != n) return LK_PACK;
    uint64_t start = le32(v + 8 + 8 * j), end = le32(v + 12 + 8 * j);
    if (start < 8 + 8 * n || start > end || end > size) return LK_PACK;
    *at = offset + start;
    *len = end - start;
    return LK_OK;
}

/* The OS page size (set at import), for the advice below. */
static long os_page = 0;

/* Whether the value at [offset, offset + size) lies on two pages or more: cold, it is read in one request if
 * announced (advise_if_cold), else in a page fault a page, each waiting for the disk in turn. A 3 KiB value
 * straddles a page boundary three times in four; one cold read then cost two waits (issue 39). */
static int spans_pages(const Map *m, uint64_t offset, uint64_t size) {
    if (os_page <= 0 || size < 2) return 0;
    uintptr_t start = (uintptr_t)(m->base + offset);
    return start / (uintptr_t)os_page != (start + size - 1) / (uintptr_t)os_page;
}

/* A large value whose last page is not in memory is announced to the kernel (MADV_WILLNEED) before it is
 * copied: one read for all of it instead of a page fault per page, since the map is opened without readahead
 * (issue #14, lmdbcache/_guard.py). mincore() of one page tells cold from warm: a warm value costs that one
 * syscall, never the advice's walk over its cached pages. The last page, not the first: locating a value stored
 * on overflow pages reads their header, on the value's first page, so that page is always in memory by now and
 * asking about it called every cold value warm (issue 39: cold reads at 0.08x of pread, 37 faults a value).
 * Only advice: nothing is touched, failures are ignored. */
static int advise_if_cold(const Map *m, uint64_t offset, uint64_t size) {
#ifdef HAVE_ADVICE
    if (os_page <= 0 || size == 0) return 0;
    uintptr_t start = (uintptr_t)(m->base + offset), first = start - start % (uintptr_t)os_page;
    uintptr_t end = start + size - 1, last = end - end % (uintptr_t)os_page;
    unsigned char resident = 0;
    if (mincore((void *)last, (size_t)os_page, &resident) == 0 && (resident & 1)) return 0;
    madvise((void *)first, (size_t)(start + size - first), MADV_WILLNEED); /* the map is page-aligned: first >= base */
    return 1;
#else
    return 0;
#endif
}

/* The groups a snapshot's reads found, by id modulo GROUP_SLOTS: a warm random read then costs one tree lookup,
 * as a value stored alone does, not two. Valid for one snapshot and one map (a Tree, or one locate_batch call):
 * a group's record never moves within a snapshot. */
#define GROUP_SLOTS 16
typedef struct {
    uint64_t id, at, size;
    int used;
} GroupSlot;
typedef struct {
    GroupSlot slot[GROUP_SLOTS];
} Groups;

/* A value of GROUP_POINTER bytes starting with "LMGP" is a pointer into a group (lmdbcache/format/_group.py):
 * u64 group id, u32 offset, u32 length. Follow it: the group's record (key 0xff 'G' + the id big-endian) is
 * located in the same tree, and the value must lie inside it at an 8-byte aligned offset (_group.span). On
 * entry [*offset, *offset + GROUP_POINTER) is the pointer (checked against the map by leaf_value); on
 * success the value's span, within the group's record, itself checked against the map by leaf_value (now or
 * when ``seen``, if not NULL, remembered it). */
static int group_value(const Map *m, uint64_t root, unsigned depth, Groups *seen, uint64_t *offset, uint64_t *size) {
    const uint8_t *v = m->base + *offset, *p, *nd;
    if (memcmp(v, "LMGP", 4)) return LK_OK; /* a value that happens to be 20 bytes long */
    uint64_t group = le64(v + 4), at = le32(v + 12), len = le32(v + 16), gat, gsz;
    GroupSlot *slot = seen ? &seen->slot[group % GROUP_SLOTS] : NULL;
    if (slot && slot->used && slot->id == group) {
        gat = slot->at; /* found (and checked against the map) earlier in this snapshot */
        gsz = slot->size;
    } else {
        uint8_t key[10] = {0xff, 'G'};
        put_be64(key + 2, group);
        int rc = tree_find(m, root, depth, key, 10, &p, &nd);
        if (rc == LK_NOTFOUND) return LK_GROUP;
        if (rc || (rc = leaf_value(m, p, nd, &gat, &gsz))) return rc;
        if (slot) *slot = (GroupSlot){group, gat, gsz, 1};
    }
    if (at % 8 || len == 0 || at + len > gsz) return LK_GROUP; /* at, len < 2**32: no overflow */
    *offset = gat + at;
    *size = len;
    return LK_OK;
}

/* Locate one index as Reader._fetch does: (packs on) its value in its chunk's pack, else its single record (or
 * the value its pointer points to in a group). */
static int locate_index(const Map *m, uint64_t root, unsigned depth, Groups *seen, uint64_t index, uint64_t pack,
                        uint64_t length, uint64_t *offset, uint64_t *size) {
    uint8_t key[9];
    const uint8_t *p, *nd;
    int rc;
    uint64_t first = pack ? index - index % pack : 0;
    if (pack && first < length) {
        uint64_t n = length - first < pack ? length - first : pack, at, sz;
        put_be64(key, first);
        key[8] = 'P';
        rc = tree_find(m, root, depth, key, 9, &p, &nd);
        if (rc == LK_OK) {
            if ((rc = leaf_value(m, p, nd, &at, &sz))) return rc;
            if (index - first >= n) return LK_PACK;
            return pack_value(m, at, sz, index - first, n, offset, size);
        }
        if (rc != LK_NOTFOUND) return rc;
    }
    put_be64(key, index);
    rc = tree_find(m, root, depth, key, 8, &p, &nd);
    if (rc || (rc = leaf_value(m, p, nd, offset, size))) return rc;
    return *size == GROUP_POINTER ? group_value(m, root, depth, seen, offset, size) : LK_OK;
}

/* ------------------------------------------------------------------------------------------
 * The location table (issue 24): where every index's value lies in one snapshot, found by one walk over the
 * samples tree's pages, so that a read of a large cache costs one lookup instead of a walk down the tree. An
 * entry is (offset, size): offset 0 (the meta page: no value lies there) means "not located here", with size 0
 * (no record: NOTFOUND) or the lookup's error code for that index. The walk checks what tree_find checks on its
 * way to any key, and more: branch keys in order, every key inside the range its parents route to that page,
 * keys strictly increasing, at most one visit per page of the map (a cycle ends the walk). So tree_find finds
 * exactly the keys the walk found, with the values leaf_value locates: a lookup in the table answers what
 * locate_index answers. Any failure of the walk itself leaves no table: every read then walks the tree. */

typedef struct {
    uint64_t offset, size;
} Loc;

/* The kind of a located entry, in the top bits of its size: a value (its overflow page's own number not read yet:
 * LOC_UNCHECKED), or the pack record holding the index's value (its slot read by the reader: pack_value). */
#define LOC_UNCHECKED (1ULL << 63)
#define LOC_PACK (1ULL << 62)
#define LOC_SLOT (1ULL << 61) /* a pack's value, located (tree_locate): its length, then its start in the pack << 30 */
#define LOC_SIZE (LOC_SLOT - 1)
#define SLOT_BITS 30
#define SLOT_MAX ((1ULL << SLOT_BITS) - 1)

#define TABLE_MAX (1ULL << 27) /* entries: a dataset length past this (2 GB of table) keeps walking the tree */

typedef struct {
    const uint8_t *p;
    unsigned i, n;
    const uint8_t *lo, *hi; /* the keys this page may hold: [lo, hi); NULL: unbounded */
    unsigned lolen, hilen;
} Frame;

/* The value of leaf node ``nd`` (key ``k`` of ``ks`` bytes) entered into ``table`` as locate_index would answer
 * for the indices it holds; ``*covered`` is the end of the last pack's indices (a single record there loses). */
static void table_enter(const Map *m, uint64_t root, unsigned depth, Groups *seen, const uint8_t *p,
                        const uint8_t *nd, const uint8_t *k, unsigned ks, uint64_t pack, uint64_t length, Loc *table,
                        uint64_t *covered_lo, uint64_t *covered_hi) {
    uint64_t at = 0, sz = 0;
    if (ks == 9 && k[8] == 'P' && pack) {
        uint64_t first = swap64(le64(k)); /* the key's first 8 bytes, big-endian */
        if (first % pack || first >= length) return; /* never looked up: locate_index asks for first = i - i % pack */
        uint64_t n = length - first < pack ? length - first : pack;
        int unchecked = 0;
        int rc = leaf_value_lazy(m, p, nd, &at, &sz, &unchecked);
        uint64_t kind = LOC_PACK | (unchecked ? LOC_UNCHECKED : 0);
        for (uint64_t j = 0; j < n; j++) /* its slots are read by the reader (tree_locate): not a page touched here */
            table[first + j] = rc ? (Loc){0, (uint64_t)rc} : (Loc){at, sz | kind};
        *covered_lo = first;
        *covered_hi = first + n;
        return;
    }
    if (ks != 8) return; /* a group's record (or another key): never an index's */
    uint64_t index = swap64(le64(k)); /* big-endian */
    if (index >= length || (index >= *covered_lo && index < *covered_hi)) return; /* past the table; or packed */
    int unchecked = 0;
    int rc = leaf_value_lazy(m, p, nd, &at, &sz, &unchecked);
    if (rc == LK_OK && sz == GROUP_POINTER) {
        if (unchecked) rc = overflow_header(m, at); /* a pointer is read now: its page checked first */
        unchecked = 0;
        if (rc == LK_OK) rc = group_value(m, root, depth, seen, &at, &sz);
    }
    table[index] = rc ? (Loc){0, (uint64_t)rc} : (Loc){at, sz | (unchecked ? LOC_UNCHECKED : 0)};
}

/* The bounds of the next child of branch ``f`` (node f->i): the tighter of its parent's and its own separators,
 * node i's key (i > 0; node 0's stands for "anything lower") and node i + 1's, which must be in order. */
static int child_bounds(const Map *m, const Frame *f, Frame *c) {
    const uint8_t *nd, *k = NULL, *next;
    unsigned ks = 0, nks;
    c->lo = f->lo, c->lolen = f->lolen, c->hi = f->hi, c->hilen = f->hilen;
    if (f->i > 0) {
        if (node_at(m, f->p, f->i, &nd, &k, &ks)) return -1;
        if (c->lo == NULL || key_cmp(k, ks, c->lo, c->lolen) > 0) c->lo = k, c->lolen = ks;
    }
    if (f->i + 1 < f->n) {
        if (node_at(m, f->p, f->i + 1, &nd, &next, &nks)) return -1;
        if (k != NULL && key_cmp(k, ks, next, nks) >= 0) return -1; /* separators out of order */
        if (c->hi == NULL || key_cmp(next, nks, c->hi, c->hilen) < 0) c->hi = next, c->hilen = nks;
    }
    return 0;
}

/* The table of the tree under ``root`` for indices [0, length): a new array (PyMem_RawFree it), or NULL (no
 * memory, or a walk that failed a check: the reads walk the tree, and meet the damage where it lies). */
static Loc *table_build(const Map *m, uint64_t root, unsigned depth, uint64_t pack, uint64_t length) {
    if (length == 0 || length > TABLE_MAX) return NULL;
    Loc *table = PyMem_RawCalloc((size_t)length, sizeof(Loc));
    Groups *seen = PyMem_RawCalloc(1, sizeof(Groups));
    if (table == NULL || seen == NULL) goto fail;
    if (root == NO_ROOT) goto done;
    Frame stack[MAX_DEPTH];
    unsigned top = 0;
    uint64_t visits = 0, covered_lo = 1, covered_hi = 0;
    const uint8_t *last = NULL;
    unsigned lastlen = 0;
    uint64_t pgno = root;
    Frame parent = {NULL, 0, 0, NULL, NULL, 0, 0};
    for (;;) {
        /* Enter page pgno, bounded by ``parent``'s lo/hi. */
        const uint8_t *p, *nd, *k;
        unsigned n, ks;
        if (++visits > m->npages || page_at(m, pgno, &p) || page_keys(m, p, &n)) goto fail;
        uint16_t flags = page_flags(m, p);
        if (flags & P_BRANCH) {
            if ((flags & (P_LEAF | P_LEAF2 | P_OVERFLOW | P_META)) || n == 0 || top + 1 >= MAX_DEPTH) goto fail;
            stack[top] = (Frame){p, 0, n, parent.lo, parent.hi, parent.lolen, parent.hilen};
            top++;
        } else {
            if (!(flags & P_LEAF) || (flags & (P_BRANCH | P_LEAF2 | P_OVERFLOW | P_META))) goto fail;
            for (unsigned i = 0; i < n; i++) {
                if (node_at(m, p, i, &nd, &k, &ks)) goto fail;
                /* Strictly increasing keys: the page's first inside lo and its last below hi put all of them there */
                if ((last && key_cmp(last, lastlen, k, ks) >= 0) || (i == 0 && parent.lo && key_cmp(k, ks, parent.lo, parent.lolen) < 0) ||
                    (i + 1 == n && parent.hi && key_cmp(k, ks, parent.hi, parent.hilen) >= 0))
                    goto fail; /* out of order, or where tree_find would not look for it */
                last = k, lastlen = ks;
                table_enter(m, root, depth, seen, p, nd, k, ks, pack, length, table, &covered_lo, &covered_hi);
            }
        }
        /* The next child to enter: the deepest branch with one left. */
        for (;;) {
            if (top == 0) goto done;
            Frame *f = &stack[top - 1];
            if (f->i < f->n) {
                if (child_bounds(m, f, &parent) || node_at(m, f->p, f->i, &nd, &k, &ks)) goto fail;
                pgno = (uint64_t)le16(nd) | (uint64_t)le16(nd + 2) << 16 | (uint64_t)le16(nd + 4) << 32;
                f->i++;
                break;
            }
            top--;
        }
    }
done:
    PyMem_RawFree(seen);
    return table;
fail:
    PyMem_RawFree(seen);
    PyMem_RawFree(table);
    return NULL;
}

PyDoc_STRVAR(py_locate_batch_doc,
             "locate_batch(base, length, psize, header, root, depth, indices, pack, dataset_length, verified,\n"
             "             always, advise_min=0, /) -> (code, k, spans)\n\n"
             "Locate every index of ``indices`` (a list of ints) as locate() does, in a pack of ``pack`` values\n"
             "when its single record is absent (pack > 0). ``spans`` is a bytearray of 32-byte records (u64\n"
             "offset, u64 size, u64 index, u8 check): check is set where the data checksum must be verified\n"
             "(``always``, ``verified`` None, past its end, or its byte 0). code 0: all found; else the code\n"
             "(NOTFOUND or an error) of indices[k], the first that failed. A value of advise_min bytes or more\n"
             "(0: none) whose first page is not in memory is announced to the kernel before it is read.");

PyDoc_STRVAR(py_locate_index_doc,
             "locate_index(base, length, psize, header, root, depth, index, pack, dataset_length, advise_min, /)\n"
             "    -> (code, offset, size)\n\n"
             "One index located as locate_batch locates each of a batch (its chunk's pack first when pack > 0,\n"
             "then its single record), for a single read (``ds[i]``): code 0, NOTFOUND or an error code, and\n"
             "the value's span in the file. A value of advise_min bytes or more (0: none) whose first page is\n"
             "not in memory is announced to the kernel. The GIL stays held: a warm lookup takes less time\n"
             "than releasing it would.");

/* An argument of locate_index as a u64 (every one is a non-negative int), or -1 with an exception set. */
static int u64_arg(PyObject *arg, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static PyObject *py_locate_index(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[10]; /* base, length, psize, header, root, depth, index, pack, dataset_length, advise_min */
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "locate_index() takes exactly 10 arguments");
        return NULL;
    }
    for (int i = 0; i < 10; i++)
        if (u64_arg(args[i], &a[i]) < 0) return NULL;
    Map m;
    if (a[5] > MAX_DEPTH) a[5] = MAX_DEPTH + 1; /* tree_find refuses it (LK_TREE) */
    if (map_pages(&m, a[0], a[1], a[2], a[3]) < 0) return NULL;
    uint64_t offset = 0, size = 0;
    int rc = locate_index(&m, a[4], (unsigned)a[5], NULL, a[6], a[7], a[8], &offset, &size);
    if (rc == LK_OK && a[9] && size >= a[9]) advise_if_cold(&m, offset, size);
    PyObject *out = PyTuple_New(3);
    if (out == NULL) return NULL;
    PyObject *items[3] = {PyLong_FromLong(rc), PyLong_FromUnsignedLongLong(offset), PyLong_FromUnsignedLongLong(size)};
    for (int i = 0; i < 3; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 3; j++) Py_XDECREF(items[j]);
            Py_DECREF(out);
            return NULL;
        }
    }
    for (int i = 0; i < 3; i++) PyTuple_SET_ITEM(out, i, items[i]);
    return out;
}

/* A snapshot's samples tree, its map and the store's packing fixed at construction (once per read transaction),
 * so that a single read (``ds[i]``) is one call with one argument: Tree.value(index). */
typedef struct {
    PyObject_HEAD Map m;
    uint64_t root, pack, length, advise_min;
    unsigned depth;
    Groups groups; /* zeroed by tp_alloc */
    Loc *table;    /* the location table (table_build), once built; NULL: every read walks the tree */
    uint64_t lookups, threshold; /* indices located so far; the table is built when they pass the threshold */
    uint64_t warm_run;           /* large single reads found in memory in a row (tree_sample) */
    int table_state;             /* 0: not tried yet; 1: built (or being built); -1: the walk failed */
} TreeObject;

/* Build the table now (``force``) or once enough lookups paid for it: the walk reads every leaf page, about
 * what length / table_every lookups down the tree cost (plus table_min: a few reads never pay for it). A fresh
 * process's walks fault the leaf pages in one at a time, the build in order: at 1M samples of 3x32x32 (a 23 ms
 * build), 100k random ds[i] in a fresh process took 3.35-3.45 us a read with 256, 3.55-3.78 with 32 (the table
 * built at read 31,500), 3.3-3.5 with the table built at the first read. The store's lock is held by every
 * caller. A single read counts only when it finds its value: a lazy fill's reads all miss, each commit begins
 * a snapshot, and counting the misses built a table per commit, a walk of every entry stored so far: at 200k
 * samples of 1 KiB that was 1.5 us of every miss, growing with the cache (issue 24). Its misses walk the tree. */
static uint64_t table_every = 256, table_min = 256; /* set_table_threshold */
static void tree_index(TreeObject *t, uint64_t count, int force) {
    if (t->table_state != 0 || (!force && (t->lookups += count) < t->threshold)) return;
    t->table_state = 1; /* no second build while this one runs (without the GIL, in a batch) */
    t->table = table_build(&t->m, t->root, t->depth, t->pack, t->length);
    if (t->table == NULL) t->table_state = -1;
}

/* Once a pack's record has passed pack_value's checks (magic and count), every value of it that pack_value locates
 * is entered in the table as a slot (LOC_SLOT: the value's offset; its length and its start in the pack in the
 * size), so that a later read of any of them skips the pack's slots (a second epoch's batches, or a random read of
 * a pack read before, then read what an unpacked cache reads). The pack's overflow page number was checked by that
 * first read (tree_locate), so a slot is entered checked: checked again at every read, it was a second cache miss
 * per value of a shuffled batch (1M samples packed by 64: the loader +20%). A slot that fails, or too long
 * to enter, keeps its pack entry: its read meets pack_value's error as before. A Tree's snapshot never changes,
 * so the answers are the same. */
static void table_resolve_pack(TreeObject *t, uint64_t first, uint64_t n, uint64_t offset, uint64_t size) {
    for (uint64_t j = 0; j < n; j++) {
        uint64_t at, len;
        if (pack_value(&t->m, offset, size, j, n, &at, &len) == LK_OK && at - offset <= SLOT_MAX && len <= SLOT_MAX)
            t->table[first + j] = (Loc){at, len | (at - offset) << SLOT_BITS | LOC_SLOT};
    }
}

/* locate_index, answered by the table when there is one. Called with the store's lock held (as tree_index): a
 * pack's slots are written into the table at its first read. */
static int tree_locate(TreeObject *t, uint64_t index, uint64_t *offset, uint64_t *size) {
    if (t->table != NULL && index < t->length) {
        Loc e = t->table[index];
        if (e.offset == 0) return e.size ? (int)e.size : LK_NOTFOUND;
        uint64_t sz = e.size & LOC_SIZE;
        if (e.size & LOC_SLOT) {
            uint64_t len = sz & SLOT_MAX, start = sz >> SLOT_BITS & SLOT_MAX;
            /* Checked when entered (pack_value): again, as any entry; the pack's record starts at e.offset - start */
            if (len > t->m.len || e.offset > t->m.len - len || e.offset < t->m.hdr + start) return LK_OVERFLOW;
            *offset = e.offset;
            *size = len;
            return LK_OK;
        }
        if (sz > t->m.len || e.offset > t->m.len - sz) return LK_OVERFLOW; /* checked by the walk: again */
        /* An entry's overflow page number is checked at its first read in the snapshot (as a walk checks it), not
         * again: LMDB never rewrites a snapshot's pages, and every span stays checked against the map. */
        int rc = e.size & LOC_UNCHECKED ? overflow_header(&t->m, e.offset) : LK_OK;
        if (rc) return rc;
        if (!(e.size & LOC_PACK)) {
            t->table[index].size &= ~LOC_UNCHECKED;
            *offset = e.offset;
            *size = sz;
            return LK_OK;
        }
        uint64_t first = index - index % t->pack, n = t->length - first < t->pack ? t->length - first : t->pack;
        rc = pack_value(&t->m, e.offset, sz, index - first, n, offset, size);
        if (rc == LK_OK) table_resolve_pack(t, first, n, e.offset, sz); /* its page number checked above */
        return rc;
    }
    return locate_index(&t->m, t->root, t->depth, &t->groups, index, t->pack, t->length, offset, size);
}

static void tree_dealloc(PyObject *self) {
    TreeObject *t = (TreeObject *)self;
    PyMem_RawFree(t->table);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *tree_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    unsigned long long base, len, psize, hdr, root, pack, length, advise_min;
    unsigned int depth;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Tree() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "KKKKKIKKK:Tree", &base, &len, &psize, &hdr, &root, &depth, &pack, &length,
                          &advise_min))
        return NULL;
    TreeObject *t = (TreeObject *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    if (map_pages(&t->m, base, len, psize, hdr) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    t->root = root;
    t->depth = depth > MAX_DEPTH ? MAX_DEPTH + 1 : depth; /* tree_find refuses it (LK_TREE) */
    t->pack = pack;
    t->length = length;
    t->advise_min = advise_min;
    t->threshold = length / table_every + table_min;
    return (PyObject *)t;
}

/* The indices of ``indices`` (a list of ints) into the index field of n SPAN records at ``spans``. 0, or -1 with an
 * exception set. */
static int spans_of(PyObject *indices, uint8_t *spans, Py_ssize_t n) {
    memset(spans, 0, (size_t)n * SPAN);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t index = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(indices, k));
        if (index == (uint64_t)-1 && PyErr_Occurred()) return -1;
        memcpy(spans + k * SPAN + 16, &index, 8);
    }
    return 0;
}

/* Locate the n indices of ``spans`` in ``t`` and set each record's check flag from ``verified`` (its bytes, or NULL
 * when none is kept). LK_OK, or the error of record ``*at``. Runs without the GIL, the store's lock held. */
static int locate_rows(TreeObject *t, uint8_t *spans, Py_ssize_t n, const Py_buffer *verified, int always,
                       Py_ssize_t *at) {
    tree_index(t, (uint64_t)n, 0);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint8_t *rec = spans + k * SPAN;
        uint64_t index, offset = 0, size = 0;
        memcpy(&index, rec + 16, 8);
        int rc = tree_locate(t, index, &offset, &size);
        if (rc) {
            *at = k;
            return rc;
        }
        if (t->advise_min && size >= t->advise_min) advise_if_cold(&t->m, offset, size);
        memcpy(rec, &offset, 8);
        memcpy(rec + 8, &size, 8);
        rec[24] = always || verified == NULL || index >= (uint64_t)verified->len ||
                  !((const uint8_t *)verified->buf)[index];
    }
    *at = 0;
    return LK_OK;
}

/* The spans of a batch (see locate_batch) located in ``t`` (its table when it has one), the GIL released. */
static PyObject *batch_spans(TreeObject *t, PyObject *indices, PyObject *verified, int always) {
    Py_ssize_t n = PyList_GET_SIZE(indices);
    PyObject *blob = PyByteArray_FromStringAndSize(NULL, n * SPAN);
    if (blob == NULL) return NULL;
    uint8_t *spans = (uint8_t *)PyByteArray_AS_STRING(blob);
    if (spans_of(indices, spans, n) < 0) {
        Py_DECREF(blob);
        return NULL;
    }
    Py_buffer vb = {0};
    int have_verified = verified != Py_None;
    if (have_verified && PyObject_GetBuffer(verified, &vb, PyBUF_SIMPLE) < 0) {
        Py_DECREF(blob);
        return NULL;
    }
    int rc;
    Py_ssize_t k;
    Py_BEGIN_ALLOW_THREADS
    rc = locate_rows(t, spans, n, have_verified ? &vb : NULL, always, &k);
    Py_END_ALLOW_THREADS
    if (have_verified) PyBuffer_Release(&vb);
    return Py_BuildValue("inN", rc, k, blob);
}

static PyObject *py_locate_batch(PyObject *self, PyObject *args) {
    unsigned long long base, len, psize, hdr, root, pack, length;
    unsigned int depth;
    unsigned long long advise_min = 0;
    PyObject *indices, *verified;
    int always;
    if (!PyArg_ParseTuple(args, "KKKKKIO!KKOp|K:locate_batch", &base, &len, &psize, &hdr, &root, &depth,
                          &PyList_Type, &indices, &pack, &length, &verified, &always, &advise_min))
        return NULL;
    TreeObject *t = PyMem_Calloc(1, sizeof(TreeObject)); /* not a Python object: only its fields are used */
    if (t == NULL) return PyErr_NoMemory();
    if (map_pages(&t->m, base, len, psize, hdr) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    t->root = root;
    t->depth = depth > MAX_DEPTH ? MAX_DEPTH + 1 : depth;
    t->pack = pack;
    t->length = length;
    t->advise_min = advise_min;
    t->table_state = -1; /* one batch: no table */
    PyObject *out = batch_spans(t, indices, verified, always);
    PyMem_Free(t);
    return out;
}

PyDoc_STRVAR(tree_locate_batch_doc,
             "locate_batch(indices, verified, always, /) -> (code, k, spans)\n\n"
             "locate_batch() in this tree: the location table answers once it is built (after enough lookups).");

static PyObject *tree_locate_batch(PyObject *self, PyObject *args) {
    PyObject *indices, *verified;
    int always;
    if (!PyArg_ParseTuple(args, "O!Op:locate_batch", &PyList_Type, &indices, &verified, &always)) return NULL;
    return batch_spans((TreeObject *)self, indices, verified, always);
}

PyDoc_STRVAR(tree_build_doc,
             "index(force, /) -> int\n\n"
             "Build the location table now (``force``) or leave it to the lookups; returns its state: 0 not built\n"
             "yet, 1 built, -1 the walk failed a check (every read walks the tree).");

static PyObject *tree_build(PyObject *self, PyObject *arg) {
    TreeObject *t = (TreeObject *)self;
    int force = PyObject_IsTrue(arg);
    if (force < 0) return NULL;
    if (force && t->table_state == 0) {
        Py_BEGIN_ALLOW_THREADS
        tree_index(t, 0, 1);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(t->table_state);
}

PyDoc_STRVAR(py_set_table_threshold_doc,
             "set_table_threshold(minimum, every, /) -> (minimum, every)\n\n"
             "Trees made from now on build their location table after ``length // every + minimum`` lookups\n"
             "(every >= 1; minimum 0 and every 2**63: the first lookup builds it); returns the settings before.");

static PyObject *py_set_table_threshold(PyObject *self, PyObject *args) {
    unsigned long long minimum, every;
    if (!PyArg_ParseTuple(args, "KK:set_table_threshold", &minimum, &every)) return NULL;
    if (every == 0) {
        PyErr_SetString(PyExc_ValueError, "set_table_threshold: every must be at least 1");
        return NULL;
    }
    PyObject *out = Py_BuildValue("KK", (unsigned long long)table_min, (unsigned long long)table_every);
    table_min = minimum;
    table_every = every;
    return out;
}

PyDoc_STRVAR(tree_value_doc,
             "value(index, /) -> memoryview | None | int\n\n"
             "The value of ``index`` located as locate_index locates it: a read-only view of its bytes in the map\n"
             "(valid while the map is: the caller's read transaction), None if it is not stored, or the error\n"
             "code. A value of advise_min bytes or more whose first page is not in memory is announced first.");

static PyObject *tree_value(PyObject *self, PyObject *arg) {
    TreeObject *t = (TreeObject *)self;
    unsigned long long index = PyLong_AsUnsignedLongLong(arg);
    if (index == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    uint64_t offset = 0, size = 0;
    int rc = tree_locate(t, index, &offset, &size);
    if (rc == LK_NOTFOUND) Py_RETURN_NONE;
    if (rc != LK_OK) return PyLong_FromLong(rc);
    tree_index(t, 1, 0); /* a value found: see tree_index */
    if (t->advise_min && size >= t->advise_min) advise_if_cold(&t->m, offset, size);
    /* [offset, offset + size) was checked against the map by locate_index; read-only, format "B": it hashes */
    return PyMemoryView_FromMemory((char *)(uintptr_t)(t->m.base + offset), (Py_ssize_t)size, PyBUF_READ);
}

/* ------------------------------------------------------------------------------------------
 * A single read decoded in one call (Tree.sample): the value located as Tree.value locates it, then, for
 * a flat value (format 3's flat tuple: tensors and int / float / bool scalars) whose signature Python has
 * planned before, its header, structure checksum and lengths checked, each tensor's bytes copied into a
 * new bytearray (the data checksum over the copies when asked), wrapped as numpy array then tensor with
 * the plan's own callables, and the scalars read: the sample, as lmdbcache.format._decode.decode builds it.
 * Anything else (another form, an unplanned signature, any check that fails, any Python call that fails)
 * returns the value's view: the Python decoder then decodes it, or raises its own error for it, so the
 * two paths cannot disagree on what a damaged value is.
 *
 * A plan (lmdbcache.format._decode.native_plan, kept in the dict handed to set_plans, keyed by the
 * signature's u16 length and bytes): (struct_size, value_size, scalars_at, codes, tensors, order,
 * ndarray, from_numpy): codes a bytes of 'q' / 'd' / '?' (little-endian i64, f64, bool), tensors a tuple
 * of (nbytes, dtype, shape, view dtype or None), order the item order (k >= 0: tensor k; ~k: scalar k). */

static PyObject *flat_plans = NULL;             /* set_plans(dict) */
static PyObject *last_key = NULL, *last_plan = NULL; /* the last plan found: a hit costs one memcmp */
static PyObject *str_view = NULL;                    /* "view", interned at import */

PyDoc_STRVAR(py_set_plans_doc,
             "set_plans(plans, /) -> None\n\n"
             "The dict of flat plans Tree.sample looks signatures up in (lmdbcache.format._decode.NATIVE_PLANS).");

static PyObject *py_set_plans(PyObject *self, PyObject *arg) {
    if (!PyDict_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_plans() takes a dict");
        return NULL;
    }
    Py_XSETREF(flat_plans, Py_NewRef(arg));
    Py_CLEAR(last_key);
    Py_CLEAR(last_plan);
    Py_RETURN_NONE;
}

/* The plan of the signature at [sig, sig + n) (a new reference), or NULL: not planned. Strong, not borrowed:
 * flat_sample releases the GIL and calls numpy and torch while it uses the plan, and meanwhile another thread
 * may plan another signature (replacing last_plan) and clear the dict (format/_records.py's remember empties it
 * when full), which would free a borrowed plan under it. */
static PyObject *plan_of(const uint8_t *sig, Py_ssize_t n) {
    if (last_key != NULL && PyBytes_GET_SIZE(last_key) == n && !memcmp(PyBytes_AS_STRING(last_key), sig, (size_t)n))
        return Py_NewRef(last_plan);
    if (flat_plans == NULL) return NULL;
    PyObject *key = PyBytes_FromStringAndSize((const char *)sig, n);
    if (key == NULL) return NULL;
    PyObject *plan = PyDict_GetItemWithError(flat_plans, key); /* borrowed */
    if (plan == NULL || !PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 8) {
        Py_DECREF(key);
        return NULL;
    }
    Py_XSETREF(last_key, key);
    Py_XSETREF(last_plan, Py_NewRef(plan));
    return Py_NewRef(plan);
}

/* Bytes from which a copy releases the GIL (as NOGIL_MIN for a hash). */
#define COPY_NOGIL_MIN (64 * 1024)
#define MAX_ITEMS 255 /* MAX_FLAT_ITEMS: a plan with more is refused */

/* The sample of the flat value at v (size bytes, checked against the map) under ``index``, or NULL with no
 * exception set: not a planned flat value, or a check failed (the caller hands Python the view). Every offset
 * below is checked against ``size`` first; ``verify``: the data checksum too; ``cold``: the value is being read
 * from the disk (advise_if_cold said so), so its copy releases the GIL whatever its size. */
static PyObject *planned_sample(PyObject *plan, const uint8_t *v, uint64_t size, uint64_t index, int verify,
                                int cold);

static PyObject *flat_sample(const uint8_t *v, uint64_t size, uint64_t index, int verify, int cold) {
    if (size < 27 || memcmp(v, "LMC\x02", 4) || v[24] != 0xC1) return NULL;
    uint64_t klen = (uint64_t)le16(v + 25) + 2;
    if (klen > size - 25) return NULL;
    uint64_t ssize = le32(v + 4);
    uint64_t hashed = 24 + ssize < size ? ssize : size - 24; /* as Python slices mv[24:24 + size] */
    if (xxh3_64(v + 24, hashed, index) != le64(v + 8)) return NULL;
    PyObject *plan = plan_of(v + 25, (Py_ssize_t)klen);
    if (plan == NULL) return NULL;
    PyObject *sample = planned_sample(plan, v, size, index, verify, cold);
    Py_DECREF(plan); /* held across the copy's GIL release and the calls into numpy and torch */
    return sample;
}

/* flat_sample's decode of the value at v under ``plan`` (a strong reference the caller holds throughout). */
static PyObject *planned_sample(PyObject *plan, const uint8_t *v, uint64_t size, uint64_t index, int verify,
                                int cold) {
    uint64_t ssize = le32(v + 4);
    unsigned long long struct_size = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(plan, 0));
    unsigned long long value_size = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(plan, 1));
    unsigned long long scalars_at = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(plan, 2));
    PyObject *codes = PyTuple_GET_ITEM(plan, 3), *tensors = PyTuple_GET_ITEM(plan, 4);
    PyObject *order = PyTuple_GET_ITEM(plan, 5), *ndarray = PyTuple_GET_ITEM(plan, 6);
    PyObject *from_numpy = PyTuple_GET_ITEM(plan, 7);
    if (PyErr_Occurred() || !PyBytes_Check(codes) || !PyTuple_Check(tensors) || !PyTuple_Check(order)) return NULL;
    if (ssize != struct_size || size != value_size || value_size < 24 || struct_size > value_size - 24) return NULL;
    Py_ssize_t ntensors = PyTuple_GET_SIZE(tensors), nscalars = PyBytes_GET_SIZE(codes);
    if (ntensors + nscalars > MAX_ITEMS || PyTuple_GET_SIZE(order) != ntensors + nscalars) return NULL;
    /* The plan's fields must tile the value (Python's plan makes them so; checked, not trusted). */
    uint64_t nbytes[MAX_ITEMS], pos = 24 + struct_size;
    for (Py_ssize_t k = 0; k < ntensors; k++) {
        PyObject *spec = PyTuple_GET_ITEM(tensors, k);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4) return NULL;
        nbytes[k] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(spec, 0));
        if (PyErr_Occurred() || nbytes[k] > size - pos) return NULL;
        pos += nbytes[k];
    }
    const uint8_t *kinds = (const uint8_t *)PyBytes_AS_STRING(codes);
    uint64_t scalar_bytes = 0;
    for (Py_ssize_t k = 0; k < nscalars; k++) scalar_bytes += kinds[k] == '?' ? 1 : 8;
    if (pos != size || scalars_at > 24 + struct_size || scalar_bytes > 24 + struct_size - scalars_at) return NULL;
    PyObject *items[MAX_ITEMS] = {NULL};
    Py_ssize_t nitems = ntensors + nscalars, made = 0;
    PyObject *out = NULL;
    uint8_t *copies[MAX_ITEMS];
    pos = 24 + struct_size;
    for (; made < ntensors; made++) { /* the bytearrays first, so that the copies can run together */
        if ((items[made] = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)nbytes[made])) == NULL) goto fail;
        copies[made] = (uint8_t *)PyByteArray_AS_STRING(items[made]);
    }
    uint64_t digest = index;
    if (cold || size - 24 - struct_size >= COPY_NOGIL_MIN) { /* cold: the copy waits for the disk */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < ntensors; k++) {
            /* the checksum over the copy (what the sample holds), in the copy's pass (xxh3_64_copy) */
            if (verify) digest = xxh3_64_copy(copies[k], v + pos, nbytes[k], digest);
            else memcpy(copies[k], v + pos, nbytes[k]);
            pos += nbytes[k];
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t k = 0; k < ntensors; k++) {
            if (verify) digest = xxh3_64_copy(copies[k], v + pos, nbytes[k], digest);
            else memcpy(copies[k], v + pos, nbytes[k]);
            pos += nbytes[k];
        }
    }
    if (verify && digest != le64(v + 16)) goto fail;
    for (Py_ssize_t k = 0; k < ntensors; k++) { /* bytearray -> ndarray(shape, dtype, buffer) -> tensor (.view) */
        PyObject *spec = PyTuple_GET_ITEM(tensors, k), *view = PyTuple_GET_ITEM(spec, 3);
        PyObject *args[3] = {PyTuple_GET_ITEM(spec, 2), PyTuple_GET_ITEM(spec, 1), items[k]};
        PyObject *arr = PyObject_Vectorcall(ndarray, args, 3, NULL);
        if (arr == NULL) goto fail;
        PyObject *t = PyObject_CallOneArg(from_numpy, arr);
        Py_DECREF(arr);
        if (t == NULL) goto fail;
        if (view != Py_None) {
            PyObject *viewed = PyObject_CallMethodOneArg(t, str_view, view);
            Py_DECREF(t);
            if ((t = viewed) == NULL) goto fail;
        }
        Py_SETREF(items[k], t);
    }
    const uint8_t *s = v + scalars_at;
    for (Py_ssize_t k = 0; k < nscalars; k++, made++) {
        if (kinds[k] == 'q') {
            items[made] = PyLong_FromLongLong((long long)le64(s));
            s += 8;
        } else if (kinds[k] == 'd') {
            uint64_t bits = le64(s);
            double d;
            memcpy(&d, &bits, 8);
            items[made] = PyFloat_FromDouble(d);
            s += 8;
        } else if (kinds[k] == '?') {
            items[made] = Py_NewRef(*s ? Py_True : Py_False);
            s += 1;
        } else {
            goto fail;
        }
        if (items[made] == NULL) goto fail;
    }
    if ((out = PyTuple_New(nitems)) == NULL) goto fail;
    for (Py_ssize_t k = 0; k < nitems; k++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(order, k));
        if (at == -1 && PyErr_Occurred()) goto fail;
        at = at >= 0 ? at : ntensors + ~at; /* ~k: scalar k, stored after the tensors */
        if (at < 0 || at >= nitems || items[at] == NULL) goto fail;
        PyTuple_SET_ITEM(out, k, items[at]);
        items[at] = NULL; /* each item is used once: a plan's order is a permutation */
    }
    return out;
fail:
    PyErr_Clear(); /* the Python decoder says what is wrong, in its own words */
    Py_XDECREF(out);
    for (Py_ssize_t k = 0; k < nitems; k++) Py_XDECREF(items[k]);
    return NULL;
}

PyDoc_STRVAR(tree_sample_doc,
             "sample(index, always, verified, /) -> tuple | memoryview | None | int\n\n"
             "A single read (``ds[i]``) in one call: the value of ``index`` located as value() locates it; a flat\n"
             "value whose signature is in the plans (set_plans) is checked and decoded here, its data checksum\n"
             "verified when ``always`` or on the first read (``verified`` None, past its end, or its byte 0; the\n"
             "byte is then set: 2 for a value of advise_min bytes or more, else 1). Returns the sample (a\n"
             "tuple), or the value's view for the Python decoder (another form, or a check failed), None if\n"
             "it is not stored, or the lookup's error code.");

/* A single read of a large value asks mincore() whether it is cold (advise_if_cold) until WARM_TRUSTED in a row
 * were found in memory; then it skips that syscall (about 0.5 us of a warm 150 KB read of 18 us) and times the
 * decode instead: one slower than COLD_NS plus a nanosecond a byte (a read from the disk: 36 page faults for 150 KB)
 * starts asking again. The price of the guess: the first cold value after a warm run is read without the advice,
 * as on the Python path (store/_read.py's _COLD). */
#define WARM_TRUSTED 64
#define COLD_NS 50000ULL

static uint64_t now_ns(void) {
#ifdef HAVE_ADVICE
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
#endif
    return 0;
}

static PyObject *tree_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    TreeObject *t = (TreeObject *)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sample() takes exactly 3 arguments");
        return NULL;
    }
    unsigned long long index = PyLong_AsUnsignedLongLong(args[0]);
    if (index == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int always = PyObject_IsTrue(args[1]);
    if (always < 0) return NULL;
    PyObject *verified = args[2];
    if (verified != Py_None && !PyByteArray_Check(verified)) {
        PyErr_SetString(PyExc_TypeError, "sample(): verified must be a bytearray or None");
        return NULL;
    }
    uint64_t offset = 0, size = 0;
    int rc = tree_locate(t, index, &offset, &size);
    if (rc == LK_NOTFOUND) Py_RETURN_NONE;
    if (rc != LK_OK) return PyLong_FromLong(rc);
    tree_index(t, 1, 0); /* a value found: see tree_index */
    int cold = 0, timed = 0;
    uint64_t began = 0;
    if (t->advise_min && (size >= t->advise_min || spans_pages(&t->m, offset, size))) {
        if (t->warm_run < WARM_TRUSTED) {
            cold = advise_if_cold(&t->m, offset, size);
            t->warm_run = cold ? 0 : t->warm_run + 1;
        } else if ((began = now_ns()) != 0) {
            timed = 1;
        } else {
            cold = advise_if_cold(&t->m, offset, size); /* no clock: ask every time */
        }
    }
    const uint8_t *v = t->m.base + offset; /* [offset, offset + size) was checked against the map */
    uint8_t *flag = NULL;
    if (verified != Py_None && index < (uint64_t)PyByteArray_GET_SIZE(verified))
        flag = (uint8_t *)PyByteArray_AS_STRING(verified) + index;
    int verify = always || flag == NULL || !*flag;
    PyObject *sample = flat_sample(v, size, index, verify, cold);
    if (timed && (sample == NULL || now_ns() - began > COLD_NS + size)) t->warm_run = 0; /* slow, or not timed */
    if (sample == NULL) {
        PyErr_Clear(); /* a plan that does not parse is not planned: the Python decoder takes the value */
        if (timed) advise_if_cold(&t->m, offset, size); /* the Python decoder reads it: not timed, so asked */
        return PyMemoryView_FromMemory((char *)(uintptr_t)v, (Py_ssize_t)size, PyBUF_READ);
    }
    /* The flag is found again: the calls into numpy and torch ran Python code, which may have resized it. */
    flag = verified != Py_None && index < (uint64_t)PyByteArray_GET_SIZE(verified)
               ? (uint8_t *)PyByteArray_AS_STRING(verified) + index
               : NULL;
    if (verify && flag != NULL && !*flag) *flag = t->advise_min && size >= t->advise_min ? 2 : 1;
    return sample;
}

PyDoc_STRVAR(py_decode_flat_doc,
             "decode_flat(value, index, verify, /) -> tuple | None\n\n"
             "The sample of a flat value (a bytes-like object) stored under ``index``, decoded as Tree.sample\n"
             "decodes one from the map (the data checksum verified when ``verify``), or None: the Python\n"
             "decoder takes it (another form, a signature not planned yet, or a check failed).");

static PyObject *py_decode_flat(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "decode_flat() takes exactly 3 arguments");
        return NULL;
    }
    unsigned long long index = PyLong_AsUnsignedLongLong(args[1]);
    if (index == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int verify = PyObject_IsTrue(args[2]);
    if (verify < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    /* The export keeps the bytes alive and in place while flat_sample runs Python code (numpy, torch). */
    PyObject *sample = flat_sample((const uint8_t *)view.buf, (uint64_t)view.len, index, verify, 0);
    PyBuffer_Release(&view);
    if (sample == NULL) {
        PyErr_Clear(); /* as in Tree.sample */
        Py_RETURN_NONE;
    }
    return sample;
}

/* ------------------------------------------------------------------------------------------
 * Writing a flat value (a miss): the codec's flat form (lmdbcache/format/codec.py) in one allocation.
 *
 * The Python encoder plans a flat sample once per kind (format/_encode.py): the structure's bytes
 * up to the scalars (``prefix``: 0xC1, the u16 signature length, the signature) and the scalars'
 * struct codes. Here the value is laid out from those, the tensors' bytes (C-contiguous buffers)
 * and the scalars: header, structure, buffers, both checksums. Nothing is trusted: the signature is
 * walked and must name exactly the buffers handed in (each tensor record's nbytes equal to its
 * buffer's length) and the scalar codes in order; a scalar of another type, an int beyond int64,
 * a buffer that is not C-contiguous, a value over 2**32 - 1 bytes: None, and the Python encoder
 * writes (or refuses) the sample itself, so both paths store the same bytes or the same error. */

#define MAX_VALUE_SIZE 0xFFFFFFFFULL
#define TENSOR_RECORD 11 /* b"T", then <B dtype code><B ndim><Q nbytes>, then ndim x <q dim> */

PyDoc_STRVAR(py_encode_flat_doc,
             "encode_flat(prefix, codes, buffers, scalars, index, /) -> bytes | None\n\n"
             "The flat value of a planned sample (see format/_encode.py): ``prefix`` the structure up to the\n"
             "scalars, ``codes`` their struct codes (b'q', b'd', b'?' each), ``buffers`` a tuple of the tensors'\n"
             "C-contiguous buffers in signature order, ``scalars`` a tuple of the scalar items; or None when\n"
             "anything does not match the signature (the Python encoder then writes the sample).");

static PyObject *py_encode_flat(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_flat() takes exactly 5 arguments");
        return NULL;
    }
    PyObject *prefix = args[0], *codes = args[1], *bufs = args[2], *scalars = args[3];
    if (!PyBytes_Check(prefix) || !PyBytes_Check(codes) || !PyTuple_Check(bufs) || !PyTuple_Check(scalars)) {
        PyErr_SetString(PyExc_TypeError, "encode_flat(): prefix and codes must be bytes, buffers and scalars tuples");
        return NULL;
    }
    unsigned long long index = PyLong_AsUnsignedLongLong(args[4]);
    if (index == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    const uint8_t *pre = (const uint8_t *)PyBytes_AS_STRING(prefix), *kinds = (const uint8_t *)PyBytes_AS_STRING(codes);
    Py_ssize_t plen = PyBytes_GET_SIZE(prefix), nscalars = PyBytes_GET_SIZE(codes), nbufs = PyTuple_GET_SIZE(bufs);
    if (nscalars != PyTuple_GET_SIZE(scalars) || nbufs > MAX_ITEMS || nscalars > MAX_ITEMS || plen < 3 || pre[0] != 0xC1 ||
        (Py_ssize_t)le16(pre + 1) != plen - 3)
        Py_RETURN_NONE;
    Py_buffer views[MAX_ITEMS];
    Py_ssize_t held = 0;
    PyObject *out = NULL;
    uint64_t scalar_bytes = 0, data_bytes = 0;
    for (Py_ssize_t k = 0; k < nscalars; k++) scalar_bytes += kinds[k] == '?' ? 1 : 8;
    /* The signature must name the buffers (in order, each of its record's nbytes) and the scalar codes. */
    Py_ssize_t at = 3, tensor = 0, scalar = 0;
    while (at < plen) {
        if (pre[at] == 'T') {
            if (plen - at < TENSOR_RECORD || tensor >= nbufs) goto fallback;
            Py_ssize_t rec = TENSOR_RECORD + 8 * (Py_ssize_t)pre[at + 2];
            if (plen - at < rec) goto fallback;
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(bufs, tensor), &views[held], PyBUF_C_CONTIGUOUS) < 0) goto fallback;
            held++;
            if ((uint64_t)views[tensor].len != le64(pre + at + 3)) goto fallback;
            data_bytes += (uint64_t)views[tensor].len;
            tensor++;
            at += rec;
        } else {
            if (scalar >= nscalars || pre[at] != kinds[scalar] || (kinds[scalar] != 'q' && kinds[scalar] != 'd' &&
                                                                   kinds[scalar] != '?'))
                goto fallback;
            scalar++;
            at++;
        }
    }
    if (tensor != nbufs || scalar != nscalars) goto fallback;
    uint64_t ssize = (uint64_t)plen + scalar_bytes;
    if (ssize > MAX_VALUE_SIZE || data_bytes > MAX_VALUE_SIZE - 24 - ssize) goto fallback;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(24 + ssize + data_bytes));
    if (out == NULL) goto fail;
    uint8_t *v = (uint8_t *)PyBytes_AS_STRING(out), *s = v + 24 + plen;
    memcpy(v + 24, pre, (size_t)plen);
    for (Py_ssize_t k = 0; k < nscalars; k++) {
        PyObject *item = PyTuple_GET_ITEM(scalars, k);
        if (kinds[k] == 'q') {
            int overflow = 0;
            long long x = PyLong_CheckExact(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
            if (!PyLong_CheckExact(item) || overflow || (x == -1 && PyErr_Occurred())) goto fallback;
            put_le64(s, (uint64_t)x);
            s += 8;
        } else if (kinds[k] == 'd') {
            if (!PyFloat_CheckExact(item)) goto fallback;
            double d = PyFloat_AS_DOUBLE(item);
            uint64_t bits;
            memcpy(&bits, &d, 8);
            put_le64(s, bits);
            s += 8;
        } else {
            if (!PyBool_Check(item)) goto fallback;
            *s++ = item == Py_True;
        }
    }
    uint64_t digest = index;
    if (data_bytes >= COPY_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < nbufs; k++) { /* the checksum over the copy: what the value holds */
            digest = xxh3_64_copy(s, views[k].buf, (size_t)views[k].len, digest);
            s += views[k].len;
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t k = 0; k < nbufs; k++) {
            digest = xxh3_64_copy(s, views[k].buf, (size_t)views[k].len, digest);
            s += views[k].len;
        }
    }
    memcpy(v, "LMC\x02", 4);
    v[4] = (uint8_t)ssize;
    v[5] = (uint8_t)(ssize >> 8);
    v[6] = (uint8_t)(ssize >> 16);
    v[7] = (uint8_t)(ssize >> 24);
    put_le64(v + 8, xxh3_64(v + 24, (size_t)ssize, index));
    put_le64(v + 16, digest);
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    return out;
fallback:
    PyErr_Clear(); /* the Python encoder writes this sample, or says what is wrong with it */
    Py_XDECREF(out);
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    return NULL;
}

/* ------------------------------------------------------------------------------------------
 * A miss's flat value in one call (encode_sample): what format/_encode.py's _native_flat does in Python
 * (the sample's kind, its plan, each tensor's numpy() view, then encode_flat), without its frames and lists.
 * The kind is built exactly as _encode._kind builds it (a tuple: (dtype, shape) for an item whose type is
 * exactly the tensor type, the item's type for any other), so the plan found is the one Python would find.
 * Nothing is trusted: the plan's positions are bounds-checked, and encode_flat checks the buffers against
 * the signature. Any step Python's path would give up on (no plan, a numpy() or view() that raises
 * RuntimeError, TypeError or ValueError) returns None, and the Python encoder writes or refuses the sample
 * itself; any other error propagates, as it does from _native_flat. */

static PyObject *str_dtype = NULL, *str_shape = NULL, *str_numpy = NULL; /* interned at import */

PyDoc_STRVAR(py_encode_sample_doc,
             "encode_sample(sample, index, plans, tensor_type, /) -> bytes | None\n\n"
             "The flat value of ``sample`` under ``index`` when its kind is planned in ``plans`` (format/_encode.py's\n"
             "_FLAT_PLANS: kind -> (prefix, pack, ((position, carrier dtype or None), ...), scalar positions, codes)),\n"
             "written as encode_flat writes it; None: not a tuple, not planned, or a view the Python path refuses.");

/* Python's _native_flat gives up (returns None) on these; anything else propagates. */
static int give_up(void) {
    if (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
        PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* The kind of ``sample`` (n items) as _encode._kind builds it, or NULL with an exception set. */
static PyObject *sample_kind(PyObject *sample, Py_ssize_t n, PyObject *tensor_type) {
    PyObject *key = PyTuple_New(n);
    if (key == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PyTuple_GET_ITEM(sample, k), *entry;
        if ((PyObject *)Py_TYPE(item) == tensor_type) {
            PyObject *dtype = PyObject_GetAttr(item, str_dtype);
            PyObject *shape = dtype == NULL ? NULL : PyObject_GetAttr(item, str_shape);
            entry = shape == NULL ? NULL : PyTuple_Pack(2, dtype, shape);
            Py_XDECREF(dtype);
            Py_XDECREF(shape);
            if (entry == NULL) {
                Py_DECREF(key);
                return NULL;
            }
        } else {
            entry = Py_NewRef((PyObject *)Py_TYPE(item));
        }
        PyTuple_SET_ITEM(key, k, entry);
    }
    return key;
}

/* sample[position] for a position read from a plan, or NULL (no exception): out of range. */
static PyObject *plan_item(PyObject *sample, Py_ssize_t n, PyObject *position) {
    Py_ssize_t at = PyLong_Check(position) ? PyLong_AsSsize_t(position) : -1;
    if (at == -1 && PyErr_Occurred()) PyErr_Clear();
    return at >= 0 && at < n ? PyTuple_GET_ITEM(sample, at) : NULL;
}

static PyObject *py_encode_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "encode_sample() takes (sample, index, plans: dict, tensor_type)");
        return NULL;
    }
    PyObject *sample = args[0], *tensor_type = args[3];
    if (!PyTuple_CheckExact(sample)) Py_RETURN_NONE;
    Py_ssize_t n = PyTuple_GET_SIZE(sample);
    if (n == 0 || n > MAX_ITEMS) Py_RETURN_NONE;
    PyObject *key = sample_kind(sample, n, tensor_type);
    if (key == NULL) return give_up() ? Py_NewRef(Py_None) : NULL; /* a nested tensor has no shape */
    PyObject *plan = PyDict_GetItemWithError(args[2], key); /* borrowed */
    Py_DECREF(key);
    if (plan == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 5) Py_RETURN_NONE;
    Py_INCREF(plan); /* numpy() and view() could in principle run Python code that edits the plans */
    PyObject *tensors = PyTuple_GET_ITEM(plan, 2), *scalars_at = PyTuple_GET_ITEM(plan, 3);
    PyObject *bufs = NULL, *scalars = NULL, *out = NULL;
    if (!PyTuple_Check(tensors) || !PyTuple_Check(scalars_at)) goto none;
    Py_ssize_t ntensors = PyTuple_GET_SIZE(tensors), nscalars = PyTuple_GET_SIZE(scalars_at);
    if ((bufs = PyTuple_New(ntensors)) == NULL || (scalars = PyTuple_New(nscalars)) == NULL) goto fail;
    for (Py_ssize_t j = 0; j < ntensors; j++) {
        PyObject *spec = PyTuple_GET_ITEM(tensors, j), *item, *viewed, *arr;
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2) goto none;
        item = plan_item(sample, n, PyTuple_GET_ITEM(spec, 0));
        if (item == NULL || (PyObject *)Py_TYPE(item) != tensor_type) goto none; /* the plan names a tensor */
        PyObject *carrier = PyTuple_GET_ITEM(spec, 1);
        viewed = carrier == Py_None ? Py_NewRef(item) : PyObject_CallMethodOneArg(item, str_view, carrier);
        if (viewed == NULL) goto error;
        arr = PyObject_CallMethodNoArgs(viewed, str_numpy);
        Py_DECREF(viewed);
        if (arr == NULL) goto error;
        PyTuple_SET_ITEM(bufs, j, arr);
    }
    for (Py_ssize_t j = 0; j < nscalars; j++) {
        PyObject *item = plan_item(sample, n, PyTuple_GET_ITEM(scalars_at, j));
        if (item == NULL) goto none;
        PyTuple_SET_ITEM(scalars, j, Py_NewRef(item));
    }
    PyObject *flat_args[5] = {PyTuple_GET_ITEM(plan, 0), PyTuple_GET_ITEM(plan, 4), bufs, scalars, args[1]};
    out = py_encode_flat(self, flat_args, 5);
    if (out == NULL) goto error;
    goto done;
error:
    if (!give_up()) goto fail;
none:
    out = Py_NewRef(Py_None);
    goto done;
fail:
    out = NULL;
done:
    Py_DECREF(plan);
    Py_XDECREF(bufs);
    Py_XDECREF(scalars);
    return out;
}

PyDoc_STRVAR(py_view_doc,
             "view(address, size, /) -> memoryview\n\n"
             "A read-only view of ``size`` bytes of this process's memory at ``address`` (the map: the caller\n"
             "keeps it valid). It has no owner object, so its slices hash like bytes (decode's plan lookup).");

static PyObject *py_view(PyObject *self, PyObject *args) {
    unsigned long long address, size;
    if (!PyArg_ParseTuple(args, "KK:view", &address, &size)) return NULL;
    if (address == 0 || size > (unsigned long long)PY_SSIZE_T_MAX || address > UINTPTR_MAX - size) {
        PyErr_SetString(PyExc_ValueError, "view: not a span of this process's memory");
        return NULL;
    }
    return PyMemoryView_FromMemory((char *)(uintptr_t)address, (Py_ssize_t)size, PyBUF_READ);
}

PyDoc_STRVAR(py_address_doc,
             "address(buffer, /) -> int\n\n"
             "The address of ``buffer``'s first byte (any object with the buffer protocol; 0 if it is empty).\n"
             "What the record guard needs of a py-lmdb view, without ctypes.");

static PyObject *py_address(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uintptr_t at = (uintptr_t)b.buf;
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong((unsigned long long)at);
}

PyDoc_STRVAR(tree_gather_doc,
             "gather(indices, verified, always, plan, dests, scalar_dest, big, /) -> (code, status, at)\n\n"
             "locate_batch() of ``indices`` in this tree, then fill() of all its rows and, when every row was\n"
             "copied, mark_verified(verified, spans, big): one call, the GIL released once. code is\n"
             "locate_batch's (``at``: its index's position); when it is 0, status is fill's (``at``: its row).");
static PyObject *tree_gather(PyObject *self, PyObject *args);

static PyMethodDef tree_methods[] = {
    {"gather", tree_gather, METH_VARARGS, tree_gather_doc},
    {"value", tree_value, METH_O, tree_value_doc},
    {"sample", (PyCFunction)(void (*)(void))tree_sample, METH_FASTCALL, tree_sample_doc},
    {"locate_batch", tree_locate_batch, METH_VARARGS, tree_locate_batch_doc},
    {"index", tree_build, METH_O, tree_build_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmdbcache._native._core.Tree",
    .tp_basicsize = sizeof(TreeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Tree(base, length, psize, header, root, depth, pack, dataset_length, advise_min, /): the samples\n"
              "tree of one snapshot (open_tree's root and depth) in the file mapped at base, for single reads (value).",
    .tp_new = tree_new,
    .tp_dealloc = tree_dealloc,
    .tp_methods = tree_methods,
};

/* fill's outcomes (the row is returned with them). */
enum { FILL_OK = 0, FILL_OTHER = 1, FILL_STRUCTURE = 2, FILL_LENGTHS = 3, FILL_DATA = 4, FILL_SPAN = 5 };

#define MAX_FIELDS 255 /* MAX_FLAT_ITEMS */

PyDoc_STRVAR(py_fill_doc,
             "fill(base, length, spans, lo, hi, plan, dests, scalar_dest, /) -> (status, row)\n\n"
             "Copy the values of spans rows lo:hi (locate_batch) into rows lo:hi of the batch buffers, as\n"
             "lmdbcache.loader._gather.Buffers.fill does: ``plan`` is (signature key, struct_size, value_size,\n"
             "scalars_at, scalar_size, ((pos, nbytes), ...)), ``dests`` one writable buffer per tensor field,\n"
             "``scalar_dest`` the staging rows. status 0: done; 1: the value of ``row`` is not of this flat\n"
             "layout (nothing is wrong: the caller takes its other path); 2, 3, 4: the structure checksum,\n"
             "the lengths, the data checksum of ``row`` do not match; 5: a span outside the map.");

/* How many values ahead the fill loop prefetches a value's header: the values of a shuffled batch lie anywhere in
 * the map, so each one's first line is a cache (and TLB) miss the copy of the one before can hide. */
#define FILL_AHEAD 4

/* A fill's plan and destination buffers, taken from Python and checked (fill_prepare) before the GIL is released. */
typedef struct {
    Py_buffer key, out[MAX_FIELDS], scalars;
    uint64_t struct_size, value_size, scalars_at, scalar_size, pos[MAX_FIELDS], nbytes[MAX_FIELDS];
    Py_ssize_t nfields;
} Fill;

static void fill_release(Fill *f, Py_ssize_t got) {
    for (Py_ssize_t k = 0; k < got; k++) PyBuffer_Release(&f->out[k]);
    if (f->scalars.obj) PyBuffer_Release(&f->scalars);
    PyBuffer_Release(&f->key);
}

/* Take ``plan`` (see fill's doc), one writable buffer per field in ``dests`` and the scalar staging rows, each long
 * enough for ``rows`` rows. 0, or -1 with an exception set and nothing held. */
static int fill_prepare(Fill *f, PyObject *plan, PyObject *dests, PyObject *scalar_obj, Py_ssize_t rows) {
    PyObject *positions;
    memset(f, 0, sizeof(*f));
    if (!PyArg_ParseTuple(plan, "y*KKKKO!:fill plan", &f->key, &f->struct_size, &f->value_size, &f->scalars_at,
                          &f->scalar_size, &PyTuple_Type, &positions))
        return -1;
    Py_ssize_t nfields = f->nfields = PyTuple_GET_SIZE(positions), got = 0;
    uint64_t hi = (uint64_t)rows;
    /* A tuple of the destinations: taking a buffer can run Python code (a class's __buffer__), which could edit
     * the list under a borrowed item. */
    PyObject *held = PyList_AsTuple(dests);
    if (held == NULL) {
        PyBuffer_Release(&f->key);
        return -1;
    }
    dests = held;
    if (nfields > MAX_FIELDS || nfields != PyTuple_GET_SIZE(dests)) {
        PyErr_SetString(PyExc_ValueError, "fill: fields, destinations and rows do not agree");
        goto fail;
    }
    for (got = 0; got < nfields; got++) {
        PyObject *field = PyTuple_GET_ITEM(positions, got);
        if (!PyTuple_Check(field)) { /* PyArg_ParseTuple would raise SystemError for it */
            PyErr_SetString(PyExc_TypeError, "fill plan: each field is a (position, length) tuple");
            goto fail;
        }
        if (!PyArg_ParseTuple(field, "KK", &f->pos[got], &f->nbytes[got])) goto fail;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(dests, got), &f->out[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        /* Every row written must lie in its buffer, checked here, before the GIL is released. */
        if (f->nbytes[got] && (uint64_t)f->out[got].len / f->nbytes[got] < hi) {
            PyErr_SetString(PyExc_ValueError, "fill: a destination buffer is shorter than its rows");
            got++;
            goto fail;
        }
    }
    if (PyObject_GetBuffer(scalar_obj, &f->scalars, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail;
    if (f->scalar_size && (uint64_t)f->scalars.len / f->scalar_size < hi) {
        PyErr_SetString(PyExc_ValueError, "fill: the scalar staging buffer is shorter than its rows");
        goto fail;
    }
    /* The plan must describe values that hold every field it copies (Layout checks it; checked again). */
    /* Every sum is kept below value_size as it grows (no wraparound), so every copy stays in the value. */
    uint64_t value_size = f->value_size, end = 24 + f->struct_size;
    int tiled = value_size >= 24 && f->struct_size <= value_size - 24;
    for (Py_ssize_t k = 0; k < nfields && tiled; k++) {
        tiled = f->pos[k] == end && f->nbytes[k] <= value_size - end;
        end += f->nbytes[k];
    }
    if (!tiled || end != value_size || f->scalar_size > value_size || f->scalars_at > value_size - f->scalar_size ||
        (uint64_t)f->key.len + 25 > value_size) {
        PyErr_SetString(PyExc_ValueError, "fill: the plan's fields do not tile its value");
        goto fail;
    }
    Py_DECREF(held); /* each buffer holds its own reference to its object */
    return 0;
fail:
    Py_DECREF(held);
    fill_release(f, got);
    return -1;
}

/* Copy the values of spans rows lo:hi into rows lo:hi of ``f``'s buffers: FILL_OK, or the outcome of ``*row``.
 * Runs without the GIL: every buffer was checked by fill_prepare, every span is checked against the map here. */
static int fill_rows(const Map *m, const Fill *f, const uint8_t *spans, Py_ssize_t lo, Py_ssize_t hi,
                     Py_ssize_t *row) {
    const uint8_t *key = f->key.buf;
    uint64_t klen = (uint64_t)f->key.len;
    for (Py_ssize_t j = lo; j < hi; j++) {
        const uint8_t *rec = spans + j * SPAN;
        uint64_t offset = le64(rec), size = le64(rec + 8), index = le64(rec + 16);
        int check = rec[24];
        *row = j;
        if (offset > m->len || size > m->len - offset) return FILL_SPAN;
        if (j + FILL_AHEAD < hi) { /* a later value's header: its first touch is a cache miss, taken meanwhile */
            uint64_t ahead = le64(spans + (j + FILL_AHEAD) * SPAN);
            if (ahead < m->len) __builtin_prefetch(m->base + ahead);
        }
        const uint8_t *v = m->base + offset;
        /* Header: "LMC\x02", u32 structure size, u64 structure and data checksums; then 0xC1 and the
         * signature (u16 length + bytes): the plan's key. Another form: the caller's other path. */
        if (size < 27 || memcmp(v, "LMC\x02", 4) || v[24] != 0xC1 || (uint64_t)le16(v + 25) + 2 != klen ||
            size < 25 + klen || memcmp(v + 25, key, (size_t)klen))
            return FILL_OTHER;
        uint64_t ssize = le32(v + 4);
        uint64_t hashed = 24 + ssize < size ? ssize : size - 24; /* as Python slices mv[24:24 + size] */
        if (xxh3_64(v + 24, hashed, index) != le64(v + 8)) return FILL_STRUCTURE;
        if (ssize != f->struct_size || size != f->value_size) return FILL_LENGTHS;
        uint64_t digest = index;
        for (Py_ssize_t k = 0; k < f->nfields; k++) {
            uint8_t *out = (uint8_t *)f->out[k].buf + (uint64_t)j * f->nbytes[k];
            if (check) digest = xxh3_64_copy(out, v + f->pos[k], f->nbytes[k], digest); /* of the copy: the batch's */
            else memcpy(out, v + f->pos[k], f->nbytes[k]);
        }
        if (check && digest != le64(v + 16)) return FILL_DATA;
        if (f->scalar_size)
            memcpy((uint8_t *)f->scalars.buf + (uint64_t)j * f->scalar_size, v + f->scalars_at, f->scalar_size);
    }
    *row = 0;
    return FILL_OK;
}

static PyObject *py_fill(PyObject *self, PyObject *args) {
    unsigned long long base, len;
    Py_ssize_t lo, hi;
    PyObject *blob, *plan, *dests, *scalar_obj;
    Map m;
    if (!PyArg_ParseTuple(args, "KKO!nnO!O!O:fill", &base, &len, &PyByteArray_Type, &blob, &lo, &hi, &PyTuple_Type,
                          &plan, &PyList_Type, &dests, &scalar_obj))
        return NULL;
    if (map_from(&m, base, len, 4096) < 0) return NULL;
    if (lo < 0 || lo > hi || hi > PyByteArray_GET_SIZE(blob) / SPAN) {
        PyErr_SetString(PyExc_ValueError, "fill: fields, destinations and rows do not agree");
        return NULL;
    }
    Fill f;
    if (fill_prepare(&f, plan, dests, scalar_obj, hi) < 0) return NULL;
    /* An export of the spans keeps them from being resized or freed by another thread while the GIL is
     * released (a bytearray refuses to resize while exported); their length was checked above. */
    Py_buffer held = {0};
    if (PyObject_GetBuffer(blob, &held, PyBUF_SIMPLE) < 0 || held.len < hi * SPAN) {
        if (held.obj) PyBuffer_Release(&held);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fill: the spans changed size");
        fill_release(&f, f.nfields);
        return NULL;
    }
    int status;
    Py_ssize_t row;
    Py_BEGIN_ALLOW_THREADS
    status = fill_rows(&m, &f, (const uint8_t *)held.buf, lo, hi, &row);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&held);
    fill_release(&f, f.nfields);
    return Py_BuildValue("in", status, row);
}

PyDoc_STRVAR(py_mark_verified_doc,
             "mark_verified(verified, spans, big, /) -> None\n\n"
             "For each span with check set whose index is inside ``verified`` (a bytearray), set its byte:\n"
             "2 for a value of ``big`` bytes or more, else 1 (lmdbcache.store._read._mark).");

/* Set the verified byte of each of the n spans whose check flag is set (see mark_verified). */
static void mark_rows(uint8_t *flags, uint64_t nflags, const uint8_t *spans, Py_ssize_t n, uint64_t big) {
    for (Py_ssize_t k = 0; k < n; k++) {
        const uint8_t *rec = spans + k * SPAN;
        uint64_t index = le64(rec + 16);
        if (rec[24] && index < nflags) flags[index] = le64(rec + 8) >= big ? 2 : 1;
    }
}

static PyObject *py_mark_verified(PyObject *self, PyObject *args) {
    PyObject *verified, *blob;
    unsigned long long big;
    if (!PyArg_ParseTuple(args, "O!O!K:mark_verified", &PyByteArray_Type, &verified, &PyByteArray_Type, &blob, &big))
        return NULL;
    mark_rows((uint8_t *)PyByteArray_AS_STRING(verified), (uint64_t)PyByteArray_GET_SIZE(verified),
              (const uint8_t *)PyByteArray_AS_STRING(blob), PyByteArray_GET_SIZE(blob) / SPAN, big);
    Py_RETURN_NONE;
}

/* Tree.gather: locate_batch, fill and mark_verified of a whole batch in one call, the GIL released once. */
static PyObject *tree_gather(PyObject *self, PyObject *args) {
    TreeObject *t = (TreeObject *)self;
    PyObject *indices, *verified, *plan, *dests, *scalar_obj;
    int always;
    unsigned long long big;
    if (!PyArg_ParseTuple(args, "O!OpO!O!OK:gather", &PyList_Type, &indices, &verified, &always, &PyTuple_Type, &plan,
                          &PyList_Type, &dests, &scalar_obj, &big))
        return NULL;
    if (verified != Py_None && !PyByteArray_Check(verified)) {
        PyErr_SetString(PyExc_TypeError, "gather: verified must be a bytearray or None");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(indices);
    uint8_t stack[64 * SPAN];
    uint8_t *spans = n <= 64 ? stack : PyMem_Malloc((size_t)n * SPAN);
    if (spans == NULL) return PyErr_NoMemory();
    Fill f;
    Py_buffer vb = {0};
    PyObject *out = NULL;
    if (spans_of(indices, spans, n) < 0 || fill_prepare(&f, plan, dests, scalar_obj, n) < 0) goto done;
    /* An export keeps the bytearray from being resized by another thread while the GIL is released. */
    if (verified != Py_None && PyObject_GetBuffer(verified, &vb, PyBUF_SIMPLE) < 0) {
        fill_release(&f, f.nfields);
        goto done;
    }
    int rc, status = FILL_OK;
    Py_ssize_t at;
    Py_BEGIN_ALLOW_THREADS
    rc = locate_rows(t, spans, n, vb.obj ? &vb : NULL, always, &at);
    if (rc == LK_OK) status = fill_rows(&t->m, &f, spans, 0, n, &at);
    Py_END_ALLOW_THREADS
    if (rc == LK_OK && status == FILL_OK && vb.obj) mark_rows(vb.buf, (uint64_t)vb.len, spans, n, big);
    if (vb.obj) PyBuffer_Release(&vb);
    fill_release(&f, f.nfields);
    out = Py_BuildValue("iin", rc, status, at);
done:
    if (spans != stack) PyMem_Free(spans);
    return out;
}

/* ------------------------------------------------------------------------------------------
 * A commit's records in one call (group_batch): what format/_group.py's ``plan`` does in Python, so the
 * committer takes no Python step per record (issue 24: the per-miss cost). Same records, byte for byte:
 * the differential test runs both over random batches. Only exact lists of (int, bytes) pairs are taken;
 * anything else returns None and the Python reference writes (or refuses) the batch. */

PyDoc_STRVAR(py_group_batch_doc,
             "group_batch(batch, small, first, limit, /) -> (singles, groups) | None\n\n"
             "format/_group.py's plan(batch, small, first, limit): ``batch`` a list of (index, bytes) pairs; singles\n"
             "the (key, value) pairs stored alone (values of ``small`` bytes or more, and a lone small one), groups\n"
             "a list of (group key, record, [(key, pointer), ...]) from group id ``first``, each record at most\n"
             "``limit`` bytes unless one value is larger. None: an item the Python reference must handle.");

/* The 8-byte big-endian key of an index. */
static PyObject *index_key(uint64_t index) {
    uint8_t k[8];
    for (int i = 0; i < 8; i++) k[i] = (uint8_t)(index >> (56 - 8 * i));
    return PyBytes_FromStringAndSize((const char *)k, 8);
}

/* (key, value) as a new tuple, stealing ``key``; NULL on error. */
static PyObject *keyed(PyObject *key, PyObject *value) {
    if (key == NULL) return NULL;
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, key);
    PyTuple_SET_ITEM(pair, 1, Py_NewRef(value));
    return pair;
}

/* One value's copy into its group's record, deferred until every object is built (copy_records). */
typedef struct {
    uint8_t *to;
    const char *from;
    Py_ssize_t size, pad;
} RecordCopy;

/* (group key, record, pointers) of items[at:end] (checked (int, bytes) pairs, their indices beside), a new tuple.
 * The record is allocated, not filled: each value's copy is appended to ``copies`` (copy_records runs them). */
static PyObject *one_group(PyObject **items, const uint64_t *indices, Py_ssize_t at, Py_ssize_t end,
                           uint64_t group, Py_ssize_t record_size, RecordCopy *copies) {
    PyObject *record = PyBytes_FromStringAndSize(NULL, record_size), *pointers = PyList_New(end - at), *out = NULL;
    uint8_t gk[10] = {0xff, 'G'};
    for (int i = 0; i < 8; i++) gk[2 + i] = (uint8_t)(group >> (56 - 8 * i));
    if (record == NULL || pointers == NULL) goto done;
    uint8_t *r = (uint8_t *)PyBytes_AS_STRING(record);
    Py_ssize_t offset = 0;
    for (Py_ssize_t k = at; k < end; k++) {
        PyObject *value = PyTuple_GET_ITEM(items[k], 1);
        Py_ssize_t size = PyBytes_GET_SIZE(value), pad = (8 - size % 8) % 8;
        copies[k] = (RecordCopy){r + offset, PyBytes_AS_STRING(value), size, pad};
        uint8_t p[20] = {'L', 'M', 'G', 'P'};
        put_le64(p + 4, group);
        for (int i = 0; i < 4; i++) {
            p[12 + i] = (uint8_t)((uint64_t)offset >> (8 * i));
            p[16 + i] = (uint8_t)((uint64_t)size >> (8 * i));
        }
        PyObject *ptr = PyBytes_FromStringAndSize((const char *)p, 20), *pair = NULL;
        if (ptr != NULL) pair = keyed(index_key(indices[k]), ptr);
        Py_XDECREF(ptr);
        if (pair == NULL) goto done;
        PyList_SET_ITEM(pointers, k - at, pair);
        offset += size + pad;
    }
    out = Py_BuildValue("(y#OO)", (const char *)gk, (Py_ssize_t)10, record, pointers);
done:
    Py_XDECREF(record);
    Py_XDECREF(pointers);
    return out;
}

/* The values' copies into their records, with the GIL released: a commit's records are megabytes of fresh
 * memory, whose page faults would otherwise stall the filling thread too (issue 24: the per-miss cost). Safe:
 * the values are immutable bytes the caller's tuple keeps alive, the records new objects no one else holds. */
static void copy_records(const RecordCopy *copies, Py_ssize_t n) {
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        memcpy(copies[k].to, copies[k].from, (size_t)copies[k].size);
        memset(copies[k].to + copies[k].size, 0, (size_t)copies[k].pad);
    }
    Py_END_ALLOW_THREADS
}

static PyObject *py_group_batch(PyObject *self, PyObject *args) {
    PyObject *batch;
    Py_ssize_t small, limit;
    unsigned long long first;
    if (!PyArg_ParseTuple(args, "O!nKn:group_batch", &PyList_Type, &batch, &small, &first, &limit)) return NULL;
    /* A tuple of the pairs: the allocations below may run a collection, whose finalizers could edit the list. */
    PyObject *held = PyList_AsTuple(batch);
    if (held == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(held), nsmall = 0;
    PyObject **items = PySequence_Fast_ITEMS(held);
    uint64_t *indices = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    PyObject **smalls = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n ? n : 1));
    uint64_t *small_indices = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    RecordCopy *copies = PyMem_Malloc(sizeof(RecordCopy) * (size_t)(n ? n : 1));
    PyObject *singles = NULL, *groups = NULL, *out = NULL;
    if (indices == NULL || smalls == NULL || small_indices == NULL || copies == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) { /* every item checked before anything is built */
        PyObject *item = items[k];
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(item, 0)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(item, 1)) || PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 1)) > UINT32_MAX)
            goto none;
        indices[k] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 0));
        if (indices[k] == (uint64_t)-1 && PyErr_Occurred()) goto none; /* negative or too large: Python says so */
        if (PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 1)) < small) {
            small_indices[nsmall] = indices[k];
            smalls[nsmall++] = item;
        }
    }
    if ((singles = PyList_New(0)) == NULL || (groups = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *value = PyTuple_GET_ITEM(items[k], 1), *pair;
        if (PyBytes_GET_SIZE(value) < small && nsmall >= 2) continue;
        if ((pair = keyed(index_key(indices[k]), value)) == NULL || PyList_Append(singles, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
    }
    for (Py_ssize_t at = 0, group_at = 0; nsmall >= 2 && at < nsmall; group_at++) {
        Py_ssize_t end = at, size = 0, record_size = 0; /* as plan: each value counts its size plus 8 */
        while (end < nsmall) {
            Py_ssize_t len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(smalls[end], 1));
            if (end != at && size + len + 8 > limit) break;
            size += len + 8;
            record_size += len + (8 - len % 8) % 8;
            end++;
        }
        if (record_size > UINT32_MAX) goto none; /* offsets are u32: the Python reference raises */
        PyObject *one =
            one_group(smalls, small_indices, at, end, (uint64_t)first + (uint64_t)group_at, record_size, copies);
        if (one == NULL || PyList_Append(groups, one) < 0) {
            Py_XDECREF(one);
            goto done;
        }
        Py_DECREF(one);
        at = end;
    }
    if (nsmall >= 2) copy_records(copies, nsmall);
    out = PyTuple_Pack(2, singles, groups);
    goto done;
none:
    PyErr_Clear();
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(singles);
    Py_XDECREF(groups);
    PyMem_Free(indices);
    PyMem_Free(smalls);
    PyMem_Free(small_indices);
    PyMem_Free(copies);
    Py_DECREF(held);
    return out;
}

#include "_augment.c" /* augment: the fused crop, resize, flip and normalize of a batch slice (issue 26) */

/* ------------------------------------------------------------------------------------------
 * The module. */

/* Bumped whenever the Python side's expectations of this module change. */
#define CORE_VERSION 4

static PyMethodDef core_methods[] = {
    {"xxh3_64", (PyCFunction)(void (*)(void))py_xxh3_64, METH_FASTCALL, py_xxh3_64_doc},
    {"xxh3_64_copy", (PyCFunction)(void (*)(void))py_xxh3_64_copy, METH_FASTCALL, py_xxh3_64_copy_doc},
    {"open_tree", py_open_tree, METH_VARARGS, py_open_tree_doc},
    {"newest_txnid", py_newest_txnid, METH_VARARGS, py_newest_txnid_doc},
    {"locate", py_locate, METH_VARARGS, py_locate_doc},
    {"locate_batch", py_locate_batch, METH_VARARGS, py_locate_batch_doc},
    {"set_table_threshold", py_set_table_threshold, METH_VARARGS, py_set_table_threshold_doc},
    {"locate_index", (PyCFunction)(void (*)(void))py_locate_index, METH_FASTCALL, py_locate_index_doc},
    {"fill", py_fill, METH_VARARGS, py_fill_doc},
    {"mark_verified", py_mark_verified, METH_VARARGS, py_mark_verified_doc},
    {"augment", py_augment, METH_VARARGS, py_augment_doc},
    {"set_plans", py_set_plans, METH_O, py_set_plans_doc},
    {"decode_flat", (PyCFunction)(void (*)(void))py_decode_flat, METH_FASTCALL, py_decode_flat_doc},
    {"encode_flat", (PyCFunction)(void (*)(void))py_encode_flat, METH_FASTCALL, py_encode_flat_doc},
    {"encode_sample", (PyCFunction)(void (*)(void))py_encode_sample, METH_FASTCALL, py_encode_sample_doc},
    {"group_batch", py_group_batch, METH_VARARGS, py_group_batch_doc},
    {"view", py_view, METH_VARARGS, py_view_doc},
    {"address", py_address, METH_O, py_address_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmdbcache._native._core",
    .m_doc = "The compiled core of lmdbcache's read path (see lmdbcache/_native/__init__.py).",
    .m_size = -1,
    .m_methods = core_methods,
};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) return NULL;
#ifdef HAVE_ADVICE
    os_page = sysconf(_SC_PAGESIZE);
#endif
    const char *simd = "sse2 or scalar";
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) copy_ahead = 6144;
#endif
    if (COPY_AHEAD) copy_ahead = COPY_AHEAD; /* a build's own choice, on any CPU */
#ifdef HAVE_AVX2_HASH
    /* AVX2 when the CPU has it, unless LMDBCACHE_HASH_SIMD=sse2 (the tests compare both). AVX-512 was tried and
     * measured slower here (150 KB: 4.9 us against AVX2's 4.0 on this Xeon), so it is not used. */
    const char *cap = getenv("LMDBCACHE_HASH_SIMD");
    __builtin_cpu_init();
    if ((cap == NULL || strcmp(cap, "sse2") != 0) && __builtin_cpu_supports("avx2")) {
        xxh3_long_best = xxh3_long_avx2;
        xxh3_long_copy_best = xxh3_long_copy_avx2;
        simd = "avx2";
    }
#endif
    if (PyModule_AddStringConstant(m, "HASH_SIMD", simd) < 0 ||
        PyModule_AddIntConstant(m, "COPY_AHEAD", (long)copy_ahead) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (str_view == NULL && (str_view = PyUnicode_InternFromString("view")) == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    if ((str_dtype == NULL && (str_dtype = PyUnicode_InternFromString("dtype")) == NULL) ||
        (str_shape == NULL && (str_shape = PyUnicode_InternFromString("shape")) == NULL) ||
        (str_numpy == NULL && (str_numpy = PyUnicode_InternFromString("numpy")) == NULL)) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyType_Ready(&TreeType) < 0 || PyModule_AddObjectRef(m, "Tree", (PyObject *)&TreeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "VERSION", CORE_VERSION) < 0 || PyModule_AddIntConstant(m, "OK", LK_OK) < 0 ||
        PyModule_AddIntConstant(m, "NOTFOUND", LK_NOTFOUND) < 0 || PyModule_AddIntConstant(m, "RETRY", LK_RETRY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
