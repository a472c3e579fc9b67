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

/* (top, left, h, w, rh, rw, oy, ox) of augment.box_of, the same doubles in the same order. */
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
            h = (int64_t)rint((double)W / p->r0);
        else if (in_ratio > p->r1)
            w = (int64_t)rint((double)H * p->r1);
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

/* One dimension's taps: output i reads n[i] inputs from lo[i] with int16 weights w[i*K ...] of precision prec. */
typedef struct {
    int64_t *lo, *n;
    int16_t *w;
    int64_t K;
    int prec;
} AugTaps;

static void aug_taps_free(AugTaps *t) {
    free(t->lo), free(t->n), free(t->w);
    t->lo = t->n = NULL, t->w = NULL;
}

static inline double aug_filter(double x) {
    x = x < 0 ? -x : x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* torch's antialiased bilinear weights from in to out samples (align_corners=False), as int16. */
static int aug_taps(int64_t in, int64_t out, AugTaps *t) {
    double scale = (double)in / (double)out;
    double support = scale >= 1.0 ? scale : 1.0;
    double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    int64_t K = (int64_t)ceil(support) * 2 + 1;
    t->K = K;
    t->lo = malloc(sizeof(int64_t) * out), t->n = malloc(sizeof(int64_t) * out);
    t->w = calloc((size_t)(out * K), sizeof(int16_t));
    double *wd = calloc((size_t)(out * K), sizeof(double));
    if (!t->lo || !t->n || !t->w || !wd) {
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
    for (int64_t k = 0; k < out * K; k++) {
        double v = wd[k] * (double)(1 << prec);
        t->w[k] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
    }
    free(wd);
    return 0;
}

typedef struct {
    uint8_t *tmp, *plane, *strip;
    size_t tmp_size, strip_size;
} AugScratch;

/* The loops below are written in fixed-length blocks (16 or 32 lanes) that gcc turns into vector code at -O2;
 * target_clones adds an AVX2 copy of each, chosen at load time (ifunc), where the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define AUG_CLONES __attribute__((target_clones("avx2", "default")))
#define AUG_CLONES_O3 __attribute__((target_clones("avx2", "default"), optimize("O3"))) /* reversed copies */
#else
#define AUG_CLONES
#define AUG_CLONES_O3
#endif
#define AUG_ROWS 16 /* rows of a horizontal strip */
#define AUG_COLS 32 /* columns of a vertical block */

static inline uint8_t aug_clip(int32_t v, int prec) {
    v >>= prec;
    v = v < 0 ? 0 : v; /* two selects, each a vector min or max */
    v = v > 255 ? 255 : v;
    return (uint8_t)v;
}

/* A 16 x 16 block of bytes transposed: 4 rounds of interleaving row i with row i + 8 (SSE2, in every x86-64). */
static inline void aug_t16(const uint8_t *src, int64_t sstride, uint8_t *dst, int64_t dstride) {
#ifdef __SSE2__
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = _mm_loadu_si128((const __m128i *)(src + i * sstride));
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 8; i++) {
            b[2 * i] = _mm_unpacklo_epi8(a[i], a[i + 8]);
            b[2 * i + 1] = _mm_unpackhi_epi8(a[i], a[i + 8]);
        }
        memcpy(a, b, sizeof(a));
    }
    for (int i = 0; i < 16; i++) _mm_storeu_si128((__m128i *)(dst + i * dstride), a[i]);
#else
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) dst[j * dstride + i] = src[i * sstride + j];
#endif
}

/* The horizontal pass of the box's rows [r_lo, r_hi) (src: the box's top-left pixel, steps sx and sy) into
 * out (xw = x1 - x0 wide), 16 rows at a time: the strip's columns are first gathered into 16-byte groups (a
 * transpose, by 16 x 16 blocks where it can), so each output column's taps run over 16 rows at once; the
 * results of 16 columns are transposed back into the rows of out. */
