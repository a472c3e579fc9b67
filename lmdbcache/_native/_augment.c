/* The fused augmentation of a batch slice (issue 26): included once by _core.c, near its end, so it uses the
 * core's helpers (xxh3_64, le16/le32/le64, Map, map_from, SPAN, the FILL_* outcomes).
 *
 * augment(...) does for rows lo:hi what fill does (the same header, structure-checksum, length and
 * data-checksum checks, the other fields copied into their rows), except for the image field: its stored
 * shape is read from the value's own signature (each value may have another size), checked against its
 * byte count, and the image is cropped, resized (separable antialiased bilinear, as torch's
 * interpolate(mode="bilinear", antialias=True, align_corners=False) computes it on uint8: int16 weights,
 * the horizontal pass first into a uint8 row, then the vertical pass), flipped and written as uint8, or
 * through a per-channel table of 256 float32 / float16 values (Normalize), CHW or channels-last.
 * The random box and flip of each row come from (seed, epoch, index) by the counter-based generator that
 * lmdbcache/loader/augment.py writes identically (splitmix64's finalizer; 53-bit doubles).
 * Written from the published definitions of those operations; no code of an image library. */

#include <math.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define AUG_GOLDEN 0x9E3779B97F4A7C15ULL
#define AUG_MAX_SIDE (1 << 16) /* a resized side past this goes to the torch path */
enum { AUG_SHAPE = 6, AUG_NOMEM = 8 };

static inline uint64_t aug_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t aug_stream(uint64_t seed, uint64_t epoch, uint64_t index, uint64_t position) {
    uint64_t key = aug_mix(seed + AUG_GOLDEN);
    key = aug_mix((key ^ epoch) + AUG_GOLDEN);
    key = aug_mix((key ^ index) + AUG_GOLDEN);
    return aug_mix((key ^ position) + AUG_GOLDEN);
}

static inline double aug_uniform(uint64_t key, uint64_t k) {
    return (double)(aug_mix(key + (k + 1) * AUG_GOLDEN) >> 11) * 0x1.0p-53;
}

/* What a call needs besides the rows: the plan (augment.Plan) and the output form. */
typedef struct {
    uint64_t seed, epoch;
    int mode; /* 0 random-resized crop; 1 resize then a central window */
    int64_t oh, ow;
    double s0, s1, lr0, lr1, r0, r1, flip_p;
    int64_t resize, rh, rw, rrc_at, flip_at;
    int kind; /* 0 uint8, 1 float32, 2 float16 */
    const uint8_t *lut;
    int channels_last;
} AugPlan;

/* A side computed in doubles as an integer in [1, most]: a NaN or an infinity (a plan aug_parse would refuse)
 * gives a bound, never a conversion of a value outside int64 (undefined behaviour). */
static inline int64_t aug_side(double v, int64_t most) {
    return v >= 1.0 ? (v < (double)most ? (int64_t)v : most) : 1;
}

/* (top, left, h, w, rh, rw, oy, ox) of augment.box_of, the same doubles in the same order. A try's sides are
 * compared as doubles before they become integers (an infinite or NaN one fails the test); the central fallback
 * is at least one pixel wide and tall, as box_of's. */
static void aug_box(const AugPlan *p, int64_t H, int64_t W, uint64_t key, int64_t b[8]) {
    b[4] = p->oh, b[5] = p->ow, b[6] = 0, b[7] = 0;
    if (p->mode == 0) {
        double area = (double)(H * W);
        for (int t = 0; t < 10; t++) {
            double target = area * (p->s0 + (p->s1 - p->s0) * aug_uniform(key, 2 * t));
            double aspect = exp(p->lr0 + (p->lr1 - p->lr0) * aug_uniform(key, 2 * t + 1));
            double w = rint(sqrt(target * aspect)), h = rint(sqrt(target / aspect));
            if (0 < w && w <= (double)W && 0 < h && h <= (double)H) {
                b[2] = (int64_t)h, b[3] = (int64_t)w;
                b[0] = (int64_t)(aug_uniform(key, 20) * (double)(H - b[2] + 1));
                b[1] = (int64_t)(aug_uniform(key, 21) * (double)(W - b[3] + 1));
                return;
            }
        }
        double in_ratio = (double)W / (double)H;
        int64_t w = W, h = H;
        if (in_ratio < p->r0)
            h = aug_side(rint((double)W / p->r0), H);
        else if (in_ratio > p->r1)
            w = aug_side(rint((double)H * p->r1), W);
        b[0] = (H - h) / 2, b[1] = (W - w) / 2, b[2] = h, b[3] = w;
        return;
    }
    int64_t rh = H, rw = W;
    if (p->resize) {
        int64_t s = H <= W ? H : W, l = H <= W ? W : H;
        int64_t nl = (int64_t)((double)(p->resize * l) / (double)s);
        rh = H <= W ? p->resize : nl, rw = H <= W ? nl : p->resize;
    } else if (p->rh) {
        rh = p->rh, rw = p->rw;
    }
    b[0] = 0, b[1] = 0, b[2] = H, b[3] = W, b[4] = rh, b[5] = rw;
    b[6] = p->oh > rh ? -((p->oh - rh) / 2) : (int64_t)rint((double)(rh - p->oh) / 2.0);
    b[7] = p->ow > rw ? -((p->ow - rw) / 2) : (int64_t)rint((double)(rw - p->ow) / 2.0);
}

/* One dimension's taps: output i reads n[i] inputs from lo[i] with int16 weights w[i*K ...] of precision prec;
 * wp[i*P ...] the same weights two to an int32, (w[2j] | w[2j + 1] << 16), the operand of a pmaddwd, 0 past n[i]. */
typedef struct {
    int64_t *lo, *n;
    int16_t *w;
    int32_t *wp;
    int64_t K, P;
    int prec;
} AugTaps;

static void aug_taps_free(AugTaps *t) {
    free(t->lo), free(t->n), free(t->w), free(t->wp);
    t->lo = t->n = NULL, t->w = NULL, t->wp = NULL;
}

