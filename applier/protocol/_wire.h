/*
 * Shared by the C accelerators (protocol/_speedups.c, apply/_lane.c): big-endian integers as
 * pgoutput sends them, and COPY text escaping of a value's bytes. Header-only, static inline.
 */
#ifndef APPLIER_WIRE_H
#define APPLIER_WIRE_H

#include <stdint.h>

static inline uint32_t
be16(const unsigned char *p)
{
    return ((uint32_t)p[0] << 8) | p[1];
}

static inline uint32_t
be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t
be64(const unsigned char *p)
{
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

/* Bytes of n bytes at p in COPY text format: backslash, tab, newline and carriage return are
 * escaped with a backslash. */
static inline Py_ssize_t
escaped_size(const char *p, Py_ssize_t n)
{
    Py_ssize_t i, size = n;
    for (i = 0; i < n; i++)
        if (p[i] == '\\' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r')
            size++;
    return size;
}

static inline char *
escape_into(char *out, const char *p, Py_ssize_t n)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        switch (p[i]) {
        case '\\': *out++ = '\\'; *out++ = '\\'; break;
        case '\t': *out++ = '\\'; *out++ = 't'; break;
        case '\n': *out++ = '\\'; *out++ = 'n'; break;
        case '\r': *out++ = '\\'; *out++ = 'r'; break;
        default: *out++ = p[i];
        }
    }
    return out;
}

#endif
