/* Decode-and-apply of delta segments in one pass, with the chunk's XXH3-128 before and/or after.
 *
 * The Python side (deltastore/codec/apply.py) parses the segment header and decompresses its
 * sections (python-zstandard releases the GIL); this kernel takes those sections and:
 *
 *   1. validates everything first -- plane sizes, padding, escape counts, escaped values, zero
 *      values, changed-element counts, positions -- in the same order as the numpy decoder, so
 *      that a bad segment gets the same CorruptObjectError message on both paths, and nothing
 *      is written;
 *   2. then walks the target in cache-sized blocks: hash the block (state before), apply the
 *      changes that fall in it, hash it again (state after). The target is read from memory
 *      once, however many digests are asked for.
 *
 * Contract (table ds_apply_methods, merged into deltastore._native by module.c):
 *
 *   apply_segment(target, kind, width, gap_width, sections, n_changed, n_gap_escaped,
 *                 n_escaped, inverse, want) -> (err, a, b, before_hex | None, after_hex | None)
 *
 *   target    writable C-contiguous buffer of count * width bytes (little-endian elements)
 *   kind      0 add-sparse/1, 1 add-dense/1
 *   sections  tuple, in segment order, of bytes-like planes or ints 0..255 (CONST sections)
 *   want      bit 0: digest of the target before, bit 1: after
 *   err       0 on success, else a DS_E_* code (a, b its numbers); the target is then untouched
 *
 * Sizes that disagree with the header fields (a caller bug, since read_header checked them)
 * raise ValueError. No input can make the kernel read or write outside its buffers: every
 * plane's length is checked against the fields, every position against count, before use.
 * The GIL is released around every loop over elements.
 */
#include "ds_native.h"

#include <string.h>

#include "ds_xxh.h"

#if defined(__GNUC__) || defined(__clang__)
#define DS_INLINE static inline __attribute__((always_inline))
#else
#define DS_INLINE static inline
#endif

/* Codec constants: must equal deltastore.codec.delta.ESCAPE / NIBBLE_ESCAPE (format). */
#define GAP_ESCAPE 255
#define NIBBLE_ESCAPE 15

/* Bytes hashed, patched and hashed again per step: small enough that the block is still in
 * L1/L2 for the second hash (so the target is read from memory once), big enough that the
 * per-block cost (two XXH3 update calls) is negligible. */
#define BLOCK_BYTES ((uint64_t)32 * 1024)

/* Each block is patched and hashed the second time in steps of this many bytes, and before
 * each step the same step of the next block is prefetched (64 lines of 64 bytes): a page's
 * worth is a burst the line-fill buffers absorb while the step is worked on, where asking for
 * the whole next block at once stalled (docs/design/006-native-kernels.md). */
#define STEP_BYTES ((uint64_t)4096)

/* At most 1 gap-symbol + 4 gap-escape + 1 code + 8 value-escape planes (add-sparse, width 8). */
#define MAX_PLANES 16

enum { K_ADD_SPARSE = 0, K_ADD_DENSE = 1 };
enum { OP_ADD = 0, OP_SUB = 1 };

/* Error codes, mirrored by deltastore.codec.apply._kernel_error. */
enum {
    DS_E_OK = 0,
    DS_E_PADDING = 1,        /* odd count, high nibble of the last code byte is not 0 */
    DS_E_ESC_COUNT = 2,      /* a = declared escaped values, b = code-15 count */
    DS_E_ESC_SMALL = 3,      /* an escaped value below NIBBLE_ESCAPE */
    DS_E_ZERO = 4,           /* a sparse value is 0 */
    DS_E_GAP_ESC_COUNT = 5,  /* a = declared escaped gaps, b = symbol-255 count */
    DS_E_GAP_ESC_TOTAL = 6,  /* a = sum of gap escape remainders (>= count) */
    DS_E_POSITION = 7,       /* a = last position (>= count) */
    DS_E_NCHANGED = 8,       /* a = declared changed elements, b = non-zero values */
};

/* One decoded section: p[i & mask] is byte i (mask 0 for a CONST section). */
typedef struct {
    const uint8_t *p;
    size_t mask;
} plane_t;

typedef struct {
    int kind, width, gap_width;
    uint64_t count, n, n_gap_escaped, n_escaped;
    /* gap symbols, gap escapes, value codes, value escapes: see the layout in layout() */
    const plane_t *gsym, *gesc, *codes, *vesc;
} seg_t;

DS_INLINE uint8_t pbyte(const plane_t *pl, uint64_t i) { return pl->p[i & pl->mask]; }

/* Element i of `k` little-endian byte planes. */
DS_INLINE uint64_t pval(const plane_t *pl, int k, uint64_t i) {
    uint64_t v = 0;
    for (int j = 0; j < k; j++) v |= (uint64_t)pbyte(&pl[j], i) << (8 * j);
    return v;
}

