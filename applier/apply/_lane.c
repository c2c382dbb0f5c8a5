/*
 * C core of the apply stage's lane (applier/apply/fast/lane.py drives it): plain transactions made of
 * Begin, Inserts, Updates, Deletes and Commit, taken straight from the received payloads into the
 * batch's open runs, with no message object built.
 *
 * A run belongs to one table, which the apply stage opened it for (the batch's open runs, a dict
 * by relation id, shared with the lane):
 * - Run: inserts, as COPY text lines or, for values the source sent in binary (the stream's
 *   binary option), as COPY binary tuples: a binary value is already in the type's send format,
 *   which is what COPY binary carries, so it is copied as it is behind its length;
 * - KeyRun: changes by key: updates that carry every column and keep their key, or deletes by
 *   key (only the key is kept), every one in order; the batch folds them by key before they are
 *   sent (applier/apply/fast/batch.py owns that rule).
 * A run holds values of one format (text or binary, NULLs aside); a row in the other format is
 * the ordinary path's.
 *
 * A run of a table the change feed records (--change-feed) also keeps a change row for every
 * change it takes in its ``feed`` buffer, in the run's format: the meta of the change
 * (the commit LSN, commit time and xid of its transaction, its order in it, the operation), then
 * the row's values (a delete's: its key); the fast path writes them to the change table in the
 * same target transaction (by COPY; a delete's from the target's old row). A change row needs the
 * change table's partition for its commit LSN: the lane writes one only below ``feed_until``
 * (every change table has its partition there), else it stops and the ordinary path creates it.
 * A whole transaction taken that wrote change rows also leaves its commit and end LSN, as elements
 * of applier.change_commits' arrays, in ``commit_lsns`` and ``end_lsns`` (``record_commits``).
 *
 * The lane takes what it is sure of and stops at the first payload it is not, saying why
 * (reason); whatever it stops at goes the ordinary way (decoder, assembler, sink), which also
 * reports every malformed message, so the lane has no errors of its own. It keeps no state
 * between calls: a transaction still open when it returns is handed back through ``begin``.
 *
 * Owns nothing but speed: without it (no compiler, or APPLIER_PURE_PYTHON=1) the ordinary path
 * takes everything, with the same outcome on the target.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "../protocol/_wire.h"

/* ---- Change rows of a recorded table, in a run ----------------------------------------------- */

typedef struct {
    PyObject *data;          /* bytearray of change rows (COPY text lines or binary tuples), or None */
    Py_ssize_t rows;         /* change rows in data */
} Feed;

/* A run's feed: an empty buffer when ``record`` (the table is recorded), else None. */
static int
feed_init(Feed *feed, int record)
{
    feed->data = record ? PyByteArray_FromStringAndSize(NULL, 0) : Py_NewRef(Py_None);
    feed->rows = 0;
    return feed->data == NULL ? -1 : 0;
}

#define FEED_MEMBERS(type)                                                                        \
    {"feed", T_OBJECT_EX, offsetof(type, feed.data), READONLY,                                   \
     "change rows (COPY text lines or binary tuples: meta, then the row), or None: not recorded"}, \
    {"feed_rows", T_PYSSIZET, offsetof(type, feed.rows), READONLY, "change rows in feed"}

/* ---- Run: inserts as COPY text or binary --------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *data;          /* bytearray: COPY text lines, or binary tuples (no header, no trailer) */
    Py_ssize_t columns;      /* values per row */
    Py_ssize_t rows;         /* rows in data */
    int binary;              /* values in binary: data holds COPY binary tuples */
    Feed feed;               /* the change rows of a recorded table */
} RunObject;