static inline double aug_filter(double x) {
    x = x < 0 ? -x : x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* torch's antialiased bilinear weights from in to out samples (align_corners=False), as int16. -1: out of
 * memory, or sides aug_image never passes (under 1 or over INT32_MAX: the support would not be an integer). */
static int aug_taps(int64_t in, int64_t out, AugTaps *t) {
    if (in < 1 || out < 1 || in > INT32_MAX || out > INT32_MAX) return -1;
    double scale = (double)in / (double)out;
    double support = scale >= 1.0 ? scale : 1.0;
    double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    int64_t K = (int64_t)ceil(support) * 2 + 1;
    t->K = K;
    t->P = (K + 1) / 2;
    t->lo = malloc(sizeof(int64_t) * out), t->n = malloc(sizeof(int64_t) * out);
    t->w = calloc((size_t)(out * K), sizeof(int16_t));
    t->wp = malloc(sizeof(int32_t) * (size_t)(out * t->P));
    double *wd = malloc(sizeof(double) * (size_t)(out * K)); /* only each output's first n[i] are written and read */
    if (!t->lo || !t->n || !t->w || !t->wp || !wd) {
        free(wd);
        aug_taps_free(t);
        return -1;
    }
    double wmax = 0.0;
    for (int64_t i = 0; i < out; i++) {
        double center = scale * ((double)i + 0.5);
        int64_t lo = (int64_t)(center - support + 0.5);
        lo = lo < 0 ? 0 : lo;
        int64_t hi = (int64_t)(center + support + 0.5);
        int64_t n = (hi < in ? hi : in) - lo;
        n = n > K ? K : n;
        double total = 0.0, *w = wd + i * K;
        for (int64_t j = 0; j < n; j++) total += w[j] = aug_filter(((double)(j + lo) - center + 0.5) * invscale);
        for (int64_t j = 0; j < n && total != 0.0; j++) {
            w[j] /= total;
            wmax = w[j] > wmax ? w[j] : wmax;
        }
        t->lo[i] = lo, t->n[i] = n < 0 ? 0 : n;
    }
    int prec = 0;
    for (prec = 0; prec < 22; prec++)
        if ((int)(0.5 + wmax * (double)(1 << (prec + 1))) >= (1 << 15)) break;
    t->prec = prec;
    for (int64_t i = 0; i < out; i++) { /* the taps past n[i] stay 0 (calloc) */
        int16_t *w = t->w + i * K;
        for (int64_t j = 0; j < t->n[i]; j++) {
            double v = wd[i * K + j] * (double)(1 << prec);
            w[j] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
        }
        /* pairs: K is odd, so the last pair's second tap would be the next output's first: 0 instead */
        for (int64_t j = 0; j < t->P; j++) {
            uint16_t odd = 2 * j + 1 < K ? (uint16_t)w[2 * j + 1] : 0;
            t->wp[i * t->P + j] = (int32_t)((uint32_t)(uint16_t)w[2 * j] | (uint32_t)odd << 16);
        }
    }
    free(wd);
    return 0;
}

/* A horizontal flip of the whole resized width, done by the taps: output i takes output out - 1 - i's taps, so
 * the passes write the flipped rows straight away (no flipped copy). lo stays monotonic (decreasing): the
 * columns a span of outputs reads are those between its ends' taps either way (aug_cols). */
static void aug_taps_reverse(AugTaps *t, int64_t out) {
    for (int64_t i = 0, k = out - 1; i < k; i++, k--) {
        int64_t lo = t->lo[i], n = t->n[i];
        t->lo[i] = t->lo[k], t->n[i] = t->n[k], t->lo[k] = lo, t->n[k] = n;
        for (int64_t j = 0; j < t->K; j++) {
            int16_t w = t->w[i * t->K + j];
            t->w[i * t->K + j] = t->w[k * t->K + j], t->w[k * t->K + j] = w;
        }
        for (int64_t j = 0; j < t->P; j++) {
            int32_t w = t->wp[i * t->P + j];
            t->wp[i * t->P + j] = t->wp[k * t->P + j], t->wp[k * t->P + j] = w;
        }
    }
}

/* The columns [c0, c1) outputs x0..x1 - 1 read (lo monotonic, increasing or, flipped, decreasing). */
static inline void aug_cols(const AugTaps *t, int64_t x0, int64_t x1, int64_t *c0, int64_t *c1) {
    int64_t a = t->lo[x0], b = t->lo[x1 - 1], ea = a + t->n[x0], eb = b + t->n[x1 - 1];
    *c0 = a < b ? a : b, *c1 = ea > eb ? ea : eb;
}

typedef struct {
    uint8_t *tmp, *plane, *strip, *cols;
    size_t tmp_size, strip_size;
} AugScratch;

#define AUG_ROWS 32 /* rows of a horizontal strip: the 32 lanes of its dot products (one AVX2, two SSE2 ones) */
#define AUG_INLINE __attribute__((always_inline)) static inline /* inside loops: values stay in registers */

#if defined(__SSE2__) && !defined(AUG_SCALAR) /* AUG_SCALAR: the portable code on x86 too (to test it) */
#define AUG_SSE2 1
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(AUG_NO_AVX2)
#include <immintrin.h>
#define AUG_AVX2 1 /* AVX2 copies of the dot products and strip transposes, taken when the CPU has it (aug_ops) */
#ifndef AUG_NO_AVX512
#define AUG_VNNI 1 /* AVX-512 (BW, VL, VNNI) copies of the dot products, taken when the CPU has them (aug_ops) */
#endif
#endif
#endif

/* A 16 x 16 block of bytes transposed: 4 rounds of interleaving row i with row i + 8 (SSE2, in every x86-64).
 * The rounds are written out (not a loop over arrays) so the 16 rows stay in registers, and the function is
 * inlined into its loops: a call per block costs more than the block. */
#ifdef AUG_SSE2
#define AUG_T16_ROUND(a, b)                                                                                            \
    do {                                                                                                               \
        b##0 = _mm_unpacklo_epi8(a##0, a##8), b##1 = _mm_unpackhi_epi8(a##0, a##8);                                    \
        b##2 = _mm_unpacklo_epi8(a##1, a##9), b##3 = _mm_unpackhi_epi8(a##1, a##9);                                    \
        b##4 = _mm_unpacklo_epi8(a##2, a##10), b##5 = _mm_unpackhi_epi8(a##2, a##10);                                  \
        b##6 = _mm_unpacklo_epi8(a##3, a##11), b##7 = _mm_unpackhi_epi8(a##3, a##11);                                  \
        b##8 = _mm_unpacklo_epi8(a##4, a##12), b##9 = _mm_unpackhi_epi8(a##4, a##12);                                  \
        b##10 = _mm_unpacklo_epi8(a##5, a##13), b##11 = _mm_unpackhi_epi8(a##5, a##13);                                \
        b##12 = _mm_unpacklo_epi8(a##6, a##14), b##13 = _mm_unpackhi_epi8(a##6, a##14);                                \
        b##14 = _mm_unpacklo_epi8(a##7, a##15), b##15 = _mm_unpackhi_epi8(a##7, a##15);                                \
    } while (0)
#endif

AUG_INLINE void aug_t16(const uint8_t *src, int64_t sstride, uint8_t *dst, int64_t dstride) {
#ifdef AUG_SSE2
#define AUG_LD(i) a##i = _mm_loadu_si128((const __m128i *)(src + i * sstride))
#define AUG_ST(i) _mm_storeu_si128((__m128i *)(dst + i * dstride), a##i)
    __m128i a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15;
    __m128i b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15;
    AUG_LD(0), AUG_LD(1), AUG_LD(2), AUG_LD(3), AUG_LD(4), AUG_LD(5), AUG_LD(6), AUG_LD(7);
    AUG_LD(8), AUG_LD(9), AUG_LD(10), AUG_LD(11), AUG_LD(12), AUG_LD(13), AUG_LD(14), AUG_LD(15);
    AUG_T16_ROUND(a, b);
    AUG_T16_ROUND(b, a);
    AUG_T16_ROUND(a, b);
    AUG_T16_ROUND(b, a);
    AUG_ST(0), AUG_ST(1), AUG_ST(2), AUG_ST(3), AUG_ST(4), AUG_ST(5), AUG_ST(6), AUG_ST(7);
    AUG_ST(8), AUG_ST(9), AUG_ST(10), AUG_ST(11), AUG_ST(12), AUG_ST(13), AUG_ST(14), AUG_ST(15);
#undef AUG_LD
#undef AUG_ST
#else
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) dst[j * dstride + i] = src[i * sstride + j];
#endif
}

/* The dot products. Both passes reduce to one shape: lanes of bytes, tap k's at in + k * step, weighted by int16
 * weights w[k] (as int32 pairs wp[k / 2], see aug_taps), rounded, shifted by prec and clamped to a byte:
 *   - horizontal: the lanes are the 32 rows of a transposed strip, the taps its columns (step 32 * channels);
 *   - vertical: the lanes are 16 or 32 columns of the intermediate, the taps its rows (step: its width).
 * With SSE2 / AVX2, taps k and k + 1 are interleaved bytewise and widened to int16 pairs, so one pmaddwd does
 * two taps' multiply-adds into int32 (no overflow: 2 * 32767 * 255 < 2^31, and the weights of an output sum to
 * 2^prec). An odd tap count pairs the last tap with zeros (its pair's second weight is 0 too): no read past the
 * last tap. The results are those of the scalar code bit for bit: the same sums, and the saturating packs
 * (int32 -> int16 -> uint8) clamp to 0..255 as aug_clip does. */

static inline uint8_t aug_clip(int32_t v, int prec) {
    v >>= prec;
    v = v < 0 ? 0 : v;
    v = v > 255 ? 255 : v;
    return (uint8_t)v;
}

/* Portable: 16 lanes, one tap at a time (gcc vectorizes the lane loops). */
static void aug_dot16_c(const uint8_t *in, int64_t step, int64_t n, const int16_t *w, int prec, uint8_t *out) {
    int32_t acc[16];
    for (int i = 0; i < 16; i++) acc[i] = 1 << (prec - 1);
    for (int64_t k = 0; k < n; k++)
        for (int i = 0; i < 16; i++) acc[i] += (int32_t)w[k] * in[k * step + i];
    for (int i = 0; i < 16; i++) out[i] = aug_clip(acc[i], prec);
}

#ifdef AUG_SSE2
/* SSE2, 16 lanes as 4 int32 accumulators of 4: one pair of taps (p, q: their 16 bytes; w: their weights). */
AUG_INLINE void aug_pair16_sse2(__m128i p, __m128i q, __m128i w, __m128i *a0, __m128i *a1, __m128i *a2,
                                __m128i *a3) {
    const __m128i zero = _mm_setzero_si128();
    __m128i lo = _mm_unpacklo_epi8(p, q), hi = _mm_unpackhi_epi8(p, q); /* (p_i, q_i) byte pairs */
    *a0 = _mm_add_epi32(*a0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), w)); /* lanes 0-3 */
    *a1 = _mm_add_epi32(*a1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), w)); /* 4-7 */
    *a2 = _mm_add_epi32(*a2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), w)); /* 8-11 */
    *a3 = _mm_add_epi32(*a3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), w)); /* 12-15 */
}