DS_INLINE uint64_t unzigzag(uint64_t z) { return (z >> 1) ^ (0 - (z & 1)); }

DS_INLINE unsigned code_at(const plane_t *codes, uint64_t i) {
    return (pbyte(codes, i >> 1) >> ((i & 1) * 4)) & 15u;
}

/* --- validation (no writes) ------------------------------------------------------------- */

/* The validation scans below read whole planes byte by byte. They run on every segment before
 * anything is written, so they are written to vectorize: a plain pointer (never p[i & mask])
 * for RAW planes, a closed form for CONST ones, and 32-bit counters per SCAN_BLOCK bytes
 * (u8 lanes widen to u32, not u64; the block keeps any count below 2**32). */
#define SCAN_BLOCK ((uint64_t)1 << 20)

/* Nibble counts over `nbytes` code bytes: nibbles equal to 15 (*esc) and equal to 0 (*z). */
static void count_nibbles(const plane_t *pl, uint64_t nbytes, uint64_t *esc, uint64_t *z) {
    if (!pl->mask) { /* CONST: every byte is the same */
        unsigned c = pl->p[0], lo = c & 15u, hi = c >> 4;
        *esc += nbytes * ((lo == NIBBLE_ESCAPE) + (hi == NIBBLE_ESCAPE));
        *z += nbytes * ((lo == 0) + (hi == 0));
        return;
    }
    const uint8_t *p = pl->p;
    for (uint64_t s0 = 0; s0 < nbytes; s0 += SCAN_BLOCK) {
        uint64_t e = nbytes - s0 > SCAN_BLOCK ? s0 + SCAN_BLOCK : nbytes;
        uint32_t be = 0, bz = 0;
        for (uint64_t i = s0; i < e; i++) {
            uint8_t lo = p[i] & 15u, hi = p[i] >> 4;
            be += (uint32_t)(lo == NIBBLE_ESCAPE) + (uint32_t)(hi == NIBBLE_ESCAPE);
            bz += (uint32_t)(lo == 0) + (uint32_t)(hi == 0);
        }
        *esc += be;
        *z += bz;
    }
}

/* Sum of the first n bytes of a plane, and how many equal `eq`. */
static void sum_bytes(const plane_t *pl, uint64_t n, unsigned eq, uint64_t *sum, uint64_t *count_eq) {
    if (!pl->mask) {
        *sum += n * pl->p[0];
        *count_eq += pl->p[0] == eq ? n : 0;
        return;
    }
    const uint8_t *p = pl->p;
    for (uint64_t s0 = 0; s0 < n; s0 += SCAN_BLOCK) {
        uint64_t e = n - s0 > SCAN_BLOCK ? s0 + SCAN_BLOCK : n;
        uint32_t bs = 0, bc = 0; /* < 2**20 * 255 */
        for (uint64_t i = s0; i < e; i++) {
            bs += p[i];
            bc += (uint32_t)(p[i] == eq);
        }
        *sum += bs;
        *count_eq += bc;
    }
}

/* add-* value codes: padding, escape count, escaped values; *zeros = codes equal to 0. */
static int check_add_values(const seg_t *s, uint64_t n, uint64_t *zeros, uint64_t *a, uint64_t *b) {
    if ((n & 1) && (pbyte(s->codes, n >> 1) >> 4)) return DS_E_PADDING;
    uint64_t esc = 0, z = 0;
    count_nibbles(s->codes, n >> 1, &esc, &z);
    if (n & 1) {
        unsigned lo = pbyte(s->codes, n >> 1) & 15u;
        esc += lo == NIBBLE_ESCAPE;
        z += lo == 0;
    }
    if (esc != s->n_escaped) {
        *a = s->n_escaped;
        *b = esc;
        return DS_E_ESC_COUNT;
    }
    for (uint64_t j = 0; j < s->n_escaped; j++)
        if (pval(s->vesc, s->width, j) < NIBBLE_ESCAPE) return DS_E_ESC_SMALL;
    *zeros = z;
    return DS_E_OK;
}

static int check_positions(const seg_t *s, uint64_t *a, uint64_t *b) {
    uint64_t n = s->n, sum = 0, esc = 0, total = 0;
    if (n == 0) return DS_E_OK;
    sum_bytes(s->gsym, n, GAP_ESCAPE, &sum, &esc);
    if (esc != s->n_gap_escaped) {
        *a = s->n_gap_escaped;
        *b = esc;
        return DS_E_GAP_ESC_COUNT;
    }
    for (uint64_t j = 0; j < s->n_gap_escaped; j++) total += pval(s->gesc, s->gap_width, j);
    if (total >= s->count) {
        *a = total;
        return DS_E_GAP_ESC_TOTAL;
    }
    sum += total;
    uint64_t last = sum + n - 1; /* < 2**40 + 2**33 */
    if (last >= s->count) {
        *a = last;
        return DS_E_POSITION;
    }
    return DS_E_OK;
}

