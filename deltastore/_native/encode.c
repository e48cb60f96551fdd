/* Encode kernels (issue 9, N1): the add-sparse/1 delta in one pass, the full codec's byte
 * planes, and XXH3-128 state digests. Output bytes equal the numpy path's exactly
 * (deltastore/codec/delta.py, full.py); tests/test_native.py proves it. */
#include "ds_native.h"

#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

/* Must equal deltastore.codec.delta.ESCAPE and NIBBLE_ESCAPE (checked by codec/_kernels.py). */
#define DS_GAP_ESCAPE 255
#define DS_NIBBLE_ESCAPE 15

/* Bytes of `new` hashed, then scanned, at a time: small enough to stay in L1/L2 between the
 * two, large enough that XXH3's per-update overhead is negligible. */
#define HASH_BLOCK (16 * 1024)

/* Bytes compared word by word before looking at single elements: at 1-2 % of bf16 elements
 * changed, ~60 % of 64-byte blocks have no change and are skipped with 8 word compares. */
#define SCAN_BLOCK 64

/* --- growable output buffers (malloc: usable without the GIL) ------------------------- */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} dsbuf;

/* Initial capacity of an output buffer: most chunks change few elements. */
#define BUF_MIN 4096

static int reserve(dsbuf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t nc = b->cap ? b->cap : BUF_MIN;
    while (nc < b->len + extra) nc *= 2;
    uint8_t *q = (uint8_t *)realloc(b->p, nc);
    if (q == NULL) return -1;
    b->p = q;
    b->cap = nc;
    return 0;
}

static PyObject *buf_bytes(const dsbuf *b) {
    return PyBytes_FromStringAndSize((const char *)b->p, (Py_ssize_t)b->len);
}

static int differs64(const uint8_t *a, const uint8_t *b) {
    uint64_t acc = 0;
    for (int k = 0; k < SCAN_BLOCK / 8; k++) {
        uint64_t x, y;
        memcpy(&x, a + 8 * k, 8);
        memcpy(&y, b + 8 * k, 8);
        acc |= x ^ y;
    }
    return acc != 0;
}

/* --- add-sparse/1 in one pass ----------------------------------------------------------- */

typedef struct {
    dsbuf syms;  /* one gap symbol per change */
    dsbuf rest;  /* u32 gap - DS_GAP_ESCAPE per escaped gap */
    dsbuf codes; /* paired 4-bit value codes, low nibble first */
    dsbuf esc;   /* zigzag values >= DS_NIBBLE_ESCAPE, full width */
    size_t k;    /* changes so far */
    size_t next; /* position after the last change */
    uint32_t max_rest;
} enc_out;

static void enc_free(enc_out *s) {
    free(s->syms.p);
    free(s->rest.p);
    free(s->codes.p);
    free(s->esc.p);
}