AUG_INLINE __m128i aug_dot16_sse2(const uint8_t *in, int64_t step, int64_t n, const int32_t *wp, int prec) {
    __m128i a0 = _mm_set1_epi32(1 << (prec - 1)), a1 = a0, a2 = a0, a3 = a0; /* named: kept in registers */
    int64_t k = 0;
    for (; k + 1 < n; k += 2, in += 2 * step)
        aug_pair16_sse2(_mm_loadu_si128((const __m128i *)in), _mm_loadu_si128((const __m128i *)(in + step)),
                        _mm_set1_epi32(*wp++), &a0, &a1, &a2, &a3);
    if (k < n)
        aug_pair16_sse2(_mm_loadu_si128((const __m128i *)in), _mm_setzero_si128(), _mm_set1_epi32(*wp), &a0, &a1,
                        &a2, &a3);
    __m128i shift = _mm_cvtsi32_si128(prec);
    a0 = _mm_sra_epi32(a0, shift), a1 = _mm_sra_epi32(a1, shift);
    a2 = _mm_sra_epi32(a2, shift), a3 = _mm_sra_epi32(a3, shift);
    return _mm_packus_epi16(_mm_packs_epi32(a0, a1), _mm_packs_epi32(a2, a3));
}
#endif

#ifdef AUG_AVX2
#define AUG_AVX2_FN __attribute__((target("avx2")))

/* AVX2, 16 lanes as 2 accumulators of 8, the byte pairs widened by vpmovzxbw (rows 16 to 31 wide). */
AUG_AVX2_FN AUG_INLINE __m128i aug_dot16_avx2(const uint8_t *in, int64_t step, int64_t n, const int32_t *wp, int prec) {
    __m256i a0 = _mm256_set1_epi32(1 << (prec - 1)), a1 = a0;
    for (int64_t k = 0; k < n; k += 2, in += 2 * step) {
        __m128i p = _mm_loadu_si128((const __m128i *)in);
        __m128i q = k + 1 < n ? _mm_loadu_si128((const __m128i *)(in + step)) : _mm_setzero_si128();
        __m256i w = _mm256_set1_epi32(*wp++);
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(p, q)), w)); /* 0-7 */
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(p, q)), w)); /* 8-15 */
    }
    __m128i shift = _mm_cvtsi32_si128(prec);
    a0 = _mm256_sra_epi32(a0, shift), a1 = _mm256_sra_epi32(a1, shift);
    /* packs works within 128-bit halves: lanes 0-3, 8-11 | 4-7, 12-15; the permute puts them in order */
    __m256i s = _mm256_permute4x64_epi64(_mm256_packs_epi32(a0, a1), 0xD8);
    return _mm_packus_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* AVX2, 32 lanes as 4 accumulators of 8: in-lane unpacks keep lanes 0-7 | 16-23 and 8-15 | 24-31 together,
 * and the two packs put them back in order. One pair of taps: */
AUG_AVX2_FN AUG_INLINE void aug_pair32_avx2(__m256i p, __m256i q, __m256i w, __m256i *a0, __m256i *a1, __m256i *a2,
                                            __m256i *a3) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i lo = _mm256_unpacklo_epi8(p, q), hi = _mm256_unpackhi_epi8(p, q);
    *a0 = _mm256_add_epi32(*a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), w)); /* 0-3 | 16-19 */
    *a1 = _mm256_add_epi32(*a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), w)); /* 4-7 | 20-23 */
    *a2 = _mm256_add_epi32(*a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), w)); /* 8-11 | 24-27 */
    *a3 = _mm256_add_epi32(*a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), w)); /* 12-15 | 28-31 */
}

AUG_AVX2_FN AUG_INLINE __m256i aug_dot32_avx2(const uint8_t *in, int64_t step, int64_t n, const int32_t *wp, int prec) {
    __m256i a0 = _mm256_set1_epi32(1 << (prec - 1)), a1 = a0, a2 = a0, a3 = a0; /* named: kept in registers */
    int64_t k = 0;
    for (; k + 1 < n; k += 2, in += 2 * step)
        aug_pair32_avx2(_mm256_loadu_si256((const __m256i *)in), _mm256_loadu_si256((const __m256i *)(in + step)),
                        _mm256_set1_epi32(*wp++), &a0, &a1, &a2, &a3);
    if (k < n)
        aug_pair32_avx2(_mm256_loadu_si256((const __m256i *)in), _mm256_setzero_si256(), _mm256_set1_epi32(*wp), &a0,
                        &a1, &a2, &a3);
    __m128i shift = _mm_cvtsi32_si128(prec);
    a0 = _mm256_sra_epi32(a0, shift), a1 = _mm256_sra_epi32(a1, shift);
    a2 = _mm256_sra_epi32(a2, shift), a3 = _mm256_sra_epi32(a3, shift);
    return _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
}
#endif

/* The horizontal pass's dot products of one strip: res[(x - x0) * 32 + r] for outputs x0..x1 and the 32 rows r,
 * tap column c's bytes at strip + (c - c0) * step. The taps' fields are read into locals first: res is written
 * through a byte pointer, which could alias them for the compiler. */
#ifndef AUG_SSE2
static void aug_hcols_c(const uint8_t *strip, int64_t step, const AugTaps *tx, int64_t x0, int64_t x1, int64_t c0,
                        uint8_t *res) {
    for (int64_t x = x0; x < x1; x++) {
        const uint8_t *in = strip + (tx->lo[x] - c0) * step;
        const int16_t *w = tx->w + x * tx->K;
        aug_dot16_c(in, step, tx->n[x], w, tx->prec, res + (x - x0) * AUG_ROWS);
        aug_dot16_c(in + 16, step, tx->n[x], w, tx->prec, res + (x - x0) * AUG_ROWS + 16);
    }
}
#endif

/* One output row of the vertical pass: n rows of tmp (width wide) weighted by ty's row y, 16 columns at a time
 * (the last 16 overlapping the ones before: the same values written twice), the rest of a row under 16 scalar. */
static void aug_vrow_c(const uint8_t *tmp, int64_t width, const AugTaps *ty, int64_t y, uint8_t *out) {
    const int16_t *w = ty->w + y * ty->K;
    int64_t n = ty->n[y], x = 0;
    for (; width >= 16 && x < width; x += 16) {
        x = x + 16 <= width ? x : width - 16;
        aug_dot16_c(tmp + x, width, n, w, ty->prec, out + x);
    }
    for (; x < width; x++) {
        int32_t acc = 1 << (ty->prec - 1);
        for (int64_t k = 0; k < n; k++) acc += w[k] * tmp[k * width + x];
        out[x] = aug_clip(acc, ty->prec);
    }
}

#ifdef AUG_SSE2
static void aug_hcols_sse2(const uint8_t *strip, int64_t step, const AugTaps *tx, int64_t x0, int64_t x1, int64_t c0,
                           uint8_t *res) {
    const int64_t *lo = tx->lo, *nn = tx->n, P = tx->P;
    const int32_t *wp = tx->wp;
    int prec = tx->prec;
    for (int64_t x = x0; x < x1; x++, res += AUG_ROWS) {
        const uint8_t *in = strip + (lo[x] - c0) * step;
        _mm_storeu_si128((__m128i *)res, aug_dot16_sse2(in, step, nn[x], wp + x * P, prec));
        _mm_storeu_si128((__m128i *)(res + 16), aug_dot16_sse2(in + 16, step, nn[x], wp + x * P, prec));
    }
}

static void aug_vrow_sse2(const uint8_t *tmp, int64_t width, const AugTaps *ty, int64_t y, uint8_t *out) {
    if (width < 16) {
        aug_vrow_c(tmp, width, ty, y, out);
        return;
    }
    const int32_t *wp = ty->wp + y * ty->P;
    int64_t n = ty->n[y];
    int prec = ty->prec;
    for (int64_t x = 0; x < width; x += 16) {
        x = x + 16 <= width ? x : width - 16;
        _mm_storeu_si128((__m128i *)(out + x), aug_dot16_sse2(tmp + x, width, n, wp, prec));
    }
}
#endif

#ifdef AUG_AVX2
AUG_AVX2_FN static void aug_hcols_avx2(const uint8_t *strip, int64_t step, const AugTaps *tx, int64_t x0, int64_t x1,
                                       int64_t c0, uint8_t *res) {
    const int64_t *lo = tx->lo, *nn = tx->n, P = tx->P;
    const int32_t *wp = tx->wp;
    int prec = tx->prec;
    for (int64_t x = x0; x < x1; x++, res += AUG_ROWS)
        _mm256_storeu_si256((__m256i *)res, aug_dot32_avx2(strip + (lo[x] - c0) * step, step, nn[x], wp + x * P, prec));
}

AUG_AVX2_FN static void aug_vrow_avx2(const uint8_t *tmp, int64_t width, const AugTaps *ty, int64_t y, uint8_t *out) {
    const int32_t *wp = ty->wp + y * ty->P;
    int64_t n = ty->n[y], x = 0;
    int prec = ty->prec;
    for (; width >= 32 && x < width; x += 32) {
        x = x + 32 <= width ? x : width - 32; /* the last 32 overlap: the same values again */
        _mm256_storeu_si256((__m256i *)(out + x), aug_dot32_avx2(tmp + x, width, n, wp, prec));
    }
    for (; width >= 16 && x < width; x += 16) { /* rows 16 to 31 wide */
        x = x + 16 <= width ? x : width - 16;
        _mm_storeu_si128((__m128i *)(out + x), aug_dot16_avx2(tmp + x, width, n, wp, prec));
    }
    if (x < width) aug_vrow_c(tmp, width, ty, y, out); /* under 16 wide */
}
#endif

