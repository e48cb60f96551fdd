/* Shared declarations of the native kernels (deltastore._native).
 *
 * Each kernel file exports one method table; module.c adds them all to the module. Kernels take
 * buffers through the buffer protocol, check sizes, contiguity and writability before touching
 * them, and release the GIL around every loop over elements. */
#ifndef DS_NATIVE_H
#define DS_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Bumped when a kernel's Python-visible signature changes; _util/kernels.py checks it, so a
 * stale build in the source tree is refused (numpy path) rather than called wrongly. */
#define DS_NATIVE_ABI 2

/* add-sparse/1's escape symbols: must equal deltastore.codec.delta.ESCAPE and NIBBLE_ESCAPE
 * (exported as GAP_ESCAPE and NIBBLE_ESCAPE; tests/codec/test_native.py compares them). */
#define DS_GAP_ESCAPE 255
#define DS_NIBBLE_ESCAPE 15

/* What a kernel hashes of a chunk it encodes (encode_add, requant_delta): nothing, the new chunk if
 * anything changed, or always (deltastore.codec.delta.DIGEST_NONE, _IF_CHANGED, _ALWAYS). */
enum { DIGEST_NONE = 0, DIGEST_IF_CHANGED = 1, DIGEST_ALWAYS = 2 };

extern PyMethodDef ds_encode_methods[]; /* encode.c */
extern PyMethodDef ds_apply_methods[];  /* apply.c */
extern PyMethodDef ds_ctx_methods[];    /* ctx.c */
extern PyMethodDef ds_planes_methods[]; /* planes.c */
extern PyMethodDef ds_groups_methods[]; /* groups.c */
extern PyMethodDef ds_zstd_methods[];   /* zstd.c */
extern PyMethodDef ds_full_methods[];   /* full.c */
extern PyMethodDef ds_quant_methods[];  /* quant.c */
extern PyMethodDef ds_requant_methods[]; /* requant.c */

/* The 32 lowercase hex digits of an XXH3-128 digest (high 64 bits first, as
 * xxhash.xxh3_128_hexdigest writes them) as a new str. */
PyObject *ds_hex128(uint64_t high, uint64_t low);

/* Acquire a C-contiguous byte buffer of obj (writable if asked); on failure a Python error is
 * set and -1 returned. */
int ds_get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what);

/* A new read-only buffer object (module.c) that owns `p` (malloc'd, `cap` bytes; returned to the
 * pool with the object, or freed at once on failure, which returns NULL with an error set). */
PyObject *ds_buffer_take(void *p, size_t len, size_t cap);

/* A released output buffer to reuse (its capacity in *cap; NULL and 0 when none), and one handed
 * back (kept for reuse when large and the pool has room, else freed). Call with the GIL held. */
void *ds_pool_get(size_t *cap);
void ds_pool_put(void *p, size_t cap);

/* Element width (1, 2, 4, 8) from a Python int, or -1 with ValueError set. */
int ds_check_width(long width);

/* zstd.c: whether a libzstd is loaded (loads it at the first call; call with the GIL held), and
 * one frame decoded into exactly `cap` bytes at dst (without the GIL; this thread's context):
 * 0, or the failure kind with *value / *message as zstd_decompress reports them. */
enum { DS_ZE_NOT_FRAME = 1, DS_ZE_CLAIMS = 2, DS_ZE_BAD_FRAME = 3, DS_ZE_SIZE = 4 };
int ds_zstd_ready(void);

/* zstd.c: whether libzstd can compress (call with the GIL held: loads it), its bound for n
 * bytes, and n bytes at src compressed into dst (cap bytes) as one frame with the byte planes'
 * parameters (this thread's context; without the GIL): 0 and the size in *out, or -1. */
int ds_zstd_compresses(void);
size_t ds_zstd_bound(size_t n);
int ds_zstd_compress(const void *src, size_t n, void *dst, size_t cap, size_t *out);
int ds_zstd_decode(const void *src, size_t len, void *dst, size_t cap, unsigned long long *value,
                   const char **message);

/* zstd.c: one frame decoded a piece at a time (without the GIL, after ds_zstd_ready), in a context
 * of its own whose window is at most 2**window_log_max bytes. open makes ds_zstd_decode's checks
 * before decoding anything; read decodes exactly the next n bytes; end checks that the frame ends
 * there (its last block and checksum, nothing more); each returns 0 or a failure kind (as
 * ds_zstd_decode). free releases the stream (NULL is ignored). */
typedef struct ds_zstream ds_zstream;
int ds_zstream_open(ds_zstream **out, const void *src, size_t len, size_t cap, int window_log_max,
                    unsigned long long *value, const char **message);
int ds_zstream_read(ds_zstream *s, void *dst, size_t n, unsigned long long *value, const char **message);
int ds_zstream_end(ds_zstream *s, unsigned long long *value, const char **message);
void ds_zstream_free(ds_zstream *s);

#endif