AUG_CLONES
static void aug_horizontal(const uint8_t *src, int64_t sx, int64_t sy, int64_t r_lo, int64_t r_hi, const AugTaps *tx,
                           int64_t x0, int64_t x1, uint8_t *strip, uint8_t *out) {
    int64_t xw = x1 - x0, c0 = tx->lo[x0], c1 = tx->lo[x1 - 1] + tx->n[x1 - 1];
    int32_t init = 1 << (tx->prec - 1);
    int prec = tx->prec;
    uint8_t block[16 * AUG_ROWS];
    for (int64_t r0 = r_lo; r0 < r_hi; r0 += AUG_ROWS) {
        int64_t R = r_hi - r0 < AUG_ROWS ? r_hi - r0 : AUG_ROWS;
        int64_t c = c0;
        if (R == AUG_ROWS && sx == 1)
            for (; c + 16 <= c1; c += 16) aug_t16(src + r0 * sy + c, sy, strip + (c - c0) * AUG_ROWS, AUG_ROWS);
        for (int64_t r = 0; r < R; r++) {
            const uint8_t *row = src + (r0 + r) * sy;
            for (int64_t cc = c; cc < c1; cc++) strip[(cc - c0) * AUG_ROWS + r] = row[cc * sx];
        }
        for (int64_t x = x0; x < x1; x++) {
            int32_t acc[AUG_ROWS];
            for (int r = 0; r < AUG_ROWS; r++) acc[r] = init;
            const uint8_t *in = strip + (tx->lo[x] - c0) * AUG_ROWS;
            const int16_t *w = tx->w + x * tx->K;
            for (int64_t k = 0; k < tx->n[x]; k++) {
                int32_t wk = w[k];
                for (int r = 0; r < AUG_ROWS; r++) acc[r] += wk * in[k * AUG_ROWS + r];
            }
            uint8_t *res = block + ((x - x0) % 16) * AUG_ROWS;
            for (int r = 0; r < AUG_ROWS; r++) res[r] = aug_clip(acc[r], prec);
            int64_t first = x - (x - x0) % 16; /* the block's first column */
            if ((x - x0) % 16 == 15 && R == AUG_ROWS) {
                aug_t16(block, AUG_ROWS, out + (r0 - r_lo) * xw + (first - x0), xw);
            } else if ((x - x0) % 16 == 15 || x == x1 - 1) {
                for (int64_t xx = first; xx <= x; xx++)
                    for (int64_t r = 0; r < R; r++) out[(r0 - r_lo + r) * xw + (xx - x0)] = block[(xx - first) * AUG_ROWS + r];
            }
        }
    }
}

/* One output row of the vertical pass: n rows of tmp (width wide) weighted by w, 32 columns at a time. */
AUG_CLONES
static void aug_vertical(const uint8_t *tmp, int64_t width, const int16_t *w, int64_t n, int prec, uint8_t *out) {
    int32_t init = 1 << (prec - 1);
    int64_t x = 0;
    for (; x + AUG_COLS <= width; x += AUG_COLS) {
        int32_t acc[AUG_COLS];
        for (int i = 0; i < AUG_COLS; i++) acc[i] = init;
        for (int64_t k = 0; k < n; k++) {
            const uint8_t *in = tmp + k * width + x;
            int32_t wk = w[k];
            for (int i = 0; i < AUG_COLS; i++) acc[i] += wk * in[i];
        }
        for (int i = 0; i < AUG_COLS; i++) out[x + i] = aug_clip(acc[i], prec);
    }
    for (; x < width; x++) {
        int32_t acc = init;
        for (int64_t k = 0; k < n; k++) acc += w[k] * tmp[k * width + x];
        out[x] = aug_clip(acc, prec);
    }
}