static int validate(const seg_t *s, uint64_t *a, uint64_t *b) {
    uint64_t zeros = 0;
    int err;
    if (s->kind == K_ADD_SPARSE) {
        if ((err = check_add_values(s, s->n, &zeros, a, b))) return err;
        if (zeros) return DS_E_ZERO;
        return check_positions(s, a, b);
    }
    if ((err = check_add_values(s, s->count, &zeros, a, b))) return err; /* K_ADD_DENSE */
    if (s->count - zeros != s->n) {
        *a = s->n;
        *b = s->count - zeros;
        return DS_E_NCHANGED;
    }
    return DS_E_OK;
}

/* --- applying (after validation) -------------------------------------------------------- */

DS_INLINE void apply_at(uint8_t *t, uint64_t p, int W, int OP, uint64_t d) {
    uint8_t *at = t + p * (uint64_t)W;
#define DS_APPLY_T(T)                                                   \
    {                                                                   \
        T x;                                                            \
        memcpy(&x, at, sizeof x);                                       \
        x = OP == OP_ADD ? (T)(x + (T)d) : (T)(x - (T)d);               \
        memcpy(at, &x, sizeof x);                                       \
    }
    switch (W) {
    case 1: DS_APPLY_T(uint8_t) break;
    case 2: DS_APPLY_T(uint16_t) break;
    case 4: DS_APPLY_T(uint32_t) break;
    default: DS_APPLY_T(uint64_t) break;
    }
#undef DS_APPLY_T
}

/* Cursor over a dense value stream (values in element order; escapes consumed in order). */
typedef struct {
    uint64_t ve; /* next escaped value */
} cursor_t;

DS_INLINE uint64_t value_at(const seg_t *s, uint64_t i, cursor_t *c) {
    unsigned code = code_at(s->codes, i);
    if (code == NIBBLE_ESCAPE) return unzigzag(pval(s->vesc, s->width, c->ve++));
    return unzigzag(code);
}

/* --- sparse changes, decoded a batch at a time --------------------------------------------
 *
 * The sparse kinds are decoded BATCH changes at a time into two small local arrays (positions
 * and differences) and then applied from them, instead of decoding each change between two
 * writes: the decode loop is then a short run of loads and adds with no store into the target
 * between them (a store into t, bytes that may alias anything, made the compiler reload the
 * decoder's state), and the apply loop has one branch per change (the next position against
 * the end of the step, which fails once per step); docs/design/006-native-kernels.md. */

/* Changes per batch: the two arrays (1 KiB) stay in L1 next to the step being patched, and a
 * batch spans ~1.5 steps of bf16 at RL densities (~2 %), so the per-batch costs (the loop's
 * exit, the state saved) are paid once per ~64 changes. A multiple of 8 (decode_add's groups;
 * every batch then starts at an even change, on a code byte's low nibble). */
#define BATCH 64

/* Differences of the 4-bit codes 0..14 (unzigzag); 15 is the escape, read from its planes. */
static const uint64_t UNZIGZAG4[16] = {
    0, (uint64_t)-1, 1, (uint64_t)-2, 2, (uint64_t)-3, 3, (uint64_t)-4,
    4, (uint64_t)-5, 5, (uint64_t)-6, 6, (uint64_t)-7, 7, 0,
};

typedef struct {
    uint64_t i;  /* next change to decode */
    uint64_t p;  /* position of the last change decoded; UINT64_MAX before the first (+ g + 1 wraps to g) */
    uint64_t ve; /* add-sparse: next escaped value */
    uint64_t ge; /* add-sparse: next escaped gap */
} decoder_t;

/* add-sparse: changes d->i .. d->i + m into pos[0..m) and val[0..m) (differences, not yet
 * cast to the width); pos[m] = UINT64_MAX, the apply loop's sentinel. d->i is even (batches
 * start at multiples of BATCH), so each code byte holds the codes of changes j and j + 1.
 * Escapes (~2 % of values and ~0.5 % of gaps on RL deltas) take a branch, and only in a group
 * of eight that holds one: a branch-free select for every change (from a ring of escapes
 * widened ahead, at a masked cursor advanced by the flag) cost 54 instructions per change
 * decoded and applied against 31 with plain branches (callgrind, real bf16 segments).
 * validate() proved that the symbols and codes hold exactly n_gap_escaped and
 * n_escaped escapes, so the cursors stay inside their planes. The words are read in host
 * order: the kernels run on little-endian hosts only (_util/kernels.py). */