/* A strip's transposes, 32 rows by 16 byte-columns a block, the last block of a row overlapping the one before
 * (the same bytes written twice; no read or write past the row's end). in: bytes of each of 32 rows (row r at
 * row0 + r * sy) into strip[b * lanes + r]; out: xw columns of 32 bytes (cols[x * lanes + r]) into the rows of o
 * (row r at o + r * xw). Both need bytes, xw >= 16. lanes: the strip's column stride, 32, or 64 for a strip of
 * 64 rows done as two halves (the second half's calls start at strip + 32, cols + 32). */
static void aug_strip_in_base(const uint8_t *row0, int64_t sy, int64_t bytes, uint8_t *strip, int64_t lanes) {
    for (int64_t b = 0; b < bytes; b += 16) {
        b = b + 16 <= bytes ? b : bytes - 16;
        aug_t16(row0 + b, sy, strip + b * lanes, lanes);                 /* rows 0-15 */
        aug_t16(row0 + 16 * sy + b, sy, strip + b * lanes + 16, lanes); /* rows 16-31 */
    }
}

static void aug_strip_out_base(const uint8_t *cols, int64_t xw, uint8_t *o, int64_t lanes) {
    for (int64_t x = 0; x < xw; x += 16) {
        x = x + 16 <= xw ? x : xw - 16;
        aug_t16(cols + x * lanes, lanes, o + x, xw);
        aug_t16(cols + x * lanes + 16, lanes, o + 16 * xw + x, xw);
    }
}

#ifdef AUG_AVX2
/* AVX2: both 16 x 16 blocks of a 32 x 16 one at once, one in each 128-bit half (the byte unpacks of AVX2 work
 * within halves, so the rounds are aug_t16's): register i holds rows i and i + 16 of the source. */
#define AUG_T32_ROUND(a, b)                                                                                            \
    do {                                                                                                               \
        b##0 = _mm256_unpacklo_epi8(a##0, a##8), b##1 = _mm256_unpackhi_epi8(a##0, a##8);                              \
        b##2 = _mm256_unpacklo_epi8(a##1, a##9), b##3 = _mm256_unpackhi_epi8(a##1, a##9);                              \
        b##4 = _mm256_unpacklo_epi8(a##2, a##10), b##5 = _mm256_unpackhi_epi8(a##2, a##10);                            \
        b##6 = _mm256_unpacklo_epi8(a##3, a##11), b##7 = _mm256_unpackhi_epi8(a##3, a##11);                            \
        b##8 = _mm256_unpacklo_epi8(a##4, a##12), b##9 = _mm256_unpackhi_epi8(a##4, a##12);                            \
        b##10 = _mm256_unpacklo_epi8(a##5, a##13), b##11 = _mm256_unpackhi_epi8(a##5, a##13);                          \
        b##12 = _mm256_unpacklo_epi8(a##6, a##14), b##13 = _mm256_unpackhi_epi8(a##6, a##14);                          \
        b##14 = _mm256_unpacklo_epi8(a##7, a##15), b##15 = _mm256_unpackhi_epi8(a##7, a##15);                          \
    } while (0)
#define AUG_T32_ROUNDS                                                                                                 \
    __m256i b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15;                                      \
    AUG_T32_ROUND(a, b);                                                                                               \
    AUG_T32_ROUND(b, a);                                                                                               \
    AUG_T32_ROUND(a, b);                                                                                               \
    AUG_T32_ROUND(b, a)

/* in: register i = rows i (low half) and i + 16 (high half), 16 bytes each; after the rounds register j holds
 * byte-column j's rows 0-15 and 16-31: the 32 bytes of strip column b + j. */
AUG_AVX2_FN static void aug_strip_in_avx2(const uint8_t *row0, int64_t sy, int64_t bytes, uint8_t *strip,
                                          int64_t lanes) {
    for (int64_t b = 0; b < bytes; b += 16) {
        b = b + 16 <= bytes ? b : bytes - 16;
        const uint8_t *s = row0 + b;
        uint8_t *d = strip + b * lanes;
#define AUG_LD(i)                                                                                                      \
    __m256i a##i = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s + i * sy))),    \
                                           _mm_loadu_si128((const __m128i *)(s + (i + 16) * sy)), 1)
#define AUG_ST(i) _mm256_storeu_si256((__m256i *)(d + i * lanes), a##i)
        AUG_LD(0); AUG_LD(1); AUG_LD(2); AUG_LD(3); AUG_LD(4); AUG_LD(5); AUG_LD(6); AUG_LD(7);
        AUG_LD(8); AUG_LD(9); AUG_LD(10); AUG_LD(11); AUG_LD(12); AUG_LD(13); AUG_LD(14); AUG_LD(15);
        AUG_T32_ROUNDS;
        AUG_ST(0), AUG_ST(1), AUG_ST(2), AUG_ST(3), AUG_ST(4), AUG_ST(5), AUG_ST(6), AUG_ST(7);
        AUG_ST(8), AUG_ST(9), AUG_ST(10), AUG_ST(11), AUG_ST(12), AUG_ST(13), AUG_ST(14), AUG_ST(15);
#undef AUG_LD
#undef AUG_ST
    }
}

/* out: register i = column x + i (rows 0-15 low, 16-31 high); after the rounds register j holds row j (low) and
 * row j + 16 (high) of columns x..x+15. */
AUG_AVX2_FN static void aug_strip_out_avx2(const uint8_t *cols, int64_t xw, uint8_t *o, int64_t lanes) {
    for (int64_t x = 0; x < xw; x += 16) {
        x = x + 16 <= xw ? x : xw - 16;
        const uint8_t *s = cols + x * lanes;
        uint8_t *d = o + x;
#define AUG_LD(i) __m256i a##i = _mm256_loadu_si256((const __m256i *)(s + i * lanes))
#define AUG_ST(i)                                                                                                      \
    _mm_storeu_si128((__m128i *)(d + i * xw), _mm256_castsi256_si128(a##i)),                                           \
        _mm_storeu_si128((__m128i *)(d + (i + 16) * xw), _mm256_extracti128_si256(a##i, 1))
        AUG_LD(0); AUG_LD(1); AUG_LD(2); AUG_LD(3); AUG_LD(4); AUG_LD(5); AUG_LD(6); AUG_LD(7);
        AUG_LD(8); AUG_LD(9); AUG_LD(10); AUG_LD(11); AUG_LD(12); AUG_LD(13); AUG_LD(14); AUG_LD(15);
        AUG_T32_ROUNDS;
        AUG_ST(0), AUG_ST(1), AUG_ST(2), AUG_ST(3), AUG_ST(4), AUG_ST(5), AUG_ST(6), AUG_ST(7);
        AUG_ST(8), AUG_ST(9), AUG_ST(10), AUG_ST(11), AUG_ST(12), AUG_ST(13), AUG_ST(14), AUG_ST(15);
#undef AUG_LD
#undef AUG_ST
    }
}
#endif

#ifdef AUG_VNNI
/* AVX-512 with VNNI: vpdpwssd does a pmaddwd and its add in one instruction (the same sums: no saturation), and
 * the vertical pass runs 64 lanes at a time (zmm: the unpacks and packs work within 128-bit quarters, as with
 * AVX2, so the two undo each other's order). The strip transposes stay AVX2's. Not seen by valgrind (no
 * AVX-512 there): callgrind counts the AVX2 copies. */
#define AUG_VNNI_FN __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")))

AUG_VNNI_FN AUG_INLINE __m256i aug_dot32_vnni(const uint8_t *in, int64_t step, int64_t n, const int32_t *wp, int prec) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i a0 = _mm256_set1_epi32(1 << (prec - 1)), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < n; k += 2, in += 2 * step) {
        __m256i p = _mm256_loadu_si256((const __m256i *)in);
        __m256i q = k + 1 < n ? _mm256_loadu_si256((const __m256i *)(in + step)) : zero;
        __m256i w = _mm256_set1_epi32(*wp++);
        __m256i lo = _mm256_unpacklo_epi8(p, q), hi = _mm256_unpackhi_epi8(p, q);
        a0 = _mm256_dpwssd_epi32(a0, _mm256_unpacklo_epi8(lo, zero), w);
        a1 = _mm256_dpwssd_epi32(a1, _mm256_unpackhi_epi8(lo, zero), w);
        a2 = _mm256_dpwssd_epi32(a2, _mm256_unpacklo_epi8(hi, zero), w);
        a3 = _mm256_dpwssd_epi32(a3, _mm256_unpackhi_epi8(hi, zero), w);
    }
    __m128i shift = _mm_cvtsi32_si128(prec);
    a0 = _mm256_sra_epi32(a0, shift), a1 = _mm256_sra_epi32(a1, shift);
    a2 = _mm256_sra_epi32(a2, shift), a3 = _mm256_sra_epi32(a3, shift);
    return _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
}

AUG_VNNI_FN AUG_INLINE __m512i aug_dot64_vnni(const uint8_t *in, int64_t step, int64_t n, const int32_t *wp, int prec) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i a0 = _mm512_set1_epi32(1 << (prec - 1)), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < n; k += 2, in += 2 * step) {
        __m512i p = _mm512_loadu_si512((const void *)in);
        __m512i q = k + 1 < n ? _mm512_loadu_si512((const void *)(in + step)) : zero;
        __m512i w = _mm512_set1_epi32(*wp++);
        __m512i lo = _mm512_unpacklo_epi8(p, q), hi = _mm512_unpackhi_epi8(p, q);
        a0 = _mm512_dpwssd_epi32(a0, _mm512_unpacklo_epi8(lo, zero), w);
        a1 = _mm512_dpwssd_epi32(a1, _mm512_unpackhi_epi8(lo, zero), w);
        a2 = _mm512_dpwssd_epi32(a2, _mm512_unpacklo_epi8(hi, zero), w);
        a3 = _mm512_dpwssd_epi32(a3, _mm512_unpackhi_epi8(hi, zero), w);
    }
    __m128i shift = _mm_cvtsi32_si128(prec);
    a0 = _mm512_sra_epi32(a0, shift), a1 = _mm512_sra_epi32(a1, shift);
    a2 = _mm512_sra_epi32(a2, shift), a3 = _mm512_sra_epi32(a3, shift);
    return _mm512_packus_epi16(_mm512_packs_epi32(a0, a1), _mm512_packs_epi32(a2, a3));
}