/* One channel (pixel step sx, row step sy) into s->plane (oh x ow, zero outside the resized image). */
static void aug_channel(const uint8_t *src, int64_t sx, int64_t sy, const int64_t b[8], const AugTaps *tx,
                        const AugTaps *ty, const AugPlan *p, AugScratch *s) {
    int64_t top = b[0], left = b[1], rh = b[4], rw = b[5], oy = b[6], ox = b[7];
    int64_t y0 = oy > 0 ? oy : 0, y1 = oy + p->oh < rh ? oy + p->oh : rh;
    int64_t x0 = ox > 0 ? ox : 0, x1 = ox + p->ow < rw ? ox + p->ow : rw;
    if (y0 != oy || x0 != ox || y1 != oy + p->oh || x1 != ox + p->ow) memset(s->plane, 0, (size_t)(p->oh * p->ow));
    if (y0 >= y1 || x0 >= x1) return;
    int64_t xw = x1 - x0;
    int64_t r_lo = ty ? ty->lo[y0] : y0, r_hi = ty ? ty->lo[y1 - 1] + ty->n[y1 - 1] : y1;
    const uint8_t *box = src + top * sy + left * sx;
    if (tx) {
        aug_horizontal(box, sx, sy, r_lo, r_hi, tx, x0, x1, s->strip, s->tmp);
    } else {
        for (int64_t r = r_lo; r < r_hi; r++)
            for (int64_t x = x0; x < x1; x++) s->tmp[(r - r_lo) * xw + x - x0] = box[r * sy + x * sx];
    }
    for (int64_t y = y0; y < y1; y++) {
        uint8_t *out = s->plane + (y - oy) * p->ow + (x0 - ox);
        if (ty)
            aug_vertical(s->tmp + (ty->lo[y] - r_lo) * xw, xw, ty->w + y * ty->K, ty->n[y], ty->prec, out);
        else
            memcpy(out, s->tmp + (y - r_lo) * xw, (size_t)xw);
    }
}

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
    AugTaps tx = {0}, ty = {0};
    int bad = (b[5] != b[3] && aug_taps(b[3], b[5], &tx) < 0) || (b[4] != b[2] && aug_taps(b[2], b[4], &ty) < 0);
    size_t need = (size_t)(b[2] * p->ow); /* the rows a channel's vertical pass reads, at most the box's */
    if (!bad && need > s->tmp_size) {
        free(s->tmp);
        s->tmp = malloc(need);
        s->tmp_size = s->tmp ? need : 0;
        bad = s->tmp == NULL;
    }
    size_t strip = (size_t)(b[3] * AUG_ROWS); /* the box's columns, 16 rows of them */
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
    for (int64_t c = 0; c < C; c++) {
        const uint8_t *at = hwc ? src + c : src + c * H * W;
        aug_channel(at, hwc ? C : 1, hwc ? W * C : W, b, tx.w ? &tx : NULL, ty.w ? &ty : NULL, p, s);
        aug_write(p, s->plane, c, C, flip, dest);
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
        memcpy(row, v + pos, t->nbytes[f]);
        if (check) digest = xxh3_64(row, t->nbytes[f], digest);
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
    if (aug_parse(shape, fields, params, &t, &p, &key, &lut) < 0) return NULL;
    Py_ssize_t got = 0;
    int ok = 0;
    size_t esize = p.kind == 0 ? 1 : p.kind == 1 ? 4 : 2;
    if (t.nfields != PyList_GET_SIZE(dests) || lo < 0 || lo > hi || hi > PyByteArray_GET_SIZE(blob) / SPAN) {
        PyErr_SetString(PyExc_ValueError, "augment: fields, destinations and rows do not agree");
        goto done;
    }
    for (got = 0; got < t.nfields; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(dests, got), &out[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
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
    if (!s.plane) status = AUG_NOMEM;
    for (; status == FILL_OK && j < hi; j++) {
        status = aug_row(&m, (const uint8_t *)held.buf + j * SPAN, &t, &p, out, (uint8_t *)scalars.buf, (uint64_t)j, &s);
        if (status != FILL_OK) break;
    }
    free(s.plane), free(s.tmp), free(s.strip);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&held);
    for (Py_ssize_t f = 0; f < t.nfields; f++) PyBuffer_Release(&out[f]);
    PyBuffer_Release(&scalars);
    PyBuffer_Release(&key), PyBuffer_Release(&lut);
    if (status == AUG_NOMEM) return PyErr_NoMemory();
    return Py_BuildValue("in", status, status ? j : (Py_ssize_t)0);
}