DS_INLINE unsigned decode_add(decoder_t *d, const seg_t *s, uint64_t *pos, uint64_t *val) {
    uint64_t i = d->i, left = s->n - i;
    unsigned m = left < BATCH ? (unsigned)left : BATCH;
    /* This batch's gap symbols g[0..m) and code bytes c[0..(m+1)/2): a CONST plane is read
     * from a batch's worth of its byte, so both are plain arrays below. */
    uint8_t gconst[BATCH], cconst[BATCH / 2];
    const uint8_t *g = s->gsym->p + i, *c = s->codes->p + i / 2;
    if (!s->gsym->mask) memset(gconst, s->gsym->p[0], sizeof gconst), g = gconst;
    if (!s->codes->mask) memset(cconst, s->codes->p[0], sizeof cconst), c = cconst;
    uint64_t p = d->p;
    unsigned j = 0;
    /* Eight changes at a time (8 gap symbols, 4 code bytes): when none is an escape (~80 % of
     * groups on RL deltas), positions and differences come straight from the two words. */
    for (; j + 8 <= m; j += 8) {
        uint64_t gw;
        uint32_t cw;
        memcpy(&gw, g + j, 8);
        memcpy(&cw, c + j / 2, 4);
        /* a byte 255 / a nibble 15 is a zero byte / nibble of the complement */
        uint64_t ng = ~gw;
        uint32_t nc = ~cw;
        if (!(((ng - 0x0101010101010101ull) & ~ng & 0x8080808080808080ull) |
              ((nc - 0x11111111u) & ~nc & 0x88888888u))) {
            for (unsigned k = 0; k < 8; k++) {
                pos[j + k] = p += (gw & 255u) + 1;
                gw >>= 8;
                val[j + k] = UNZIGZAG4[cw & 15u];
                cw >>= 4;
            }
            continue;
        }
        for (unsigned k = 0; k < 8; k++) {
            unsigned gs = (unsigned)(gw & 255u), cs = cw & 15u;
            gw >>= 8;
            cw >>= 4;
            uint64_t gap = gs, v = UNZIGZAG4[cs];
            if (gs == GAP_ESCAPE) gap = GAP_ESCAPE + pval(s->gesc, s->gap_width, d->ge++);
            if (cs == NIBBLE_ESCAPE) v = unzigzag(pval(s->vesc, s->width, d->ve++));
            pos[j + k] = p += gap + 1;
            val[j + k] = v;
        }
    }
    for (; j < m; j++) {
        unsigned gs = g[j], cs = (c[j / 2] >> ((j & 1) * 4)) & 15u;
        uint64_t gap = gs, v = UNZIGZAG4[cs];
        if (gs == GAP_ESCAPE) gap = GAP_ESCAPE + pval(s->gesc, s->gap_width, d->ge++);
        if (cs == NIBBLE_ESCAPE) v = unzigzag(pval(s->vesc, s->width, d->ve++));
        pos[j] = p += gap + 1;
        val[j] = v;
    }
    pos[m] = UINT64_MAX;
    d->p = p;
    d->i = i + m;
    return m;
}

/* Apply pos/val[j..) while the position is below lim (the sentinel stops it at the end of the
 * batch); returns where it stopped. Out of line: inside run() (every plane, cursor and hash
 * state live at once) gcc kept neither t nor lim in a register and reloaded both from the
 * stack for every change; here the loop is six instructions. One call per step. */
DS_INLINE size_t apply_batch_t(uint8_t *t, const uint64_t *pos, const uint64_t *val, size_t j,
                               uint64_t lim, int W, int OP) {
    for (uint64_t q; (q = pos[j]) < lim; j++) apply_at(t, q, W, OP, val[j]);
    return j;
}

#if defined(__GNUC__) || defined(__clang__)
__attribute__((noinline))
#endif
static size_t apply_batch(uint8_t *t, const uint64_t *pos, const uint64_t *val, size_t j, uint64_t lim,
                          int W, int OP) {
#define DS_AB(w)                                                                        \
    case w:                                                                             \
        return OP == OP_ADD ? apply_batch_t(t, pos, val, j, lim, w, OP_ADD)            \
                            : apply_batch_t(t, pos, val, j, lim, w, OP_SUB);
    switch (W) {
        DS_AB(1)
        DS_AB(2)
        DS_AB(4)
    default:
        DS_AB(8)
    }
#undef DS_AB
}

/* Where the result goes: in place (src NULL), or src copied into t block by block; and, for
 * sparse kinds, the positions written (pos NULL: not wanted). */
typedef struct {
    const uint8_t *src;
    int64_t *pos;
    uint8_t *oldv, *newv; /* with pos: the bits before and after at each position (n * W bytes) */
} io_t;

/* Walk the target in blocks [start, end): (copy the block from src,) hash before, then per step
 * of STEP_BYTES prefetch that step of the next block, apply the step's changes and hash it
 * after. Without digests or src the whole chunk is one block and one step. */