static PyObject *
run_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t columns;
    int binary = 0, record = 0;
    RunObject *self;
    static char *keywords[] = {"columns", "binary", "feed", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|pp", keywords, &columns, &binary, &record))
        return NULL;
    if (columns < 1) {
        PyErr_SetString(PyExc_ValueError, "Run(columns): at least one column");
        return NULL;
    }
    self = (RunObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->data = PyByteArray_FromStringAndSize(NULL, 0);
    if (self->data == NULL || feed_init(&self->feed, record) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->columns = columns;
    self->binary = binary;
    return (PyObject *)self;
}

static void
run_dealloc(RunObject *self)
{
    Py_XDECREF(self->data);
    Py_XDECREF(self->feed.data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef run_members[] = {
    {"data", T_OBJECT_EX, offsetof(RunObject, data), READONLY,
     "the rows as COPY text lines or COPY binary tuples (bytearray)"},
    {"columns", T_PYSSIZET, offsetof(RunObject, columns), READONLY, "values per row"},
    {"rows", T_PYSSIZET, offsetof(RunObject, rows), 0, "rows in data"},
    {"binary", T_INT, offsetof(RunObject, binary), READONLY, "values in binary (COPY binary tuples)"},
    FEED_MEMBERS(RunObject),
    {NULL},
};

static PyTypeObject RunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "applier.apply._lane.Run",
    .tp_basicsize = sizeof(RunObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Run(columns, binary=False, feed=False)\n--\n\nInserts into one table, as COPY text "
              "lines or (binary) COPY binary tuples; with feed, their change rows too.",
    .tp_new = run_new,
    .tp_dealloc = (destructor)run_dealloc,
    .tp_members = run_members,
};

/* ---- KeyRun: updates or deletes by key -------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t columns;      /* values per row */
    PyObject *keys;          /* tuple of int: positions of the key columns */
    Py_ssize_t *key_at;      /* the same, for C */
    Py_ssize_t nkeys;
    int whole_rows;          /* updates: rows hold every column; deletes: only the key */
    int binary;              /* values in binary (statement parameters in binary format) */
    PyObject *rows;          /* list of tuples (bytes or None), one per change, in order */
    Feed feed;               /* the change rows of a recorded table (updates) */
} KeyRunObject;

static PyObject *
key_run_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t columns, i;
    PyObject *keys;
    int whole_rows, binary = 0, record = 0;
    KeyRunObject *self;
    static char *keywords[] = {"columns", "keys", "whole_rows", "binary", "feed", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nO!p|pp", keywords, &columns, &PyTuple_Type, &keys,
                                     &whole_rows, &binary, &record))
        return NULL;
    if (columns < 1 || PyTuple_GET_SIZE(keys) < 1) {
        PyErr_SetString(PyExc_ValueError, "KeyRun(): at least one column and one key");
        return NULL;
    }
    self = (KeyRunObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->columns = columns;
    self->whole_rows = whole_rows;
    self->binary = binary;
    self->keys = Py_NewRef(keys);
    self->nkeys = PyTuple_GET_SIZE(keys);
    self->key_at = PyMem_New(Py_ssize_t, self->nkeys);
    self->rows = PyList_New(0);
    if (self->key_at == NULL || self->rows == NULL
        || feed_init(&self->feed, record) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (i = 0; i < self->nkeys; i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(keys, i));
        if (at == -1 && PyErr_Occurred()) {
            Py_DECREF(self);
            return NULL;
        }
        if (at < 0 || at >= columns) {
            PyErr_SetString(PyExc_ValueError, "KeyRun(): a key position out of range");
            Py_DECREF(self);
            return NULL;
        }
        self->key_at[i] = at;
    }
    return (PyObject *)self;
}

static void
key_run_dealloc(KeyRunObject *self)
{
    Py_XDECREF(self->keys);
    Py_XDECREF(self->rows);
    Py_XDECREF(self->feed.data);
    PyMem_Free(self->key_at);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Record one change (a tuple of every column's value, stolen): of a delete, its key alone. */
static int
key_run_put(KeyRunObject *self, PyObject *row)
{
    int failed;
    if (!self->whole_rows) {  /* a delete: the key is all it needs */
        PyObject *key = PyTuple_New(self->nkeys);
        Py_ssize_t i;
        if (key == NULL) {
            Py_DECREF(row);
            return -1;
        }
        for (i = 0; i < self->nkeys; i++)
            PyTuple_SET_ITEM(key, i, Py_NewRef(PyTuple_GET_ITEM(row, self->key_at[i])));
        Py_SETREF(row, key);
    }
    failed = PyList_Append(self->rows, row);
    Py_DECREF(row);
    return failed;
}

/* add(values): the ordinary path's update of every column, or delete by key (a tuple of every
 * column's bytes or None). */
static PyObject *
key_run_add(KeyRunObject *self, PyObject *values)
{
    if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != self->columns) {
        PyErr_SetString(PyExc_TypeError, "KeyRun.add(values): a tuple of every column's value");
        return NULL;
    }
    if (key_run_put(self, Py_NewRef(values)) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* params(start, stop): the statement parameters of rows [start, stop). Updates: each row's
 * columns, then its key's (UPDATE ... FROM (VALUES ...) sets every column where the key
 * matches); deletes: each key. */
static PyObject *
key_run_params(KeyRunObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t start, stop, r, c, n = 0;
    Py_ssize_t width = self->whole_rows ? self->columns + self->nkeys : self->nkeys;
    PyObject *out;
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "params(start, stop)");
    start = PyLong_AsSsize_t(args[0]);
    stop = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (start < 0 || stop > PyList_GET_SIZE(self->rows) || start > stop)
        return PyErr_Format(PyExc_IndexError, "params(): rows %zd..%zd out of range", start, stop);
    out = PyList_New((stop - start) * width);
    if (out == NULL)
        return NULL;
    for (r = start; r < stop; r++) {
        PyObject *row = PyList_GET_ITEM(self->rows, r);
        if (!self->whole_rows) {  /* the row is the key */
            for (c = 0; c < self->nkeys; c++)
                PyList_SET_ITEM(out, n++, Py_NewRef(PyTuple_GET_ITEM(row, c)));
            continue;
        }
        for (c = 0; c < self->columns; c++)
            PyList_SET_ITEM(out, n++, Py_NewRef(PyTuple_GET_ITEM(row, c)));
        for (c = 0; c < self->nkeys; c++)
            PyList_SET_ITEM(out, n++, Py_NewRef(PyTuple_GET_ITEM(row, self->key_at[c])));
    }
    return out;
}

static Py_ssize_t
key_run_len(KeyRunObject *self)
{
    return PyList_GET_SIZE(self->rows);
}

static PyMemberDef key_run_members[] = {
    {"columns", T_PYSSIZET, offsetof(KeyRunObject, columns), READONLY, "values per row"},
    {"keys", T_OBJECT_EX, offsetof(KeyRunObject, keys), READONLY, "key column positions"},
    {"whole_rows", T_INT, offsetof(KeyRunObject, whole_rows), READONLY,
     "updates (every column) rather than deletes (the key)"},
    {"binary", T_INT, offsetof(KeyRunObject, binary), READONLY, "values in binary"},
    {"rows", T_OBJECT_EX, offsetof(KeyRunObject, rows), READONLY,
     "every change (a delete's: its key), in order; the batch folds them in place before sending"},
    FEED_MEMBERS(KeyRunObject),
    {NULL},
};

static PyMethodDef key_run_methods[] = {
    {"add", (PyCFunction)key_run_add, METH_O,
     "add(values)\n--\n\nRecord a change by key (replacing one of the same key)."},
    {"params", (PyCFunction)(void (*)(void))key_run_params, METH_FASTCALL,
     "params(start, stop)\n--\n\nStatement parameters of rows start..stop: for updates every "
     "column, then the key; for deletes the key."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods key_run_sequence = {
    .sq_length = (lenfunc)key_run_len,
};

static PyTypeObject KeyRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "applier.apply._lane.KeyRun",
    .tp_basicsize = sizeof(KeyRunObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyRun(columns, keys, whole_rows, binary=False, feed=False)\n--\n\nUpdates of every "
              "column (whole_rows) or deletes of one table by key, values in text or (binary) "
              "binary, every change in order (rows; the batch folds them by key); len() is the "
              "rows held. With feed, the change rows of every change.",
    .tp_new = key_run_new,
    .tp_dealloc = (destructor)key_run_dealloc,
    .tp_members = key_run_members,
    .tp_methods = key_run_methods,
    .tp_as_sequence = &key_run_sequence,
};

/* ---- Lane ------------------------------------------------------------------------------------ */

/* Why take() returned. */
enum { LANE_END = 0, LANE_FOREIGN = 1, LANE_NO_RUN = 2, LANE_PART = 3, LANE_LIMIT = 4 };
/* A change's outcome. */
enum { TAKEN = 0, REFUSED = 1, NO_RUN = 2, FAILED = -1 };

typedef struct {
    PyObject_HEAD
    /* set by the caller before take() */
    PyObject *runs;              /* dict: relation id -> Run or KeyRun */
    int whole;                   /* take whole transactions (else only changes of an open one) */
    int streamed;                /* the payloads come from a stream block: changes carry an xid */
    unsigned long long after;    /* take a Begin only with a final LSN above this */
    Py_ssize_t part_room;        /* updated or deleted rows, then stop: a part is due */
    Py_ssize_t insert_part_room; /* inserted rows, likewise */
    Py_ssize_t rows_room;        /* rows, then stop after the Commit: the batch is full */
    Py_ssize_t bytes_room;       /* bytes of values, likewise */
    /* the outcome of the last take() */
    int reason;
    Py_ssize_t inserts, updates, deletes, bytes, transactions;
    unsigned int relation;       /* LANE_NO_RUN: the relation that has no run of that kind */
    int kind;                    /* LANE_NO_RUN: 'I', 'U' or 'D' */
    int binary;                  /* LANE_NO_RUN: the change's values are in binary */
    unsigned int xid;            /* xid of the last transaction committed */
    PyObject *commit;            /* the last Commit payload taken, or None */
    PyObject *begin;             /* the Begin payload of a transaction left open, or None */
    /* within one take(): the run last found */
    PyObject *cached_run;
    unsigned int cached_relation;
    /* the change feed: the stamp of the transaction whose changes are taken (from its Begin, or
     * set_stamp() for the changes of an open one), and its change rows' text meta */
    unsigned long long feed_until;  /* change rows only for a commit LSN below this */
    int stamped;                 /* the stamp is known: change rows may be written */
    unsigned long long stamp_lsn;  /* PENDING_LSN: the commit is not known yet */
    long long stamp_time;        /* microseconds since 2000-01-01 UTC */
    int stamp_timed;             /* the commit time is known (else NULL) */
    unsigned int stamp_xid;
    long long seq;               /* change rows the transaction has so far */
    char prefix[80];             /* "LSN\ttime\txid\t", made when first needed */
    Py_ssize_t prefix_len;       /* 0: not made yet */
    /* the change feed's applier.change_commits: the commit and end LSN ("X/X,", array elements)
     * of each whole transaction taken that wrote change rows, emptied by each take() */
    int record_commits;
    PyObject *commit_lsns;       /* bytearray */
    PyObject *end_lsns;          /* bytearray */
    Py_ssize_t commit_rows;
} LaneObject;

static int
lane_init(LaneObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *runs;
    static char *keywords[] = {"runs", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!", keywords, &PyDict_Type, &runs))
        return -1;
    Py_XSETREF(self->runs, Py_NewRef(runs));
    Py_XSETREF(self->commit, Py_NewRef(Py_None));
    Py_XSETREF(self->begin, Py_NewRef(Py_None));
    Py_XSETREF(self->commit_lsns, PyByteArray_FromStringAndSize(NULL, 0));
    Py_XSETREF(self->end_lsns, PyByteArray_FromStringAndSize(NULL, 0));
    return self->commit_lsns == NULL || self->end_lsns == NULL ? -1 : 0;
}

static void
lane_dealloc(LaneObject *self)
{
    Py_XDECREF(self->runs);
    Py_XDECREF(self->commit);
    Py_XDECREF(self->begin);
    Py_XDECREF(self->commit_lsns);
    Py_XDECREF(self->end_lsns);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The open run of the relation, if it is of the given type (borrowed), else NULL with
 * self->relation set; NULL with an exception on a Python error. */
static PyObject *
find_run(LaneObject *self, unsigned int relation, PyTypeObject *type)
{
    PyObject *key, *found;
    if (self->cached_run != NULL && relation == self->cached_relation)
        found = self->cached_run;
    else {
        key = PyLong_FromUnsignedLong(relation);
        if (key == NULL)
            return NULL;
        found = PyDict_GetItemWithError(self->runs, key);
        Py_DECREF(key);
        if (found == NULL && PyErr_Occurred())
            return NULL;
        self->cached_run = found;
        self->cached_relation = relation;
    }
    if (found == NULL || Py_TYPE(found) != type) {
        self->relation = relation;
        return NULL;
    }
    return found;
}

/* Whether the tuple at p (after 'N') has its values in binary: its first value that is not NULL
 * is; the tuple is checked in full (check_tuple) before anything is taken from it. */
static int
tuple_is_binary(const unsigned char *p, Py_ssize_t len, Py_ssize_t pos)
{
    for (; pos < len && p[pos] == 'n'; pos++)
        ;
    return pos < len && p[pos] == 'b';
}

/* The tuple at p (after 'N'): every value in the given format ('t' text or 'b' binary) or NULL,
 * exactly natts of them, nothing after. Returns the end position, or -1; *value_bytes gets the
 * bytes of the values and, when size is not NULL, *size their size in COPY data (text: escaped,
 * tabs and newline included; binary: the field count and each value's length word). */
static Py_ssize_t
check_tuple(const unsigned char *p, Py_ssize_t len, Py_ssize_t pos, Py_ssize_t natts, char format,
            Py_ssize_t *value_bytes, Py_ssize_t *size)
{
    Py_ssize_t c, copy = format == 'b' ? 2 + 4 * natts : natts;
    *value_bytes = 0;
    for (c = 0; c < natts; c++) {
        if (pos >= len)
            return -1;
        if (p[pos] == 'n') {
            pos++;
            if (format == 't')
                copy += 2;
        }
        else if (p[pos] == format) {
            Py_ssize_t n;
            if (pos + 5 > len)
                return -1;
            n = be32(p + pos + 1);
            pos += 5;
            if (n > len - pos)
                return -1;
            if (size != NULL)
                copy += format == 't' ? escaped_size((const char *)p + pos, n) : n;
            *value_bytes += n;
            pos += n;
        }
        else {
            return -1;  /* the other format, or unchanged TOAST ('u'): the ordinary path's */
        }
    }
    if (pos != len)
        return -1;
    if (size != NULL)
        *size = copy;
    return pos;
}

static char *
put_be32(char *out, uint32_t v)
{
    *out++ = (char)(v >> 24);
    *out++ = (char)(v >> 16);
    *out++ = (char)(v >> 8);
    *out++ = (char)v;
    return out;
}

static char *
put_be64(char *out, uint64_t v)
{
    return put_be32(put_be32(out, (uint32_t)(v >> 32)), (uint32_t)v);
}

/* The values of the tuple at p[pos..] (checked by check_tuple) into out: as a COPY text line
 * (escaped, tab-separated, newline-ended), or as binary fields (each value's length and bytes;
 * NULL: -1) without the field count. */
static char *
put_values(char *out, const unsigned char *p, Py_ssize_t pos, Py_ssize_t natts, int binary)
{
    Py_ssize_t c;
    for (c = 0; c < natts; c++) {
        if (p[pos] == 'n') {
            pos++;
            if (binary)
                out = put_be32(out, 0xFFFFFFFFu);
            else {
                *out++ = '\\';
                *out++ = 'N';
            }
        }
        else {
            Py_ssize_t n = be32(p + pos + 1);
            if (binary) {  /* the length word as received, then the value */
                memcpy(out, p + pos + 1, 4 + n);
                out += 4 + n;
            }
            else
                out = escape_into(out, (const char *)p + pos + 5, n);
            pos += 5 + n;
        }
        if (!binary)
            *out++ = c + 1 < natts ? '\t' : '\n';
    }
    return out;
}

/* The commit LSN of change rows whose transaction has not committed yet (its change table's
 * pending partition, which always exists, holds them until the commit fixes them). */
#define PENDING_LSN UINT64_MAX

/* Whether the change in a recorded table's run may have its change row now: the stamp is known
 * and the change table has its partition for the commit LSN. */
static int
feed_allowed(LaneObject *self, Feed *feed)
{
    return feed->data == Py_None
        || (self->stamped && (self->stamp_lsn < self->feed_until || self->stamp_lsn == PENDING_LSN));
}

/* The text meta of the transaction's change rows: commit LSN, commit time (UTC, microseconds),
 * xid, each followed by a tab. */
static void
make_prefix(LaneObject *self)
{
    const long long day = 86400LL * 1000000LL;
    /* 2000-01-01 (PostgreSQL's epoch) is 10,957 days after 1970-01-01 */
    long long unix_us = self->stamp_time + 10957LL * day;
    long long seconds = unix_us >= 0 ? unix_us / 1000000 : -((-unix_us + 999999) / 1000000);
    time_t t = (time_t)seconds;
    struct tm tm;
    if (!self->stamp_timed) {
        self->prefix_len = snprintf(self->prefix, sizeof self->prefix, "%X/%X\t\\N\t%u\t",
                                    (unsigned int)(self->stamp_lsn >> 32), (unsigned int)self->stamp_lsn,
                                    self->stamp_xid);
        return;
    }
    gmtime_r(&t, &tm);
    self->prefix_len = snprintf(self->prefix, sizeof self->prefix,
                                "%X/%X\t%04d-%02d-%02d %02d:%02d:%02d.%06lld+00\t%u\t",
                                (unsigned int)(self->stamp_lsn >> 32), (unsigned int)self->stamp_lsn,
                                tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                                tm.tm_sec, unix_us - seconds * 1000000, self->stamp_xid);
}

/* The change row of the change at p (the tuple from pos: natts values, ``size`` bytes as COPY
 * data, checked) into feed, after its meta; op: 'I' or 'U'. */
static int
feed_put(LaneObject *self, Feed *feed, char op, const unsigned char *p, Py_ssize_t pos,
         Py_ssize_t natts, int binary, Py_ssize_t size)
{
    Py_ssize_t old = PyByteArray_GET_SIZE(feed->data), meta, seq_len = 0;
    char text_seq[24];
    char *out;
    self->seq++;
    if (binary)  /* four int8-sized meta values (the time may be NULL) and the one-byte op, each
                  * behind its length */
        meta = 4 * (4 + 8) + 4 + 1 - (self->stamp_timed ? 0 : 8);
    else {
        if (self->prefix_len == 0)
            make_prefix(self);
        seq_len = snprintf(text_seq, sizeof text_seq, "%lld\t", self->seq);
        meta = self->prefix_len + seq_len + 2;
    }
    if (PyByteArray_Resize(feed->data, old + meta + size) < 0)
        return FAILED;
    out = PyByteArray_AS_STRING(feed->data) + old;
    if (binary) {  /* size counts the tuple's field count: replaced by one with the meta */
        Py_ssize_t fields = 5 + natts;
        *out++ = (char)(fields >> 8);
        *out++ = (char)fields;
        out = put_be64(put_be32(out, 8), self->stamp_lsn);
        if (self->stamp_timed)
            out = put_be64(put_be32(out, 8), (uint64_t)self->stamp_time);
        else
            out = put_be32(out, 0xFFFFFFFFu);  /* NULL */
        out = put_be64(put_be32(out, 8), self->stamp_xid);
        out = put_be64(put_be32(out, 8), (uint64_t)self->seq);
        out = put_be32(out, 1);
        *out++ = op;
    }
    else {
        memcpy(out, self->prefix, self->prefix_len);
        out += self->prefix_len;
        memcpy(out, text_seq, seq_len);
        out += seq_len;
        *out++ = op;
        *out++ = '\t';
    }
    put_values(out, p, pos, natts, binary);
    feed->rows++;
    return TAKEN;
}

/* An Insert ('I', [xid], relation id, 'N', tuple) as a COPY text line or binary tuple of its
 * table's Run. */
static int
lane_insert(LaneObject *self, const unsigned char *p, Py_ssize_t len)
{
    Py_ssize_t natts, size, value_bytes, old;
    RunObject *run;
    char *out;

    if (len < 8 || p[5] != 'N')
        return REFUSED;
    run = (RunObject *)find_run(self, be32(p + 1), &RunType);
    if (run == NULL) {
        self->binary = tuple_is_binary(p, len, 8);
        return PyErr_Occurred() ? FAILED : NO_RUN;
    }
    natts = be16(p + 6);
    if (natts != run->columns || !feed_allowed(self, &run->feed)
        || check_tuple(p, len, 8, natts, run->binary ? 'b' : 't', &value_bytes, &size) < 0)
        return REFUSED;
    old = PyByteArray_GET_SIZE(run->data);
    if (PyByteArray_Resize(run->data, old + size) < 0)
        return FAILED;
    out = PyByteArray_AS_STRING(run->data) + old;
    if (run->binary) {  /* field count, then each value as its length and bytes */
        *out++ = (char)(natts >> 8);
        *out++ = (char)natts;
    }
    put_values(out, p, 8, natts, run->binary);
    if (run->feed.data != Py_None && feed_put(self, &run->feed, 'I', p, 8, natts, run->binary, size) < 0)
        return FAILED;
    run->rows++;
    self->inserts++;
    self->bytes += value_bytes;
    return TAKEN;
}

/* An Update that keeps its key and sends every column ('U', [xid], relation id, 'N', tuple: no
 * old key or row) or a Delete by key ('D', [xid], relation id, 'K', key tuple) as a change of its
 * table's KeyRun of that kind. p: the message with its type byte where p[0] would be (the xid
 * skipped in a stream block), so the type comes apart, in update. */
static int
lane_keyed(LaneObject *self, int update, const unsigned char *p, Py_ssize_t len)
{
    Py_ssize_t natts, c, pos, value_bytes, size = 0;
    KeyRunObject *run;
    PyObject *row;

    /* An update with 'K' or 'O' changed its key or has REPLICA IDENTITY FULL; a delete with 'O'
     * has REPLICA IDENTITY FULL. */
    if (len < 8 || p[5] != (update ? 'N' : 'K'))
        return REFUSED;
    run = (KeyRunObject *)find_run(self, be32(p + 1), &KeyRunType);
    if (run == NULL) {
        self->binary = tuple_is_binary(p, len, 8);
        return PyErr_Occurred() ? FAILED : NO_RUN;
    }
    if (run->whole_rows != update) {  /* that table's open run is of the other kind */
        self->relation = be32(p + 1);
        self->binary = tuple_is_binary(p, len, 8);
        return NO_RUN;
    }
    natts = be16(p + 6);
    if (natts != run->columns || !feed_allowed(self, &run->feed)
        || check_tuple(p, len, 8, natts, run->binary ? 'b' : 't', &value_bytes,
                       run->feed.data != Py_None ? &size : NULL) < 0)
        return REFUSED;
    if (run->feed.data != Py_None
        && feed_put(self, &run->feed, update ? 'U' : 'D', p, 8, natts, run->binary, size) < 0)
        return FAILED;
    row = PyTuple_New(natts);
    if (row == NULL)
        return FAILED;
    pos = 8;
    for (c = 0; c < natts; c++) {
        PyObject *value;
        if (p[pos] == 'n') {
            pos++;
            value = Py_NewRef(Py_None);
        }
        else {
            Py_ssize_t n = be32(p + pos + 1);
            pos += 5;
            value = PyBytes_FromStringAndSize((const char *)p + pos, n);
            pos += n;
            if (value == NULL) {
                Py_DECREF(row);
                return FAILED;
            }
        }
        PyTuple_SET_ITEM(row, c, value);
    }
    if (key_run_put(run, row) < 0)
        return FAILED;
    if (update)
        self->updates++;
    else
        self->deletes++;
    self->bytes += value_bytes;
    return TAKEN;
}

/* An LSN as an array element of applier.change_commits ("X/X,") at the end of buffer. */
static int
put_lsn_element(PyObject *buffer, unsigned long long lsn)
{
    char text[24];
    Py_ssize_t old = PyByteArray_GET_SIZE(buffer);
    int n = snprintf(text, sizeof text, "%X/%X,", (unsigned int)(lsn >> 32), (unsigned int)lsn);
    if (PyByteArray_Resize(buffer, old + n) < 0)
        return FAILED;
    memcpy(PyByteArray_AS_STRING(buffer) + old, text, n);
    return TAKEN;
}

/* The commit and end LSN of a transaction taken whole that wrote change rows. */
static int
put_commit(LaneObject *self, unsigned long long commit_lsn, unsigned long long end_lsn)
{
    if (put_lsn_element(self->commit_lsns, commit_lsn) == FAILED
        || put_lsn_element(self->end_lsns, end_lsn) == FAILED)
        return FAILED;
    self->commit_rows++;
    return TAKEN;
}

/* take(payloads, start) -> index: take payloads from start on; returns the index of the first
 * one not taken (len(payloads) when all were). */
static PyObject *
lane_take(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *payloads, *open_begin = NULL, *last_commit = NULL;
    Py_ssize_t i, n;
    unsigned int open_xid = 0;
    unsigned long long open_final = 0;
    int open = 0;

    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take(payloads: list, start: int)");
        return NULL;
    }
    payloads = args[0];
    i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    n = PyList_GET_SIZE(payloads);
    if (i < 0 || i > n) {
        PyErr_SetString(PyExc_IndexError, "take(): start out of range");
        return NULL;
    }
    self->reason = LANE_END;
    self->inserts = self->updates = self->deletes = self->bytes = self->transactions = 0;
    if (PyByteArray_Resize(self->commit_lsns, 0) < 0 || PyByteArray_Resize(self->end_lsns, 0) < 0)
        return NULL;
    self->commit_rows = 0;
    if (self->whole)
        self->stamped = 0;
    self->cached_run = NULL;
    for (; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(payloads, i);
        const unsigned char *p;
        Py_ssize_t len;
        int outcome;
        if (!PyBytes_CheckExact(item)) {
            self->reason = LANE_FOREIGN;
            break;
        }
        p = (const unsigned char *)PyBytes_AS_STRING(item);
        len = PyBytes_GET_SIZE(item);
        if (len == 21 && p[0] == 'B' && self->whole && !open) {
            /* A transaction that goes on with anything but a row change is not for the lane:
             * the ordinary path takes it from its Begin. */
            if (i + 1 < n) {
                PyObject *next = PyList_GET_ITEM(payloads, i + 1);
                char first = PyBytes_CheckExact(next) && PyBytes_GET_SIZE(next) > 0
                    ? PyBytes_AS_STRING(next)[0] : 0;
                if (first != 'I' && first != 'U' && first != 'D' && first != 'C') {
                    self->reason = LANE_FOREIGN;
                    break;
                }
            }
            open_final = be64(p + 1);
            if (open_final <= self->after) {
                self->reason = LANE_FOREIGN;
                break;
            }
            open = 1;
            open_xid = be32(p + 17);
            open_begin = item;
            self->stamped = 1;
            self->stamp_lsn = open_final;
            self->stamp_time = (long long)be64(p + 9);
            self->stamp_timed = 1;
            self->stamp_xid = open_xid;
            self->seq = 0;
            self->prefix_len = 0;
            continue;
        }
        if (len == 26 && p[0] == 'C' && open && p[1] == 0 && be64(p + 2) == open_final) {
            /* Commit: flags, commit LSN, end LSN, time */
            if (self->seq > 0 && self->record_commits
                && put_commit(self, open_final, be64(p + 10)) == FAILED)
                return NULL;
            open = 0;
            open_begin = NULL;
            last_commit = item;
            self->stamped = 0;
            self->xid = open_xid;
            self->transactions++;
            if (self->inserts + self->updates + self->deletes >= self->rows_room
                || self->bytes >= self->bytes_room) {
                i++;
                self->reason = LANE_LIMIT;
                break;
            }
            continue;
        }
        if (len < 1 || (p[0] != 'I' && p[0] != 'U' && p[0] != 'D') || (self->whole && !open)) {
            self->reason = LANE_FOREIGN;
            break;
        }
        self->kind = p[0];
        {
            /* In a stream block the xid follows the type; only the transaction being applied is
             * delivered, so it is skipped. */
            Py_ssize_t skip = self->streamed ? 4 : 0;
            if (len < 1 + skip) {
                self->reason = LANE_FOREIGN;
                break;
            }
            outcome = p[0] == 'I' ? lane_insert(self, p + skip, len - skip)
                                  : lane_keyed(self, p[0] == 'U', p + skip, len - skip);
        }
        if (outcome == FAILED)
            return NULL;
        if (outcome != TAKEN) {
            self->reason = outcome == NO_RUN ? LANE_NO_RUN : LANE_FOREIGN;
            break;
        }
        if (self->updates + self->deletes >= self->part_room || self->inserts >= self->insert_part_room
            || self->bytes >= self->bytes_room) {
            i++;
            self->reason = LANE_PART;
            break;
        }
    }
    self->cached_run = NULL;
    Py_SETREF(self->begin, Py_NewRef(open_begin != NULL ? open_begin : Py_None));
    Py_SETREF(self->commit, Py_NewRef(last_commit != NULL ? last_commit : Py_None));
    return PyLong_FromSsize_t(i);
}

/* set_stamp(commit_lsn, commit_time, xid, seq) or set_stamp(None): the stamp of the open
 * transaction whose changes the next take() takes (None: its change rows are not for the lane;
 * commit_time None with the pending commit LSN: its commit is not known yet). */
static PyObject *
lane_set_stamp(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs == 1 && args[0] == Py_None) {
        self->stamped = 0;
        Py_RETURN_NONE;
    }
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "set_stamp(commit_lsn, commit_time, xid, seq) or set_stamp(None)");
    self->stamp_lsn = PyLong_AsUnsignedLongLong(args[0]);
    self->stamp_timed = args[1] != Py_None;
    self->stamp_time = self->stamp_timed ? PyLong_AsLongLong(args[1]) : 0;
    self->stamp_xid = (unsigned int)PyLong_AsUnsignedLong(args[2]);
    self->seq = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    self->stamped = 1;
    self->prefix_len = 0;
    Py_RETURN_NONE;
}

static PyMemberDef lane_members[] = {
    {"runs", T_OBJECT_EX, offsetof(LaneObject, runs), READONLY, "relation id -> Run or KeyRun"},
    {"whole", T_INT, offsetof(LaneObject, whole), 0, "take whole transactions"},
    {"streamed", T_INT, offsetof(LaneObject, streamed), 0, "payloads of a stream block (with xid)"},
    {"after", T_ULONGLONG, offsetof(LaneObject, after), 0, "take a Begin only above this final LSN"},
    {"part_room", T_PYSSIZET, offsetof(LaneObject, part_room), 0, "updated or deleted rows before a part is due"},
    {"insert_part_room", T_PYSSIZET, offsetof(LaneObject, insert_part_room), 0, "inserted rows before a part is due"},
    {"rows_room", T_PYSSIZET, offsetof(LaneObject, rows_room), 0, "rows before the batch is full"},
    {"bytes_room", T_PYSSIZET, offsetof(LaneObject, bytes_room), 0, "bytes before the batch is full"},
    {"reason", T_INT, offsetof(LaneObject, reason), READONLY, "why take() returned"},
    {"inserts", T_PYSSIZET, offsetof(LaneObject, inserts), READONLY, "inserts taken by the last take()"},
    {"updates", T_PYSSIZET, offsetof(LaneObject, updates), READONLY, "updates taken by the last take()"},
    {"deletes", T_PYSSIZET, offsetof(LaneObject, deletes), READONLY, "deletes taken by the last take()"},
    {"bytes", T_PYSSIZET, offsetof(LaneObject, bytes), READONLY, "bytes of their values"},
    {"transactions", T_PYSSIZET, offsetof(LaneObject, transactions), READONLY,
     "transactions committed by the last take()"},
    {"relation", T_UINT, offsetof(LaneObject, relation), READONLY, "the relation without a run"},
    {"kind", T_INT, offsetof(LaneObject, kind), READONLY, "the change it has no run for: 'I', 'U' or 'D'"},
    {"binary", T_INT, offsetof(LaneObject, binary), READONLY,
     "whether the change it has no run for has its values in binary"},
    {"xid", T_UINT, offsetof(LaneObject, xid), READONLY, "xid of the last transaction committed"},
    {"commit", T_OBJECT, offsetof(LaneObject, commit), READONLY, "the last Commit payload taken"},
    {"begin", T_OBJECT, offsetof(LaneObject, begin), READONLY,
     "the Begin payload of a transaction left open"},
    {"feed_until", T_ULONGLONG, offsetof(LaneObject, feed_until), 0,
     "change rows only for a commit LSN below this (every change table has its partition)"},
    {"record_commits", T_INT, offsetof(LaneObject, record_commits), 0,
     "keep the commit and end LSN of each whole transaction that wrote change rows"},
    {"commit_lsns", T_OBJECT_EX, offsetof(LaneObject, commit_lsns), READONLY,
     "commit LSNs (\"X/X,\" each) of the whole transactions the last take() took that wrote change rows"},
    {"end_lsns", T_OBJECT_EX, offsetof(LaneObject, end_lsns), READONLY, "their end LSNs, likewise"},
    {"commit_rows", T_PYSSIZET, offsetof(LaneObject, commit_rows), READONLY, "how many"},
    {"seq", T_LONGLONG, offsetof(LaneObject, seq), READONLY,
     "change rows of the open (or last) transaction so far: the last one's order"},
    {NULL},
};

static PyMethodDef lane_methods[] = {
    {"take", (PyCFunction)(void (*)(void))lane_take, METH_FASTCALL,
     "take(payloads, start)\n--\n\nTake payloads from start on; the index of the first not taken."},
    {"set_stamp", (PyCFunction)(void (*)(void))lane_set_stamp, METH_FASTCALL,
     "set_stamp(commit_lsn, commit_time, xid, seq)\n--\n\nThe stamp of the open transaction whose "
     "changes take() takes next (commit_time: microseconds since 2000-01-01, None while the "
     "commit is not known), or None: its change rows are not the lane's."},
    {NULL, NULL, 0, NULL},
};

/* ---- Restamping spooled change rows ------------------------------------------------------------ */

/* The end of the row at p (COPY binary tuple or text line) in [p, end), or NULL if cut short. */
static const unsigned char *
row_end(const unsigned char *p, const unsigned char *end, int binary)
{
    if (!binary) {
        const unsigned char *nl = memchr(p, '\n', (size_t)(end - p));
        return nl == NULL ? NULL : nl + 1;
    }
    if (end - p < 2)
        return NULL;
    Py_ssize_t fields = (Py_ssize_t)((p[0] << 8) | p[1]);
    p += 2;
    for (Py_ssize_t i = 0; i < fields; i++) {
        if (end - p < 4)
            return NULL;
        uint32_t len = be32(p);
        p += 4;
        if (len == 0xFFFFFFFFu)
            continue;
        if ((Py_ssize_t)len > end - p)
            return NULL;
        p += len;
    }
    return p;
}

/* restamp(rows, binary, old, new) -> (rows, restamped): the change rows ``rows`` (COPY binary
 * tuples without header and trailer, or text lines) with the meta prefix ``old`` replaced by
 * ``new`` in each row that begins with it (in a binary tuple: after its field count, which
 * stays), and how many did. A streamed transaction's rows, held back until its commit, get their
 * commit LSN and time this way. */
static PyObject *
lane_restamp(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer rows, old, new;
    int binary;
    PyObject *result = NULL, *out_rows;
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "restamp(rows, binary, old, new)");
    binary = PyObject_IsTrue(args[1]);
    if (binary < 0)
        return NULL;
    if (PyObject_GetBuffer(args[0], &rows, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &old, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &new, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&old);
        PyBuffer_Release(&rows);
        return NULL;
    }
    const unsigned char *start = rows.buf, *end = start + rows.len, *p;
    Py_ssize_t skip = binary ? 2 : 0, matched = 0;
    for (p = start; p < end;) {  /* first pass: check the rows, count those to restamp */
        const unsigned char *next = row_end(p, end, binary);
        if (next == NULL) {
            PyErr_SetString(PyExc_ValueError, "restamp: change rows cut short");
            goto done;
        }
        if (next - p >= skip + old.len && memcmp(p + skip, old.buf, (size_t)old.len) == 0)
            matched++;
        p = next;
    }
    out_rows = PyBytes_FromStringAndSize(NULL, rows.len + matched * (new.len - old.len));
    if (out_rows == NULL)
        goto done;
    char *out = PyBytes_AS_STRING(out_rows);
    for (p = start; p < end;) {
        const unsigned char *next = row_end(p, end, binary);
        if (next - p >= skip + old.len && memcmp(p + skip, old.buf, (size_t)old.len) == 0) {
            memcpy(out, p, (size_t)skip);
            out += skip;
            memcpy(out, new.buf, (size_t)new.len);
            out += new.len;
            p += skip + old.len;
        }
        memcpy(out, p, (size_t)(next - p));
        out += next - p;
        p = next;
    }
    result = Py_BuildValue("Nn", out_rows, matched);
done:
    PyBuffer_Release(&new);
    PyBuffer_Release(&old);
    PyBuffer_Release(&rows);
    return result;
}

static PyMethodDef module_methods[] = {
    {"restamp", (PyCFunction)(void (*)(void))lane_restamp, METH_FASTCALL,
     "restamp(rows, binary, old, new)\n--\n\n(rows, restamped): change rows with the meta prefix "
     "old replaced by new in each row that begins with it (binary tuples: after the field count), "
     "and how many did."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "applier.apply._lane.Lane",
    .tp_basicsize = sizeof(LaneObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Lane(runs)\n--\n\nThe lane over the open runs (relation id -> Run or KeyRun).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_members = lane_members,
    .tp_methods = lane_methods,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "applier.apply._lane",
    "C core of the lane: Begin/Insert/Update/Delete/Commit payloads into the batch's open runs.",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__lane(void)
{
    PyObject *module;
    if (PyType_Ready(&RunType) < 0 || PyType_Ready(&KeyRunType) < 0
        || PyType_Ready(&LaneType) < 0)
        return NULL;
    module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Run", (PyObject *)&RunType) < 0
        || PyModule_AddObjectRef(module, "KeyRun", (PyObject *)&KeyRunType) < 0
        || PyModule_AddObjectRef(module, "Lane", (PyObject *)&LaneType) < 0
        /* Why take() returned: read by lane.py from here, never restated there. */
        || PyModule_AddIntConstant(module, "END", LANE_END) < 0
        || PyModule_AddIntConstant(module, "FOREIGN", LANE_FOREIGN) < 0
        || PyModule_AddIntConstant(module, "NO_RUN", LANE_NO_RUN) < 0
        || PyModule_AddIntConstant(module, "PART", LANE_PART) < 0
        || PyModule_AddIntConstant(module, "LIMIT", LANE_LIMIT) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