AUG_VNNI_FN static void aug_hcols_vnni(const uint8_t *strip, int64_t step, const AugTaps *tx, int64_t x0, int64_t x1,
                                       int64_t c0, uint8_t *res) {
    const int64_t *lo = tx->lo, *nn = tx->n, P = tx->P;
    const int32_t *wp = tx->wp;
    int prec = tx->prec;
    for (int64_t x = x0; x < x1; x++, res += AUG_ROWS)
        _mm256_storeu_si256((__m256i *)res, aug_dot32_vnni(strip + (lo[x] - c0) * step, step, nn[x], wp + x * P, prec));
}

/* A strip of 64 rows (aug_horizontal): each output's 64 lanes in one zmm dot product, res[(x - x0) * 64 + r]. */
AUG_VNNI_FN static void aug_hcols64_vnni(const uint8_t *strip, int64_t step, const AugTaps *tx, int64_t x0,
                                         int64_t x1, int64_t c0, uint8_t *res) {
    const int64_t *lo = tx->lo, *nn = tx->n, P = tx->P;
    const int32_t *wp = tx->wp;
    int prec = tx->prec;
    for (int64_t x = x0; x < x1; x++, res += 2 * AUG_ROWS)
        _mm512_storeu_si512((void *)res, aug_dot64_vnni(strip + (lo[x] - c0) * step, step, nn[x], wp + x * P, prec));
}

/* 64 columns at a time, then 32 (the last 32 overlapping the ones before), then AVX2's 16 and the scalar rest. */
AUG_VNNI_FN static void aug_vrow_vnni(const uint8_t *tmp, int64_t width, const AugTaps *ty, int64_t y, uint8_t *out) {
    const int32_t *wp = ty->wp + y * ty->P;
    int64_t n = ty->n[y], x = 0;
    int prec = ty->prec;
    for (; x + 64 <= width; x += 64) _mm512_storeu_si512((void *)(out + x), aug_dot64_vnni(tmp + x, width, n, wp, prec));
    for (; width >= 32 && x < width; x += 32) {
        x = x + 32 <= width ? x : width - 32;
        _mm256_storeu_si256((__m256i *)(out + x), aug_dot32_vnni(tmp + x, width, n, wp, prec));
    }
    for (; width >= 16 && x < width; x += 16) {
        x = x + 16 <= width ? x : width - 16;
        _mm_storeu_si128((__m128i *)(out + x), aug_dot16_avx2(tmp + x, width, n, wp, prec));
    }
    if (x < width) aug_vrow_c(tmp, width, ty, y, out);
}
#endif

/* The dot products and strip transposes this CPU runs best; hcols64: the horizontal dot products of a strip of
 * 64 rows (64 lanes), NULL where the CPU has no 64-byte vectors (strips of 32 rows only). */
typedef struct {
    void (*hcols)(const uint8_t *, int64_t, const AugTaps *, int64_t, int64_t, int64_t, uint8_t *);
    void (*vrow)(const uint8_t *, int64_t, const AugTaps *, int64_t, uint8_t *);
    void (*strip_in)(const uint8_t *, int64_t, int64_t, uint8_t *, int64_t);
    void (*strip_out)(const uint8_t *, int64_t, uint8_t *, int64_t);
    void (*hcols64)(const uint8_t *, int64_t, const AugTaps *, int64_t, int64_t, int64_t, uint8_t *);
} AugOps;

static AugOps aug_ops(void) {
#ifdef AUG_VNNI
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
        return (AugOps){aug_hcols_vnni, aug_vrow_vnni, aug_strip_in_avx2, aug_strip_out_avx2, aug_hcols64_vnni};
#endif
#ifdef AUG_AVX2
    if (__builtin_cpu_supports("avx2"))
        return (AugOps){aug_hcols_avx2, aug_vrow_avx2, aug_strip_in_avx2, aug_strip_out_avx2, NULL};
#endif
#ifdef AUG_SSE2
    return (AugOps){aug_hcols_sse2, aug_vrow_sse2, aug_strip_in_base, aug_strip_out_base, NULL};
#else
    return (AugOps){aug_hcols_c, aug_vrow_c, aug_strip_in_base, aug_strip_out_base, NULL};
#endif
}

/* Where one image's passes run: output rows y0..y1 and columns x0..x1 of the window inside the resized image,
 * reading the box's rows r_lo..r_hi (those the vertical taps of y0..y1 reach) into an intermediate xw wide. */
typedef struct {
    int64_t y0, y1, x0, x1, r_lo, r_hi, xw;
} AugSpan;

/* The stored image comes from memory (the map), and a strip reads 32 rows at once: a stride the hardware
 * prefetchers do not follow, so the loads of a strip wait on memory (half the time of a cold image). AugPf
 * walks the lines the horizontal passes will read, in their order (plane by plane, row by row, span bytes of a
 * row from base + plane * pstride + row * sy), and aug_pf asks for the next few: a strip's worth while the strip
 * before is resized, in small steps between the dot products (a burst of prefetches would wait on the fill
 * buffers as the loads do), and the next plane's first strips during a plane's vertical pass. Asked for into
 * the outer caches (locality 1, prefetcht2): a strip is read once, a strip ahead, from L2. (Measured here, no
 * faster: a lead of 2-4 strips, or the whole next plane during a vertical pass; none at all is 15% slower.) A prefetch is a
 * hint: it never faults, so the line addresses are plain integers. */
typedef struct {
    uintptr_t base, at, end; /* the next line's address, the current row's last line */
    int64_t sy, pstride, span, r0, r1, planes, row, plane, strip_lines;
} AugPf;

static void aug_pf_init(AugPf *f, const uint8_t *base, int64_t sy, int64_t pstride, int64_t planes, int64_t r0,
                        int64_t r1, int64_t span) {
    f->base = (uintptr_t)base, f->sy = sy, f->pstride = pstride, f->planes = r0 < r1 && span > 0 ? planes : 0;
    f->span = span, f->r0 = r0, f->r1 = r1, f->row = r0, f->plane = 0;
    f->strip_lines = AUG_ROWS * (span / 64 + 2);
    f->at = (f->base + (uintptr_t)(r0 * sy)) & ~(uintptr_t)63;
    f->end = (f->base + (uintptr_t)(r0 * sy + span - 1)) & ~(uintptr_t)63;
}

static inline void aug_pf(AugPf *f, int64_t lines) {
    for (; lines > 0 && f->plane < f->planes; lines--) {
        __builtin_prefetch((const void *)f->at, 0, 1);
        if ((f->at += 64) <= f->end) continue;
        if (++f->row == f->r1) f->row = f->r0, f->plane++;
        uintptr_t row = f->base + (uintptr_t)(f->plane * f->pstride + f->row * f->sy);
        f->at = row & ~(uintptr_t)63, f->end = (row + (uintptr_t)f->span - 1) & ~(uintptr_t)63;
    }
}