DS_INLINE void run(uint8_t *t, const seg_t *seg, int W, int OP, int SPARSE, int REC,
                   XXH3_state_t *sb, XXH3_state_t *sa, const io_t *iop) {
    /* Local copies: stores into t (bytes, which may alias anything) would otherwise make the
     * compiler reload every plane pointer and mask from memory after each element written. */
    plane_t pl[MAX_PLANES];
    seg_t ls = *seg;
    io_t lio = *iop;
    const seg_t *s = &ls;
    const io_t *io = &lio;
    int k = 0;
#define DS_LOCAL(field, nplanes)                                      \
    if (seg->field) {                                                 \
        for (int j = 0; j < (nplanes); j++) pl[k + j] = seg->field[j]; \
        ls.field = &pl[k];                                            \
        k += (nplanes);                                               \
    }
    DS_LOCAL(gsym, 1)
    DS_LOCAL(gesc, seg->gap_width)
    DS_LOCAL(codes, 1)
    DS_LOCAL(vesc, seg->width)
#undef DS_LOCAL
    uint64_t count = s->count;
    uint64_t blk = (sb || sa || io->src) ? BLOCK_BYTES / W : count;
    uint64_t sub = (sb || sa || io->src) ? STEP_BYTES / W : count;
    /* What the next block is read from: the source when copying, else the target. */
    const uint8_t *ahead = io->src ? io->src : t;
    cursor_t c = {0};
    /* sparse: the batch being applied is pos/val[j..m); pos[m] is the sentinel UINT64_MAX, so
     * the apply loop stops at the end of the batch without a second test. */
    decoder_t dec;
    uint64_t pos[BATCH + 1], val[BATCH];
    size_t j = 0, m = 0;
    uint64_t a = 0; /* changes applied so far (REC: where the next one is recorded) */
    if (SPARSE) {
        dec.i = dec.ve = dec.ge = 0;
        dec.p = UINT64_MAX;
        pos[0] = UINT64_MAX;
    }
    for (uint64_t start = 0; start < count;) {
        uint64_t end = count - start > blk ? start + blk : count;
        if (io->src) memcpy(t + start * W, io->src + start * W, (size_t)((end - start) * W));
        if (sb) XXH3_128bits_update(sb, t + start * W, (size_t)((end - start) * W));
        for (uint64_t s0 = start; s0 < end;) {
            uint64_t s1 = end - s0 > sub ? s0 + sub : end;
            /* Ask for the same step of the next block now, so that memory delivers it while
             * this one is patched and hashed from cache (without this, nothing is in flight
             * during that phase: the first hash of each block stalls on memory). Into L2, not
             * L1: the block being worked on stays in L1. Past the chunk, nothing. */
            if (s0 + blk < count) {
                const uint8_t *q = ahead + (s0 + blk) * W;
                const uint8_t *qe = ahead + (s1 + blk < count ? s1 + blk : count) * W;
                if (io->src)
                    for (; q < qe; q += 64) __builtin_prefetch(q, 0, 2);
                else
                    for (; q < qe; q += 64) __builtin_prefetch(q, 1, 2);
            }
            if (SPARSE) {
                for (;;) {
                    if (REC) {
                        for (uint64_t q; (q = pos[j]) < s1; j++, a++) {
                            io->pos[a] = (int64_t)q;
                            memcpy(io->oldv + a * W, t + q * W, W);
                            apply_at(t, q, W, OP, val[j]);
                            memcpy(io->newv + a * W, t + q * W, W);
                        }
                    } else {
                        j = apply_batch(t, pos, val, j, s1, W, OP);
                    }
                    /* stopped before the sentinel: the next change is in a later step */
                    if (j < m || dec.i >= s->n) break;
                    m = decode_add(&dec, s, pos, val);
                    j = 0;
                }
            } else {
                for (uint64_t e = s0; e < s1; e++) {
                    uint64_t d = value_at(s, e, &c);
                    if (d) apply_at(t, e, W, OP, d);
                }
            }
            if (sa) XXH3_128bits_update(sa, t + s0 * W, (size_t)((s1 - s0) * W));
            s0 = s1;
        }
        start = end;
    }
}

#define DS_RUN_REC(W, OP, SPARSE)                                           \
    do {                                                                    \
        if ((SPARSE) && io->pos) run(t, s, W, OP, SPARSE, 1, sb, sa, io);   \
        else run(t, s, W, OP, SPARSE, 0, sb, sa, io);                       \
    } while (0)
#define DS_RUN_OPS(W, SPARSE)                                  \
    do {                                                       \
        if (inverse) DS_RUN_REC(W, OP_SUB, SPARSE);            \
        else DS_RUN_REC(W, OP_ADD, SPARSE);                    \
    } while (0)
