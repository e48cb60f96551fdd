/* Growable output buffers of the encode kernels (encode.c, planes.c): malloc, so usable without
 * the GIL. Static inline: each including unit gets its own copy. */
#ifndef DS_BUF_H
#define DS_BUF_H

#include "ds_native.h"
#include <stdlib.h>

typedef struct {
    uint8_t *p;
    size_t len, cap;
} dsbuf;

/* Initial capacity of an output buffer: most chunks change few elements. */
#define BUF_MIN 4096

static inline int reserve(dsbuf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t nc = b->cap ? b->cap : BUF_MIN;
    while (nc < b->len + extra) nc *= 2;
    uint8_t *q = (uint8_t *)realloc(b->p, nc);
    if (q == NULL) return -1;
    b->p = q;
    b->cap = nc;
    return 0;
}

static inline PyObject *buf_bytes(const dsbuf *b) {
    return PyBytes_FromStringAndSize((const char *)b->p, (Py_ssize_t)b->len);
}

#endif