/* The horizontal pass of the box's rows [r_lo, r_hi) for nch channels into out (channel ch's rows at
 * out + ch * (r_hi - r_lo) * xw). src: the box's top-left pixel, pixel step sx, row step sy; channel ch at
 * src + ch. 32 rows at a time (64 while 64 remain, where ops has hcols64), the last 32 overlapping the ones
 * before (the same values written twice): the strip's bytes are transposed into columns of `lanes` bytes
 * (strip[b * lanes + r] = byte b of row r; with sx == nch the pixels of a row are contiguous bytes and go by
 * 16 x 16 blocks, the last block of a row overlapping too), so each output's taps are a dot product of 32 (64)
 * lanes; the outputs (cols, column-major) are transposed back into the rows of out. Fewer than 32 rows in all:
 * one strip gathered byte by byte, its other lanes unused. strip holds the box's columns of 64 rows, cols ow. */
static void aug_horizontal(const AugOps *ops, const uint8_t *src, int64_t sx, int64_t sy, int64_t nch,
                           const AugSpan *sp, const AugTaps *tx, uint8_t *strip, uint8_t *cols, uint8_t *out,
                           AugPf *pf) {
    int64_t x0 = sp->x0, x1 = sp->x1, xw = sp->xw, rows = sp->r_hi - sp->r_lo;
    int64_t c0, c1;
    aug_cols(tx, x0, x1, &c0, &c1);
    int64_t bytes = (c1 - c0) * nch;
    const uint8_t *first = src + c0 * sx; /* column c0 of the box's row 0 */
    int64_t step = 1 + pf->strip_lines / (nch * ((xw + 31) / 32)); /* lines asked for per 32 outputs of 32 rows */
    for (int64_t r0 = sp->r_lo, R = 0; r0 < sp->r_hi; r0 += R) {
        int wide = ops->hcols64 && sp->r_hi - r0 >= 2 * AUG_ROWS && sx == nch && bytes >= 16 && xw >= 16;
        int64_t lanes = wide ? 2 * AUG_ROWS : AUG_ROWS;
        R = wide ? lanes : rows < AUG_ROWS ? rows : AUG_ROWS;
        r0 = r0 + R <= sp->r_hi ? r0 : sp->r_hi - R;
        const uint8_t *row0 = first + r0 * sy;
        if (R >= AUG_ROWS && sx == nch && bytes >= 16) {
            ops->strip_in(row0, sy, bytes, strip, lanes);
            if (wide) ops->strip_in(row0 + AUG_ROWS * sy, sy, bytes, strip + AUG_ROWS, lanes);
        } else {
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < c1 - c0; c++)
                    for (int64_t ch = 0; ch < nch; ch++)
                        strip[(c * nch + ch) * lanes + r] = row0[r * sy + c * sx + ch];
        }
        for (int64_t ch = 0; ch < nch; ch++) {
            uint8_t *o = out + (ch * rows + r0 - sp->r_lo) * xw;
            for (int64_t x = x0; x < x1; x += 32) { /* the next strip's lines asked for between the outputs */
                int64_t x2 = x + 32 < x1 ? x + 32 : x1;
                aug_pf(pf, wide ? 2 * step : step);
                if (wide)
                    ops->hcols64(strip + ch * lanes, nch * lanes, tx, x, x2, c0, cols + (x - x0) * lanes);
                else
                    ops->hcols(strip + ch * lanes, nch * lanes, tx, x, x2, c0, cols + (x - x0) * lanes);
            }
            if (R >= AUG_ROWS && xw >= 16) {
                ops->strip_out(cols, xw, o, lanes);
                if (wide) ops->strip_out(cols + AUG_ROWS, xw, o + AUG_ROWS * xw, lanes);
            } else {
                for (int64_t r = 0; r < R; r++)
                    for (int64_t x = 0; x < xw; x++) o[r * xw + x] = cols[x * lanes + r];
            }
        }
    }
}

/* The image's rows [r_lo, r_hi) of nch channels (as aug_horizontal) into out without a horizontal resize. */
static void aug_copy_rows(const uint8_t *src, int64_t sx, int64_t sy, int64_t nch, const AugSpan *sp, uint8_t *out) {
    int64_t rows = sp->r_hi - sp->r_lo;
    for (int64_t ch = 0; ch < nch; ch++)
        for (int64_t r = sp->r_lo; r < sp->r_hi; r++) {
            uint8_t *o = out + (ch * rows + r - sp->r_lo) * sp->xw;
            const uint8_t *in = src + r * sy + sp->x0 * sx + ch;
            if (sx == 1)
                memcpy(o, in, (size_t)sp->xw);
            else
                for (int64_t x = 0; x < sp->xw; x++) o[x] = in[x * sx];
        }
}

/* One channel's intermediate (tmp: rows r_lo..r_hi, xw wide) through the vertical pass into plane (oh x ow,
 * zero outside the resized image): s->plane, or the channel's rows of the batch themselves. */
static void aug_vertical(const AugOps *ops, const uint8_t *tmp, const AugSpan *sp, const int64_t b[8],
                         const AugTaps *ty, const AugPlan *p, uint8_t *plane, AugPf *pf) {
    int64_t oy = b[6], ox = b[7], xw = sp->xw;
    if (sp->y0 != oy || sp->x0 != ox || sp->y1 != oy + p->oh || sp->x1 != ox + p->ow)
        memset(plane, 0, (size_t)(p->oh * p->ow));
    if (sp->y0 >= sp->y1 || sp->x0 >= sp->x1) return; /* the window misses the resized image */
    int64_t step = 1 + 2 * pf->strip_lines / (sp->y1 - sp->y0); /* the next plane's first two strips */
    for (int64_t y = sp->y0; y < sp->y1; y++) {
        aug_pf(pf, step);
        uint8_t *out = plane + (y - oy) * p->ow + (sp->x0 - ox);
        if (ty)
            ops->vrow(tmp + (ty->lo[y] - sp->r_lo) * xw, xw, ty, y, out);
        else
            memcpy(out, tmp + (y - sp->r_lo) * xw, (size_t)xw);
    }
}

/* aug_write's loops are plain C that gcc vectorizes; target_clones adds an AVX2 copy, chosen at load time (ifunc),
 * where the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define AUG_CLONES_O3 __attribute__((target_clones("avx2", "default"), optimize("O3"))) /* reversed copies */
#else
#define AUG_CLONES_O3
#endif

/* s->plane of channel c into dest: flipped or not, through the table or not, CHW or channels-last. */
AUG_CLONES_O3
static void aug_write(const AugPlan *p, const uint8_t *plane, int64_t c, int64_t C, int flip, uint8_t *dest) {
    int64_t oh = p->oh, ow = p->ow, size = oh * ow;
    if (p->kind == 0 && !p->channels_last) {
        uint8_t *d = dest + c * size;
        if (!flip) {
            memcpy(d, plane, (size_t)size);
            return;
        }
        for (int64_t y = 0; y < oh; y++)
            for (int64_t x = 0; x < ow; x++) d[y * ow + ow - 1 - x] = plane[y * ow + x];
        return;
    }
    for (int64_t y = 0; y < oh; y++) {
        const uint8_t *in = plane + y * ow;
        for (int64_t x = 0; x < ow; x++) {
            int64_t dx = flip ? ow - 1 - x : x;
            int64_t k = p->channels_last ? (y * ow + dx) * C + c : c * size + y * ow + dx;
            if (p->kind == 0)
                dest[k] = in[x];
            else if (p->kind == 1)
                memcpy(dest + 4 * k, p->lut + 4 * (c * 256 + in[x]), 4);
            else
                memcpy(dest + 2 * k, p->lut + 2 * (c * 256 + in[x]), 2);
        }
    }
}