/* Scan elements [lo, hi): emit every change, advance `ob` if asked. -1: out of memory. */
#define DEFINE_SCAN(T, W)                                                                           \
    static int scan_##W(uint8_t *ob, const uint8_t *nb, size_t lo, size_t hi, int adv, enc_out *s) { \
        const size_t blk = SCAN_BLOCK / W;                                                           \
        size_t k = s->k, next = s->next;                                                             \
        uint32_t max_rest = s->max_rest;                                                             \
        int rc = 0;                                                                                  \
        for (size_t i = lo; i < hi; i += blk) {                                                      \
            size_t e = i + blk < hi ? i + blk : hi;                                                  \
            if (e - i == blk && !differs64(ob + i * W, nb + i * W)) continue;                        \
            size_t m = e - i;                                                                        \
            if (reserve(&s->syms, m) || reserve(&s->codes, m / 2 + 1) || reserve(&s->rest, 4 * m) ||  \
                reserve(&s->esc, W * m)) {                                                           \
                rc = -1;                                                                             \
                break;                                                                               \
            }                                                                                        \
            uint8_t *syms = s->syms.p, *codes = s->codes.p;                                          \
            for (size_t j = i; j < e; j++) {                                                         \
                T ov, nv;                                                                            \
                memcpy(&ov, ob + j * W, W);                                                          \
                memcpy(&nv, nb + j * W, W);                                                          \
                if (ov == nv) continue;                                                              \
                size_t gap = j - next;                                                               \
                next = j + 1;                                                                        \
                uint8_t sym;                                                                         \
                if (gap >= DS_GAP_ESCAPE) {                                                          \
                    uint32_t r = (uint32_t)(gap - DS_GAP_ESCAPE);                                    \
                    memcpy(s->rest.p + s->rest.len, &r, 4);                                          \
                    s->rest.len += 4;                                                                \
                    if (r > max_rest) max_rest = r;                                                  \
                    sym = DS_GAP_ESCAPE;                                                             \
                } else {                                                                             \
                    sym = (uint8_t)gap;                                                              \
                }                                                                                    \
                syms[k] = sym;                                                                       \
                T d = (T)(nv - ov);                                                                  \
                T zz = (T)((T)(d << 1) ^ (T)(0 - (T)(d >> (8 * W - 1))));                            \
                uint8_t code = zz < DS_NIBBLE_ESCAPE ? (uint8_t)zz : DS_NIBBLE_ESCAPE;               \
                if (code == DS_NIBBLE_ESCAPE) {                                                      \
                    memcpy(s->esc.p + s->esc.len, &zz, W);                                           \
                    s->esc.len += W;                                                                 \
                }                                                                                    \
                if (k & 1)                                                                           \
                    codes[k >> 1] |= (uint8_t)(code << 4);                                           \
                else                                                                                 \
                    codes[k >> 1] = code;                                                            \
                k++;                                                                                 \
                if (adv) memcpy(ob + j * W, &nv, W);                                                 \
            }                                                                                        \
            s->syms.len = k;                                                                         \
            s->codes.len = (k + 1) / 2;                                                              \
        }                                                                                            \
        s->k = k;                                                                                    \
        s->next = next;                                                                              \
        s->max_rest = max_rest;                                                                      \
        return rc;                                                                                   \
    }

DEFINE_SCAN(uint8_t, 1)
DEFINE_SCAN(uint16_t, 2)
DEFINE_SCAN(uint32_t, 4)
DEFINE_SCAN(uint64_t, 8)

typedef int (*scan_fn)(uint8_t *, const uint8_t *, size_t, size_t, int, enc_out *);

static scan_fn scan_for(int w) {
    switch (w) {
    case 1: return scan_1;
    case 2: return scan_2;
    case 4: return scan_4;
    default: return scan_8;
    }
}

/* Runs without the GIL. The digest covers all of `nb` when `always` or when anything changed
 * (hashing starts lazily at the first changed block, catching up on the blocks before it). */
static int encode_add_pass(uint8_t *ob, const uint8_t *nb, size_t count, int w, int adv, int always,
                           enc_out *s, XXH3_state_t *st, int *hashed) {
    scan_fn scan = scan_for(w);
    const size_t step = HASH_BLOCK / (size_t)w;
    size_t hashed_upto = 0; /* elements */
    *hashed = 0;
    if (always) {
        XXH3_128bits_reset(st);
        *hashed = 1;
    }
    for (size_t h0 = 0; h0 < count; h0 += step) {
        size_t h1 = count - h0 > step ? h0 + step : count;
        if (*hashed) { /* hash first: the scan then finds the block in cache */
            XXH3_128bits_update(st, nb + h0 * w, (h1 - h0) * (size_t)w);
            hashed_upto = h1;
        }
        size_t before = s->k;
        if (scan(ob, nb, h0, h1, adv, s) < 0) return -1;
        if (!*hashed && s->k != before) {
            XXH3_128bits_reset(st);
            XXH3_128bits_update(st, nb, h1 * (size_t)w);
            hashed_upto = h1;
            *hashed = 1;
        }
    }
    (void)hashed_upto;
    return 0;
}