#define DS_RUN_KINDS(W)                                        \
    do {                                                       \
        if (s->kind == K_ADD_SPARSE) DS_RUN_OPS(W, 1);         \
        else DS_RUN_OPS(W, 0);                                 \
    } while (0)

static void apply_all(uint8_t *t, const seg_t *s, int inverse, XXH3_state_t *sb, XXH3_state_t *sa,
                      const io_t *io) {
    switch (s->width) {
    case 1: DS_RUN_KINDS(1); break;
    case 2: DS_RUN_KINDS(2); break;
    case 4: DS_RUN_KINDS(4); break;
    default: DS_RUN_KINDS(8); break;
    }
}

/* --- the Python binding ------------------------------------------------------------------ */

typedef struct {
    plane_t pl[MAX_PLANES];
    Py_buffer views[MAX_PLANES];
    int has_view[MAX_PLANES];
    uint8_t *zbuf[MAX_PLANES]; /* a zstd section's plane, decoded here (views[i] is its frame) */
    uint8_t consts[MAX_PLANES];
    int n;
} sections_t;

static void release_sections(sections_t *ss) {
    for (int i = 0; i < ss->n; i++) {
        if (ss->has_view[i]) PyBuffer_Release(&ss->views[i]);
        PyMem_RawFree(ss->zbuf[i]);
    }
    ss->n = 0;
}

/* The zstd sections' frames decoded into their planes (without the GIL): 0, or DS_E_ZSTD with
 * *ea = the section, *eb = the value and *zkind / *zmsg as ds_zstd_decode reports them. */
#define DS_E_ZSTD 9
static int decode_frames(sections_t *ss, const uint64_t *len, uint64_t *ea, uint64_t *eb, int *zkind,
                         const char **zmsg) {
    for (int i = 0; i < ss->n; i++) {
        if (!ss->zbuf[i]) continue;
        unsigned long long value;
        int k = ds_zstd_decode(ss->views[i].buf, (size_t)ss->views[i].len, ss->zbuf[i], (size_t)len[i], &value, zmsg);
        if (k) {
            *ea = (uint64_t)i;
            *eb = value;
            *zkind = k;
            return DS_E_ZSTD;
        }
    }
    return 0;
}

/* The sections' expected lengths for this segment (the section layout of SPEC/codec-format). */
static int layout(seg_t *s, uint64_t *len, int *role_start) {
    int k = 0;
    uint64_t n = s->n;
    /* role_start: index of the first plane of gsym, gesc, codes, vesc (-1 absent) */
    for (int r = 0; r < 4; r++) role_start[r] = -1;
    if (s->kind == K_ADD_SPARSE) {
        role_start[0] = k;
        len[k++] = n;
        if (s->n_gap_escaped) {
            role_start[1] = k;
            for (int j = 0; j < s->gap_width; j++) len[k++] = s->n_gap_escaped;
        }
    }
    role_start[2] = k;
    len[k++] = s->kind == K_ADD_SPARSE ? (n + 1) / 2 : (s->count + 1) / 2;
    if (s->n_escaped) {
        role_start[3] = k;
        for (int j = 0; j < s->width; j++) len[k++] = s->n_escaped;
    }
    return k;
}

static int ranges_overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *a0 = (const char *)a->buf, *b0 = (const char *)b->buf;
    return a->len && b->len && a0 < b0 + b->len && b0 < a0 + a->len;
}

static PyObject *hex_digest(XXH3_state_t *st) {
    XXH128_hash_t h = XXH3_128bits_digest(st);
    return ds_hex128(h.high64, h.low64);
}

PyDoc_STRVAR(apply_segment_doc,
"apply_segment(target, kind, width, gap_width, sections, n_changed, n_gap_escaped, n_escaped,\n"
"              inverse, want, out=None, positions=None, old=None, new=None)\n"
"    -> (err, a, b, before_hex | None, after_hex | None)\n\n"
"Validate a decompressed delta segment, then apply it to target (or undo it), hashing the\n"
"target (XXH3-128) before and/or after in the same pass (want: bit 0 before, bit 1 after).\n"
"With out (a writable buffer of target's size), target is only read: the result is written\n"
"to out. With positions, old and new (sparse kinds; writable buffers of n_changed int64 and\n"
"n_changed elements), the changed positions and the bits there before and after are written\n"
"there. A zstd section may be passed as (frame,): it is decoded here, without the GIL, into\n"
"the plane its header implies (zstd.c; a libzstd must be loaded). err != 0: the segment is\n"
"corrupt (see DS_E_* in apply.c) and nothing was written; err 9 (DS_E_ZSTD): section a's\n"
"frame failed, b the value, before the failure kind and after zstd's message, as\n"
"zstd_decompress reports them.");