/* The image (H x W x C, HWC or CHW) of one row into dest: box, resize, window, flip, table, layout. */
static int aug_image(const uint8_t *src, int64_t H, int64_t W, int64_t C, int hwc, uint64_t index, const AugPlan *p,
                     AugScratch *s, uint8_t *dest) {
    int64_t b[8];
    aug_box(p, H, W, aug_stream(p->seed, p->epoch, index, (uint64_t)p->rrc_at), b);
    int flip = p->flip_p > 0 && aug_uniform(aug_stream(p->seed, p->epoch, index, (uint64_t)p->flip_at), 0) < p->flip_p;
    if (b[4] > AUG_MAX_SIDE || b[5] > AUG_MAX_SIDE) return FILL_OTHER; /* the torch path does it (slowly) */
    if (b[2] < 1 || b[3] < 1 || b[0] < 0 || b[1] < 0 || b[0] > H - b[2] || b[1] > W - b[3] || b[4] < 1 || b[5] < 1)
        return FILL_OTHER; /* a box outside the image (no checked plan gives one): never read past it */
    AugTaps tx = {0}, ty = {0};
    int bad = (b[5] != b[3] && aug_taps(b[3], b[5], &tx) < 0) || (b[4] != b[2] && aug_taps(b[2], b[4], &ty) < 0);
    /* HWC with few channels: one strip of interleaved pixels gives every channel's horizontal pass, so the
     * intermediate holds them all; otherwise (CHW, or many channels) one channel at a time. */
    int fuse = hwc && C <= 4;
    int64_t nch = fuse ? C : 1, sx = hwc ? C : 1, sy = hwc ? W * C : W;
    size_t need = (size_t)(b[2] * p->ow * nch); /* the rows a channel's vertical pass reads, at most the box's */
    if (!bad && need > s->tmp_size) {
        free(s->tmp);
        s->tmp = malloc(need);
        s->tmp_size = s->tmp ? need : 0;
        bad = s->tmp == NULL;
    }
    size_t strip = (size_t)(b[3] * nch * 2 * AUG_ROWS); /* the box's columns, 64 rows of them */
    if (!bad && strip > s->strip_size) {
        free(s->strip);
        s->strip = calloc(strip, 1); /* lanes past a strip's last row are computed, never used: initialized */
        s->strip_size = s->strip ? strip : 0;
        bad = s->strip == NULL;
    }
    if (bad) {
        aug_taps_free(&tx), aug_taps_free(&ty);
        return AUG_NOMEM;
    }
    AugOps ops = aug_ops();
    if (flip && tx.w && b[7] == 0 && b[5] == p->ow) { /* the window is the whole resized width: flip by the taps */
        aug_taps_reverse(&tx, b[5]);
        flip = 0;
    }
    const AugTaps *px = tx.w ? &tx : NULL, *py = ty.w ? &ty : NULL;
    int64_t top = b[0], left = b[1], rh = b[4], rw = b[5], oy = b[6], ox = b[7];
    AugSpan sp;
    sp.y0 = oy > 0 ? oy : 0, sp.y1 = oy + p->oh < rh ? oy + p->oh : rh;
    sp.x0 = ox > 0 ? ox : 0, sp.x1 = ox + p->ow < rw ? ox + p->ow : rw;
    int empty = sp.y0 >= sp.y1 || sp.x0 >= sp.x1; /* the window misses the resized image: zeros */
    sp.xw = sp.x1 - sp.x0;
    sp.r_lo = empty ? 0 : py ? py->lo[sp.y0] : sp.y0;
    sp.r_hi = empty ? 0 : py ? py->lo[sp.y1 - 1] + py->n[sp.y1 - 1] : sp.y1;
    AugPf pf; /* the lines of the box's rows r_lo..r_hi the horizontal passes read, every plane */
    int64_t c0 = empty ? 0 : sp.x0, c1 = empty ? 0 : sp.x1;
    if (!empty && px) aug_cols(px, sp.x0, sp.x1, &c0, &c1);
    aug_pf_init(&pf, src + top * sy + (left + c0) * sx, sy, fuse ? 0 : H * W, fuse || !hwc ? (fuse ? 1 : C) : 0,
                sp.r_lo, sp.r_hi, (c1 - c0 - 1) * sx + nch);
    aug_pf(&pf, (ops.hcols64 ? 2 : 1) * pf.strip_lines); /* the first strip's (of 64 rows with hcols64) */
    for (int64_t c = 0; c < C; c++) {
        const uint8_t *box = (hwc ? src + c : src + c * H * W) + top * sy + left * sx;
        if (!empty && (!fuse || c == 0)) {
            if (px)
                aug_horizontal(&ops, box, sx, sy, nch, &sp, px, s->strip, s->cols, s->tmp, &pf);
            else
                aug_copy_rows(box, sx, sy, nch, &sp, s->tmp);
        }
        const uint8_t *tmp = s->tmp + (fuse ? c * (sp.r_hi - sp.r_lo) * sp.xw : 0);
        /* uint8 CHW unflipped: the plane is the channel's slice of dest, written in place (no copy) */
        int direct = p->kind == 0 && !p->channels_last && !flip;
        aug_vertical(&ops, tmp, &sp, b, py, p, direct ? dest + c * p->oh * p->ow : s->plane, &pf);
        if (!direct) aug_write(p, s->plane, c, C, flip, dest);
    }
    aug_taps_free(&tx), aug_taps_free(&ty);
    return FILL_OK;
}

/* The template of a call: the first value's signature with its image's byte count and dims left out. */
typedef struct {
    const uint8_t *key;
    uint64_t klen, at, field, channels, struct_size, value_size, img_nbytes, scalars_at, scalar_size;
    int hwc, autolayout;
    Py_ssize_t nfields;
    uint64_t pos[MAX_FIELDS], nbytes[MAX_FIELDS];
} AugShape;

/* Checks and copies of one value, then its image: FILL_* or AUG_* status. */
static int aug_row(const Map *m, const uint8_t *rec, const AugShape *t, const AugPlan *p, Py_buffer *out,
                   uint8_t *scalars, uint64_t j, AugScratch *s) {
    uint64_t offset = le64(rec), size = le64(rec + 8), index = le64(rec + 16);
    int check = rec[24];
    if (offset > m->len || size > m->len - offset) return FILL_SPAN;
    const uint8_t *v = m->base + offset;
    uint64_t at = t->at, klen = t->klen;
    if (size < 25 + klen || memcmp(v, "LMC\x02", 4) || v[24] != 0xC1 || (uint64_t)le16(v + 25) + 2 != klen ||
        memcmp(v + 25, t->key, at + 3) || memcmp(v + 25 + at + 35, t->key + at + 35, klen - at - 35))
        return FILL_OTHER;
    uint64_t ssize = le32(v + 4);
    uint64_t hashed = 24 + ssize < size ? ssize : size - 24;
    if (xxh3_64(v + 24, hashed, index) != le64(v + 8)) return FILL_STRUCTURE;
    if (ssize != t->struct_size) return FILL_LENGTHS;
    const uint8_t *dims = v + 25 + at + 11;
    uint64_t nbytes = le64(v + 25 + at + 3), d0 = le64(dims), d1 = le64(dims + 8), d2 = le64(dims + 16);
    int hwc = t->autolayout ? (d2 <= 4 && d0 > 4) : t->hwc;
    uint64_t C = hwc ? d2 : d0, H = hwc ? d0 : d1, W = hwc ? d1 : d2, HW, HWC;
    if (hwc != t->hwc || C != t->channels) return FILL_OTHER; /* another kind of image: the torch path */
    if (!H || !W) return nbytes ? AUG_SHAPE : FILL_OTHER;     /* an empty image: the torch path says so */
    if (H > INT32_MAX || W > INT32_MAX || __builtin_mul_overflow(H, W, &HW) || __builtin_mul_overflow(HW, C, &HWC) ||
        HWC != nbytes || nbytes > size)
        return AUG_SHAPE;
    if (t->value_size - t->img_nbytes + nbytes != size) return FILL_LENGTHS;
    uint64_t digest = index;
    for (Py_ssize_t f = 0; f < t->nfields; f++) {
        uint64_t pos = (uint64_t)f > t->field ? t->pos[f] - t->img_nbytes + nbytes : t->pos[f];
        if ((uint64_t)f == t->field) {
            if (check) digest = xxh3_64(v + pos, nbytes, digest);
            continue;
        }
        uint8_t *row = (uint8_t *)out[f].buf + j * t->nbytes[f];
        if (check) digest = xxh3_64_copy(row, v + pos, t->nbytes[f], digest);
        else memcpy(row, v + pos, t->nbytes[f]);
    }
    if (check && digest != le64(v + 16)) return FILL_DATA;
    if (t->scalar_size) memcpy(scalars + j * t->scalar_size, v + t->scalars_at, t->scalar_size);
    size_t esize = p->kind == 0 ? 1 : p->kind == 1 ? 4 : 2;
    uint8_t *dest = (uint8_t *)out[t->field].buf + j * (uint64_t)(p->oh * p->ow) * C * esize;
    return aug_image(v + t->pos[t->field], (int64_t)H, (int64_t)W, (int64_t)C, hwc, index, p, s, dest);
}

PyDoc_STRVAR(py_augment_doc,
             "augment(base, length, spans, lo, hi, shape, fields, dests, scalar_dest, params, /) -> (status, row)\n\n"
             "fill's copy of spans rows lo:hi with the image field augmented (lmdbcache/loader/_fused.py):\n"
             "``shape`` is (key, at, field, channels, hwc, auto, struct_size, value_size, image_nbytes, scalars_at,\n"
             "scalar_size) of the first value (its image's byte count and dims left out of the comparison),\n"
             "``fields`` its ((pos, nbytes), ...), ``dests`` a writable buffer per tensor field (the image's holds\n"
             "the output rows), ``params`` (seed, epoch, mode, oh, ow, scale0, scale1, log_ratio0, log_ratio1,\n"
             "ratio0, ratio1, resize, rh, rw, rrc_at, flip_p, flip_at, kind, lut, channels_last). status as fill's,\n"
             "6: an image's stored shape does not match its bytes, 8: out of memory.");