static int acquire_pair(PyObject *old_obj, PyObject *new_obj, int adv, Py_buffer *ob, Py_buffer *nb, int w) {
    if (ds_get_buffer(old_obj, ob, adv, "old") < 0) return -1;
    if (ds_get_buffer(new_obj, nb, 0, "new") < 0) {
        PyBuffer_Release(ob);
        return -1;
    }
    const char *err = NULL;
    if (ob->len != nb->len)
        err = "old and new differ in length";
    else if (ob->len % w)
        err = "buffer length is not a multiple of the element width";
    else if ((uint64_t)(ob->len / w) > 0xFFFFFFFFull)
        err = "more than 2**32 - 1 elements in one chunk";
    else if (adv && ob->buf != nb->buf && (const char *)ob->buf < (const char *)nb->buf + nb->len &&
             (const char *)nb->buf < (const char *)ob->buf + ob->len)
        err = "old and new overlap";
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        PyBuffer_Release(ob);
        PyBuffer_Release(nb);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(encode_add_doc,
"encode_add(old, new, width, advance, always_digest) -> (n_changed, gap_symbols, gap_rests,\n"
"    max_rest, value_codes, value_escapes, digest)\n\n"
"One pass over two chunks of `width`-byte little-endian elements: the add-sparse/1 sections'\n"
"raw planes (gap symbols; u32 escaped gap remainders; paired 4-bit zigzag codes; escaped\n"
"zigzag values), `old` advanced to `new` at every change when `advance`, and the XXH3-128\n"
"hex digest of `new` (None when nothing changed and not `always_digest`). Releases the GIL.\n"
"On MemoryError `old` may be partly advanced.");

static PyObject *py_encode_add(PyObject *self, PyObject *args) {
    PyObject *old_obj, *new_obj;
    long width;
    int adv, always;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOlpp:encode_add", &old_obj, &new_obj, &width, &adv, &always)) return NULL;
    int w = ds_check_width(width);
    if (w < 0) return NULL;
    Py_buffer ob, nb;
    if (acquire_pair(old_obj, new_obj, adv, &ob, &nb, w) < 0) return NULL;
    enc_out s;
    memset(&s, 0, sizeof s);
    XXH3_state_t *st = XXH3_createState();
    int rc = -1, hashed = 0;
    if (st != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = encode_add_pass((uint8_t *)ob.buf, (const uint8_t *)nb.buf, (size_t)(nb.len / w), w, adv, always,
                             &s, st, &hashed);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&nb);
    PyObject *result = NULL;
    if (rc < 0) {
        PyErr_NoMemory();
    } else {
        PyObject *digest;
        if (hashed) {
            XXH128_hash_t h = XXH3_128bits_digest(st);
            digest = ds_hex128(h.high64, h.low64);
        } else {
            digest = Py_NewRef(Py_None);
        }
        if (digest != NULL)
            result = Py_BuildValue("(nNNkNNN)", (Py_ssize_t)s.k, buf_bytes(&s.syms), buf_bytes(&s.rest),
                                   (unsigned long)s.max_rest, buf_bytes(&s.codes), buf_bytes(&s.esc), digest);
    }
    XXH3_freeState(st);
    enc_free(&s);
    return result;
}

/* --- state digests ---------------------------------------------------------------------- */

PyDoc_STRVAR(xxh3_128_hex_doc,
"xxh3_128_hex(buffer) -> str\n\n"
"XXH3-128 of a C-contiguous buffer's bytes, as xxhash.xxh3_128_hexdigest writes it. Releases\n"
"the GIL.");

static PyObject *py_xxh3_128_hex(PyObject *self, PyObject *arg) {
    Py_buffer b;
    (void)self;
    if (ds_get_buffer(arg, &b, 0, "buffer") < 0) return NULL;
    XXH128_hash_t h;
    Py_BEGIN_ALLOW_THREADS
    h = XXH3_128bits(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return ds_hex128(h.high64, h.low64);
}

PyMethodDef ds_encode_methods[] = {
    {"encode_add", py_encode_add, METH_VARARGS, encode_add_doc},
    {"xxh3_128_hex", py_xxh3_128_hex, METH_O, xxh3_128_hex_doc},
    {NULL, NULL, 0, NULL},
};