static PyObject *apply_segment(PyObject *self, PyObject *args) {
    PyObject *target, *sections, *out = Py_None, *positions = Py_None, *oldo = Py_None, *newo = Py_None;
    int kind, width, gap_width, inverse, want;
    unsigned long long n, nge, ne;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiiiO!KKKpi|OOOO", &target, &kind, &width, &gap_width, &PyTuple_Type,
                          &sections, &n, &nge, &ne, &inverse, &want, &out, &positions, &oldo, &newo))
        return NULL;
    if ((positions == Py_None) != (oldo == Py_None) || (positions == Py_None) != (newo == Py_None))
        return PyErr_Format(PyExc_ValueError, "positions, old and new go together");
    int sparse = kind == K_ADD_SPARSE;
    if (positions != Py_None && !sparse)
        return PyErr_Format(PyExc_ValueError, "positions are only written for sparse kinds");
    if (kind != K_ADD_SPARSE && kind != K_ADD_DENSE) return PyErr_Format(PyExc_ValueError, "unknown kind %d", kind);
    if (width != 1 && width != 2 && width != 4 && width != 8)
        return PyErr_Format(PyExc_ValueError, "width %d is not 1, 2, 4 or 8", width);
    int uses_gap_width = kind == K_ADD_SPARSE && nge;
    if (uses_gap_width && gap_width != 1 && gap_width != 2 && gap_width != 4)
        return PyErr_Format(PyExc_ValueError, "gap width %d is not 1, 2 or 4", gap_width);

    /* tv: what is read (target); ov: what is written (out, or target in place); pv: positions */
    Py_buffer tv, ov, pv, oldb, newb;
    int has_out = 0, has_pos = 0;
    if (PyObject_GetBuffer(target, &tv, (out == Py_None ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (out != Py_None) {
        if (PyObject_GetBuffer(out, &ov, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&tv);
            return NULL;
        }
        has_out = 1;
    }
    if (positions != Py_None) {
        if (PyObject_GetBuffer(positions, &pv, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            if (has_out) PyBuffer_Release(&ov);
            PyBuffer_Release(&tv);
            return NULL;
        }
        if (PyObject_GetBuffer(oldo, &oldb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&pv);
            if (has_out) PyBuffer_Release(&ov);
            PyBuffer_Release(&tv);
            return NULL;
        }
        if (PyObject_GetBuffer(newo, &newb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&oldb);
            PyBuffer_Release(&pv);
            if (has_out) PyBuffer_Release(&ov);
            PyBuffer_Release(&tv);
            return NULL;
        }
        has_pos = 1;
    }
    seg_t s;
    memset(&s, 0, sizeof s);
    s.kind = kind;
    s.width = width;
    s.gap_width = uses_gap_width ? gap_width : 0;
    s.count = (uint64_t)tv.len / (uint64_t)width;
    s.n = n;
    s.n_gap_escaped = kind == K_ADD_SPARSE ? nge : 0;
    s.n_escaped = ne;

    sections_t ss;
    ss.n = 0;
    uint64_t len[MAX_PLANES];
    int role[4];
    PyObject *result = NULL;
    if (has_out && (ov.len != tv.len || ranges_overlap(&ov, &tv))) {
        PyErr_SetString(PyExc_ValueError, "out must have target's size and not overlap it");
        goto done;
    }
    if (has_pos && ((uint64_t)pv.len != (uint64_t)n * sizeof(int64_t) || (uint64_t)oldb.len != (uint64_t)n * width ||
                    (uint64_t)newb.len != (uint64_t)n * width)) {
        PyErr_Format(PyExc_ValueError, "positions/old/new have %zd/%zd/%zd bytes, n_changed %llu needs %llu/%llu/%llu",
                     pv.len, oldb.len, newb.len, n, (unsigned long long)n * sizeof(int64_t),
                     (unsigned long long)n * width, (unsigned long long)n * width);
        goto done;
    }
    if ((uint64_t)tv.len % (uint64_t)width) {
        PyErr_Format(PyExc_ValueError, "target has %zd bytes, not a multiple of width %d", tv.len, width);
        goto done;
    }
    if (s.n > s.count || s.n_escaped > (kind == K_ADD_DENSE ? s.count : s.n) || s.n_gap_escaped > s.n) {
        PyErr_SetString(PyExc_ValueError, "segment counts exceed the target's element count");
        goto done;
    }
    int want_planes = layout(&s, len, role);
    if (PyTuple_GET_SIZE(sections) != want_planes) {
        PyErr_Format(PyExc_ValueError, "segment has %zd sections, its header implies %d",
                     PyTuple_GET_SIZE(sections), want_planes);
        goto done;
    }
    for (int i = 0; i < want_planes; i++) {
        PyObject *o = PyTuple_GET_ITEM(sections, i);
        ss.has_view[i] = 0;
        ss.zbuf[i] = NULL;
        ss.n = i + 1;
        if (PyTuple_Check(o)) { /* (frame,): a zstd section, decoded below into len[i] bytes */
            if (PyTuple_GET_SIZE(o) != 1 || !ds_zstd_ready()) {
                PyErr_Format(PyExc_ValueError, "section %d: a zstd frame is passed as (frame,), with a libzstd loaded", i);
                goto done;
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(o, 0), &ss.views[i], PyBUF_C_CONTIGUOUS) < 0) goto done;
            ss.has_view[i] = 1;
            if (len[i] == 0 || !(ss.zbuf[i] = PyMem_RawMalloc((size_t)len[i]))) {
                if (len[i]) PyErr_NoMemory();
                else PyErr_Format(PyExc_ValueError, "zstd section %d stands for 0 bytes", i);
                goto done;
            }
            ss.pl[i].p = ss.zbuf[i];
            ss.pl[i].mask = ~(size_t)0;
            continue;
        }
        if (PyLong_Check(o)) {
            long v = PyLong_AsLong(o);
            if (v < 0 || v > 255) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "const section %d is not a byte", i);
                goto done;
            }
            if (len[i] == 0) {
                PyErr_Format(PyExc_ValueError, "const section %d stands for 0 bytes", i);
                goto done;
            }
            ss.consts[i] = (uint8_t)v;
            ss.pl[i].p = &ss.consts[i];
            ss.pl[i].mask = 0;
            continue;
        }
        if (PyObject_GetBuffer(o, &ss.views[i], PyBUF_C_CONTIGUOUS) < 0) goto done;
        ss.has_view[i] = 1;
        if ((uint64_t)ss.views[i].len != len[i]) {
            PyErr_Format(PyExc_ValueError, "section %d has %zd bytes, its header implies %llu", i,
                         ss.views[i].len, (unsigned long long)len[i]);
            goto done;
        }
        ss.pl[i].p = (const uint8_t *)ss.views[i].buf;
        ss.pl[i].mask = ~(size_t)0;
    }
    if (role[0] >= 0) s.gsym = &ss.pl[role[0]];
    if (role[1] >= 0) s.gesc = &ss.pl[role[1]];
    s.codes = &ss.pl[role[2]];
    if (role[3] >= 0) s.vesc = &ss.pl[role[3]];

    XXH3_state_t *sb = NULL, *sa = NULL;
    if ((want & 1) && !(sb = XXH3_createState())) { PyErr_NoMemory(); goto done; }
    if ((want & 2) && !(sa = XXH3_createState())) { XXH3_freeState(sb); PyErr_NoMemory(); goto done; }
    if (sb) XXH3_128bits_reset(sb);
    if (sa) XXH3_128bits_reset(sa);

    uint64_t ea = 0, eb = 0;
    int err;
    int zkind = 0;
    const char *zmsg = "";
    Py_BEGIN_ALLOW_THREADS
    err = decode_frames(&ss, len, &ea, &eb, &zkind, &zmsg);
    if (!err) err = validate(&s, &ea, &eb);
    if (!err) {
        io_t io = {has_out ? (const uint8_t *)tv.buf : NULL, has_pos ? (int64_t *)pv.buf : NULL,
                   has_pos ? (uint8_t *)oldb.buf : NULL, has_pos ? (uint8_t *)newb.buf : NULL};
        apply_all(has_out ? (uint8_t *)ov.buf : (uint8_t *)tv.buf, &s, inverse, sb, sa, &io);
    }
    Py_END_ALLOW_THREADS

    PyObject *before = NULL, *after = NULL;
    if (err == DS_E_ZSTD) { /* the failure kind and zstd's message in the digests' places */
        before = PyLong_FromLong(zkind);
        after = PyUnicode_FromString(zmsg);
    } else {
        before = !err && sb ? hex_digest(sb) : Py_NewRef(Py_None);
        after = !err && sa ? hex_digest(sa) : Py_NewRef(Py_None);
    }
    XXH3_freeState(sb);
    XXH3_freeState(sa);
    if (before && after) result = Py_BuildValue("(iKKNN)", err, (unsigned long long)ea, (unsigned long long)eb, before, after);
    else {
        Py_XDECREF(before);
        Py_XDECREF(after);
    }
done:
    release_sections(&ss);
    if (has_pos) {
        PyBuffer_Release(&newb);
        PyBuffer_Release(&oldb);
        PyBuffer_Release(&pv);
    }
    if (has_out) PyBuffer_Release(&ov);
    PyBuffer_Release(&tv);
    return result;
}

PyMethodDef ds_apply_methods[] = {
    {"apply_segment", apply_segment, METH_VARARGS, apply_segment_doc},
    {NULL, NULL, 0, NULL},
};