static int aug_parse(PyObject *shape, PyObject *fields, PyObject *params, AugShape *t, AugPlan *p, Py_buffer *key,
                     Py_buffer *lut) {
    unsigned long long at, field, channels, ss, vs, nb, sat, ssz;
    int hwc, autolayout;
    if (!PyArg_ParseTuple(shape, "y*KKKiiKKKKK:augment shape", key, &at, &field, &channels, &hwc, &autolayout, &ss,
                          &vs, &nb, &sat, &ssz))
        return -1;
    PyObject *seed, *epoch;
    long long oh, ow, resize, rh, rw, rrc_at, flip_at;
    if (!PyArg_ParseTuple(params, "OOiLLddddddLLLLdLiy*i:augment params", &seed, &epoch, &p->mode, &oh, &ow, &p->s0,
                          &p->s1, &p->lr0, &p->lr1, &p->r0, &p->r1, &resize, &rh, &rw, &rrc_at, &p->flip_p, &flip_at,
                          &p->kind, lut, &p->channels_last)) {
        PyBuffer_Release(key);
        return -1;
    }
    p->seed = PyLong_AsUnsignedLongLongMask(seed), p->epoch = PyLong_AsUnsignedLongLongMask(epoch);
    p->oh = oh, p->ow = ow, p->resize = resize, p->rh = rh, p->rw = rw, p->rrc_at = rrc_at, p->flip_at = flip_at;
    p->lut = (const uint8_t *)lut->buf;
    t->key = (const uint8_t *)key->buf, t->klen = (uint64_t)key->len, t->at = at, t->field = field;
    t->channels = channels, t->hwc = hwc, t->autolayout = autolayout, t->struct_size = ss, t->value_size = vs;
    t->img_nbytes = nb, t->scalars_at = sat, t->scalar_size = ssz;
    t->nfields = PyTuple_Check(fields) ? PyTuple_GET_SIZE(fields) : -1;
    const char *why = NULL;
    if (PyErr_Occurred())
        why = NULL;
    else if (t->nfields < 1 || t->nfields > MAX_FIELDS || field >= (uint64_t)t->nfields)
        why = "the image field is not one of the fields";
    else if (at + 35 > t->klen || t->key[at] != 'T' || t->key[at + 1] != 1 || t->key[at + 2] != 3)
        why = "the image item is not a 3-D uint8 tensor of the signature";
    else if (oh < 1 || ow < 1 || oh > AUG_MAX_SIDE || ow > AUG_MAX_SIDE || channels < 1 || channels > 4096 ||
             p->kind < 0 || p->kind > 2 || resize < 0 || resize > AUG_MAX_SIDE || rh < 0 || rw < 0 ||
             rh > AUG_MAX_SIDE || rw > AUG_MAX_SIDE || (p->mode != 0 && p->mode != 1) || rrc_at < 0 || flip_at < 0)
        why = "the plan is out of range";
    else if (!(p->s0 > 0 && p->s0 <= p->s1 && isfinite(p->s1) && p->r0 > 0 && p->r0 <= p->r1 && isfinite(p->r1) &&
               isfinite(p->lr0) && isfinite(p->lr1) && p->lr0 <= p->lr1 && p->flip_p >= 0 && p->flip_p <= 1))
        why = "the plan's scale, ratio or flip probability is not finite and in range";
    else if (p->kind && (uint64_t)lut->len != channels * 256 * (p->kind == 1 ? 4 : 2))
        why = "the Normalize table is not 256 values per channel";
    for (Py_ssize_t f = 0; !why && !PyErr_Occurred() && f < t->nfields; f++) {
        PyObject *item = PyTuple_GET_ITEM(fields, f);
        if (!PyArg_ParseTuple(item, "KK", &t->pos[f], &t->nbytes[f])) break;
    }
    /* The template's fields must tile its value, as fill's plan (so every row's shifted fields do too). */
    uint64_t end = 24 + ss;
    int tiled = !why && !PyErr_Occurred() && vs >= 24 && ss <= vs - 24 && t->klen + 25 <= vs && ssz <= vs &&
                sat <= vs - ssz && t->nbytes[field] == nb;
    for (Py_ssize_t f = 0; tiled && f < t->nfields; f++) {
        tiled = t->pos[f] == end && t->nbytes[f] <= vs - end;
        end += t->nbytes[f];
    }
    if (!why && !PyErr_Occurred() && (!tiled || end != vs)) why = "the fields do not tile the value";
    if (why || PyErr_Occurred()) {
        if (why) PyErr_Format(PyExc_ValueError, "augment: %s", why);
        PyBuffer_Release(key), PyBuffer_Release(lut);
        return -1;
    }
    return 0;
}

static PyObject *py_augment(PyObject *self, PyObject *args) {
    unsigned long long base, len;
    Py_ssize_t lo, hi;
    PyObject *blob, *shape, *fields, *dests, *scalar_obj, *params;
    Map m;
    if (!PyArg_ParseTuple(args, "KKO!nnO!OO!OO!:augment", &base, &len, &PyByteArray_Type, &blob, &lo, &hi,
                          &PyTuple_Type, &shape, &fields, &PyList_Type, &dests, &scalar_obj, &PyTuple_Type, &params))
        return NULL;
    if (map_from(&m, base, len, 4096) < 0) return NULL;
    AugShape t;
    AugPlan p;
    Py_buffer key, lut, out[MAX_FIELDS], scalars = {0}, held = {0};
    PyObject *held_dests = NULL;
    if (aug_parse(shape, fields, params, &t, &p, &key, &lut) < 0) return NULL;
    Py_ssize_t got = 0;
    int ok = 0;
    size_t esize = p.kind == 0 ? 1 : p.kind == 1 ? 4 : 2;
    if (t.nfields != PyList_GET_SIZE(dests) || lo < 0 || lo > hi || hi > PyByteArray_GET_SIZE(blob) / SPAN) {
        PyErr_SetString(PyExc_ValueError, "augment: fields, destinations and rows do not agree");
        goto done;
    }
    /* A tuple of the destinations, as fill_prepare: a buffer export can run Python code that edits the list. */
    if ((held_dests = PyList_AsTuple(dests)) == NULL) goto done;
    for (got = 0; got < t.nfields; got++) {
        PyObject *dest = PyTuple_GET_ITEM(held_dests, got);
        if (PyObject_GetBuffer(dest, &out[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        uint64_t row = (uint64_t)got == t.field ? (uint64_t)(p.oh * p.ow) * t.channels * esize : t.nbytes[got];
        if (row && (uint64_t)out[got].len / row < (uint64_t)hi) { /* every row written lies in its buffer */
            PyErr_SetString(PyExc_ValueError, "augment: a destination buffer is shorter than its rows");
            got++;
            goto done;
        }
    }
    if (PyObject_GetBuffer(scalar_obj, &scalars, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (t.scalar_size && (uint64_t)scalars.len / t.scalar_size < (uint64_t)hi) {
        PyErr_SetString(PyExc_ValueError, "augment: the scalar staging buffer is shorter than its rows");
        goto done;
    }
    if (PyObject_GetBuffer(blob, &held, PyBUF_SIMPLE) < 0) goto done; /* the spans cannot be resized meanwhile */
    ok = 1;
done:
    Py_XDECREF(held_dests); /* each export holds its own reference to its object */
    if (!ok) {
        for (Py_ssize_t f = 0; f < got; f++) PyBuffer_Release(&out[f]);
        if (scalars.obj) PyBuffer_Release(&scalars);
        PyBuffer_Release(&key), PyBuffer_Release(&lut);
        return NULL;
    }
    AugScratch s = {0};
    int status = FILL_OK;
    Py_ssize_t j = lo;
    Py_BEGIN_ALLOW_THREADS
    s.plane = malloc((size_t)(p.oh * p.ow));
    s.cols = malloc((size_t)(p.ow * 2 * AUG_ROWS)); /* a strip's outputs (up to 64 rows), column-major */
    if (!s.plane || !s.cols) status = AUG_NOMEM;
    for (; status == FILL_OK && j < hi; j++) {
        status = aug_row(&m, (const uint8_t *)held.buf + j * SPAN, &t, &p, out, (uint8_t *)scalars.buf, (uint64_t)j, &s);
        if (status != FILL_OK) break;
    }
    free(s.plane), free(s.cols), free(s.tmp), free(s.strip);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&held);
    for (Py_ssize_t f = 0; f < t.nfields; f++) PyBuffer_Release(&out[f]);
    PyBuffer_Release(&scalars);
    PyBuffer_Release(&key), PyBuffer_Release(&lut);
    if (status == AUG_NOMEM) return PyErr_NoMemory();
    return Py_BuildValue("in", status, status ? j : (Py_ssize_t)0);
}
