/*
 * C accelerator for the pgoutput hot path: Begin, Commit, Insert, Update and Delete messages
 * (a stream of small transactions is mostly Begin and Commit), the dispatch between them and
 * the pure-Python decoder (decode), and the text COPY rows the apply stage builds from their
 * values (copy_text) and reads back (copy_fields; applier/apply/copy.py holds the pure-Python
 * references).
 *
 * Owns nothing but speed. It builds exactly the objects the pure-Python decoder builds
 * (applier/protocol/decoder.py is the reference): the same frozen dataclasses, the same field
 * values. It never reports errors of its own: whenever a message is malformed (or the input is
 * not plain bytes) it hands the message to the pure-Python function for that type, which raises
 * the precise DecodeError. Error paths therefore need not be fast, only the valid path.
 *
 * The classes, the UNCHANGED_TOAST sentinel and the fallbacks arrive through init(), so this
 * file imports nothing from the package. Objects are built without running the dataclass
 * __init__ (whose frozen __setattr__ dominates the pure path): allocate with tp_alloc, then
 * store straight into the __slots__ member offsets, which init() reads from the classes' own
 * member descriptors and checks.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <datetime.h>
#include <stdint.h>

#include "_wire.h"

/* A class whose slots we fill directly; offsets[i] is where field i lives in the instance. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offsets[5];
} SlotClass;

static SlotClass TupleDataCls, InsertCls, UpdateCls, DeleteCls, BeginCls, CommitCls;
static PyObject *Unchanged;                    /* messages.UNCHANGED_TOAST */
static PyObject *LsnType;                      /* lsn.LSN, an int subclass */
static PyObject *Epoch;                        /* lsn.PG_EPOCH: wire timestamps count from it */
static PyObject *FallbackInsert, *FallbackUpdate, *FallbackDelete, *FallbackBegin,
    *FallbackCommit, *FallbackDecode;
static PyObject *KindK, *KindO;                /* 'K' and 'O', as chr() gives them */

/* Outcome of a parse step: done, malformed (let Python raise), or a Python error is set. */
enum { OK = 0, MALFORMED = 1, FAILED = -1 };

/* An LSN object for a wire position. */
static PyObject *
make_lsn(const unsigned char *p)
{
    PyObject *value = PyLong_FromUnsignedLongLong(be64(p)), *lsn;
    if (value == NULL)
        return NULL;
    lsn = PyObject_CallOneArg(LsnType, value);
    Py_DECREF(value);
    return lsn;
}

/* An aware datetime for a wire TimestampTz (microseconds since PG_EPOCH), as lsn.pg_timestamp
 * makes it; NULL with OverflowError set when out of datetime's range. */
static PyObject *
make_timestamp(const unsigned char *p)
{
    const int64_t per_day = 86400LL * 1000000LL;
    int64_t micros = (int64_t)be64(p), days = micros / per_day, rest = micros % per_day;
    PyObject *delta, *moment;
    if (rest < 0) {
        rest += per_day;
        days--;
    }
    delta = PyDelta_FromDSU((int)days, (int)(rest / 1000000), (int)(rest % 1000000));
    if (delta == NULL)
        return NULL;
    moment = PyNumber_Add(Epoch, delta);
    Py_DECREF(delta);
    return moment;
}

/* Allocate an instance of cls and move the references in values into its slots. */
static PyObject *
build(const SlotClass *cls, PyObject **values, int count)
{
    PyObject *obj = cls->type->tp_alloc(cls->type, 0);
    int i;
    if (obj == NULL) {
        for (i = 0; i < count; i++)
            Py_DECREF(values[i]);
        return NULL;
    }
    for (i = 0; i < count; i++)
        *(PyObject **)((char *)obj + cls->offsets[i]) = values[i];
    return obj;
}

/* Parse a TupleData at *pos; on OK store a new TupleData in *out and advance *pos. */
static int
read_tuple(const unsigned char *buf, Py_ssize_t end, Py_ssize_t *pos, PyObject **out)
{
    Py_ssize_t p = *pos, ncols, i, size = 0;
    PyObject *kinds, *values, *fields[3];
    char *kind_out;

    if (p + 2 > end)
        return MALFORMED;
    ncols = ((Py_ssize_t)buf[p] << 8) | buf[p + 1];
    p += 2;
    values = PyTuple_New(ncols);
    if (values == NULL)
        return FAILED;
    kinds = PyBytes_FromStringAndSize(NULL, ncols);
    if (kinds == NULL) {
        Py_DECREF(values);
        return FAILED;
    }
    kind_out = PyBytes_AS_STRING(kinds);
    for (i = 0; i < ncols; i++) {
        unsigned char kind;
        PyObject *value;
        if (p >= end)
            goto malformed;
        kind = buf[p];
        if (kind == 't' || kind == 'b') {
            Py_ssize_t start, length;
            if (p + 5 > end)
                goto malformed;
            length = (int32_t)be32(buf + p + 1);
            start = p + 5;
            if (length < 0 || length > end - start)
                goto malformed;
            value = PyBytes_FromStringAndSize((const char *)buf + start, length);
            if (value == NULL)
                goto failed;
            p = start + length;
            size += length;
        }
        else if (kind == 'n') {
            value = Py_NewRef(Py_None);
            p++;
        }
        else if (kind == 'u') {
            value = Py_NewRef(Unchanged);
            p++;
        }
        else
            goto malformed;
        PyTuple_SET_ITEM(values, i, value);
        kind_out[i] = (char)kind;
    }
    fields[0] = kinds;
    fields[1] = values;
    fields[2] = PyLong_FromSsize_t(size);
    if (fields[2] == NULL) {
        Py_DECREF(kinds);
        Py_DECREF(values);
        return FAILED;
    }
    *out = build(&TupleDataCls, fields, 3);
    if (*out == NULL)
        return FAILED;
    *pos = p;
    return OK;

malformed:
    Py_DECREF(kinds);
    Py_DECREF(values);
    return MALFORMED;
failed:
    Py_DECREF(kinds);
    Py_DECREF(values);
    return FAILED;
}

/* The shared head: optional xid, relation id. Leaves *pos at the first tuple tag. */
static int
read_head(const unsigned char *buf, Py_ssize_t end, int in_stream, Py_ssize_t *pos,
          PyObject **xid, PyObject **relation_id)
{
    uint32_t rel;
    if (in_stream) {
        if (end < 10)
            return MALFORMED;
        *xid = PyLong_FromUnsignedLong(be32(buf + 1));
        if (*xid == NULL)
            return FAILED;
        rel = be32(buf + 5);
        *pos = 9;
    }
    else {
        if (end < 6)
            return MALFORMED;
        *xid = Py_NewRef(Py_None);
        rel = be32(buf + 1);
        *pos = 5;
    }
    *relation_id = PyLong_FromUnsignedLong(rel);
    if (*relation_id == NULL) {
        Py_DECREF(*xid);
        return FAILED;
    }
    return OK;
}

/* Shared argument handling: (buf: bytes, in_stream) or MALFORMED to defer to Python. */
static int
parse_args(PyObject *const *args, Py_ssize_t nargs, int *in_stream)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (buf, in_stream)");
        return FAILED;
    }
    if (DeleteCls.type == NULL) {  /* the classes are bound last by init() */
        PyErr_SetString(PyExc_RuntimeError, "_speedups.init() has not been called");
        return FAILED;
    }
    if (args[1] == Py_False)
        *in_stream = 0;
    else if (args[1] == Py_True)
        *in_stream = 1;
    else if ((*in_stream = PyObject_IsTrue(args[1])) < 0)
        return FAILED;
    return PyBytes_CheckExact(args[0]) ? OK : MALFORMED;
}

static PyObject *
fallback(PyObject *func, PyObject *const *args)
{
    return PyObject_Vectorcall(func, args, 2, NULL);
}

static PyObject *
decode_insert(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int in_stream, rc;
    const unsigned char *buf;
    Py_ssize_t end, pos;
    PyObject *fields[3];

    rc = parse_args(args, nargs, &in_stream);
    if (rc == MALFORMED)
        return fallback(FallbackInsert, args);
    if (rc == FAILED)
        return NULL;
    buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    end = PyBytes_GET_SIZE(args[0]);

    rc = read_head(buf, end, in_stream, &pos, &fields[0], &fields[1]);
    if (rc == MALFORMED)
        return fallback(FallbackInsert, args);
    if (rc == FAILED)
        return NULL;
    if (buf[pos] != 'N')
        rc = MALFORMED;
    else {
        pos++;
        rc = read_tuple(buf, end, &pos, &fields[2]);
        if (rc == OK && pos != end) {
            Py_DECREF(fields[2]);
            rc = MALFORMED;
        }
    }
    if (rc != OK) {
        Py_DECREF(fields[0]);
        Py_DECREF(fields[1]);
        return rc == MALFORMED ? fallback(FallbackInsert, args) : NULL;
    }
    return build(&InsertCls, fields, 3);
}

static PyObject *
decode_update(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int in_stream, rc;
    const unsigned char *buf;
    Py_ssize_t end, pos;
    /* xid, relation_id, old_kind, old_tuple, new_tuple */
    PyObject *fields[5] = {NULL, NULL, NULL, NULL, NULL};
    unsigned char tag;
    int i;

    rc = parse_args(args, nargs, &in_stream);
    if (rc == MALFORMED)
        return fallback(FallbackUpdate, args);
    if (rc == FAILED)
        return NULL;
    buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    end = PyBytes_GET_SIZE(args[0]);

    rc = read_head(buf, end, in_stream, &pos, &fields[0], &fields[1]);
    if (rc != OK)
        return rc == MALFORMED ? fallback(FallbackUpdate, args) : NULL;
    tag = buf[pos];
    if (tag == 'K' || tag == 'O') {
        fields[2] = Py_NewRef(tag == 'K' ? KindK : KindO);
        pos++;
        rc = read_tuple(buf, end, &pos, &fields[3]);
        if (rc != OK)
            goto fail;
        if (pos >= end) {
            rc = MALFORMED;
            goto fail;
        }
        tag = buf[pos];
    }
    else {
        fields[2] = Py_NewRef(Py_None);
        fields[3] = Py_NewRef(Py_None);
    }
    if (tag != 'N') {
        rc = MALFORMED;
        goto fail;
    }
    pos++;
    rc = read_tuple(buf, end, &pos, &fields[4]);
    if (rc != OK)
        goto fail;
    if (pos != end) {
        rc = MALFORMED;
        goto fail;
    }
    return build(&UpdateCls, fields, 5);

fail:
    for (i = 0; i < 5; i++)
        Py_XDECREF(fields[i]);
    return rc == MALFORMED ? fallback(FallbackUpdate, args) : NULL;
}

static PyObject *
decode_delete(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int in_stream, rc;
    const unsigned char *buf;
    Py_ssize_t end, pos;
    PyObject *fields[4];
    unsigned char tag;

    rc = parse_args(args, nargs, &in_stream);
    if (rc == MALFORMED)
        return fallback(FallbackDelete, args);
    if (rc == FAILED)
        return NULL;
    buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    end = PyBytes_GET_SIZE(args[0]);

    rc = read_head(buf, end, in_stream, &pos, &fields[0], &fields[1]);
    if (rc != OK)
        return rc == MALFORMED ? fallback(FallbackDelete, args) : NULL;
    tag = buf[pos];
    if (tag != 'K' && tag != 'O')
        rc = MALFORMED;
    else {
        pos++;
        rc = read_tuple(buf, end, &pos, &fields[3]);
        if (rc == OK && pos != end) {
            Py_DECREF(fields[3]);
            rc = MALFORMED;
        }
    }
    if (rc != OK) {
        Py_DECREF(fields[0]);
        Py_DECREF(fields[1]);
        return rc == MALFORMED ? fallback(FallbackDelete, args) : NULL;
    }
    fields[2] = Py_NewRef(tag == 'K' ? KindK : KindO);
    return build(&DeleteCls, fields, 4);
}

/* Fill fields[0..count) with make(...) results; on failure release what was made. Returns OK,
 * MALFORMED (a value out of range: Python raises the precise error) or FAILED. */
static int
made(PyObject **fields, int count)
{
    int i, failed = 0;
    for (i = 0; i < count; i++)
        failed |= fields[i] == NULL;
    if (!failed)
        return OK;
    for (i = 0; i < count; i++)
        Py_XDECREF(fields[i]);
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        return MALFORMED;
    }
    return FAILED;
}

static PyObject *
decode_begin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int in_stream, rc;
    const unsigned char *buf;
    PyObject *fields[3];  /* final_lsn, commit_time, xid */

    rc = parse_args(args, nargs, &in_stream);
    if (rc == FAILED)
        return NULL;
    if (rc == MALFORMED || PyBytes_GET_SIZE(args[0]) != 21)
        return fallback(FallbackBegin, args);
    buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    fields[0] = make_lsn(buf + 1);
    fields[1] = fields[0] ? make_timestamp(buf + 9) : NULL;
    fields[2] = fields[1] ? PyLong_FromUnsignedLong(be32(buf + 17)) : NULL;
    rc = made(fields, 3);
    if (rc != OK)
        return rc == MALFORMED ? fallback(FallbackBegin, args) : NULL;
    return build(&BeginCls, fields, 3);
}

static PyObject *
decode_commit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int in_stream, rc;
    const unsigned char *buf;
    PyObject *fields[4];  /* flags, commit_lsn, end_lsn, commit_time */

    rc = parse_args(args, nargs, &in_stream);
    if (rc == FAILED)
        return NULL;
    if (rc == MALFORMED || PyBytes_GET_SIZE(args[0]) != 26)
        return fallback(FallbackCommit, args);
    buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    fields[0] = PyLong_FromLong(buf[1]);
    fields[1] = fields[0] ? make_lsn(buf + 2) : NULL;
    fields[2] = fields[1] ? make_lsn(buf + 10) : NULL;
    fields[3] = fields[2] ? make_timestamp(buf + 18) : NULL;
    rc = made(fields, 4);
    if (rc != OK)
        return rc == MALFORMED ? fallback(FallbackCommit, args) : NULL;
    return build(&CommitCls, fields, 4);
}

/* decode(data, in_stream=False): the hot types in C, everything else (other types, other
 * argument forms, input other than bytes) through the pure-Python decode_pure. */
static PyObject *
decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *argv[2];
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);

    if (FallbackDecode == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_speedups.init() has not been called");
        return NULL;
    }
    if (nargs == 2 && nkw == 0) {
        argv[0] = args[0];
        argv[1] = args[1];
    }
    else if (nargs == 1 && nkw == 0) {
        argv[0] = args[0];
        argv[1] = Py_False;
    }
    else if (nargs == 1 && nkw == 1 &&
             PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "in_stream") == 0) {
        argv[0] = args[0];
        argv[1] = args[1];
    }
    else
        return PyObject_Vectorcall(FallbackDecode, args, nargs, kwnames);
    if (PyBytes_CheckExact(argv[0]) && PyBytes_GET_SIZE(argv[0]) > 0) {
        switch (PyBytes_AS_STRING(argv[0])[0]) {
        case 'B': return decode_begin(module, argv, 2);
        case 'C': return decode_commit(module, argv, 2);
        case 'I': return decode_insert(module, argv, 2);
        case 'U': return decode_update(module, argv, 2);
        case 'D': return decode_delete(module, argv, 2);
        }
    }
    return PyObject_Vectorcall(FallbackDecode, argv, 2, NULL);
}

/* Resolve cls's slot offsets for names, refusing anything but a plain object slot. */
static int
bind_class(SlotClass *cls, PyObject *type, const char *const *names, int count)
{
    int i;
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "init() expects classes");
        return -1;
    }
    for (i = 0; i < count; i++) {
        PyObject *descr = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, names[i]);
        PyMemberDef *member;
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member",
                         ((PyTypeObject *)type)->tp_name, names[i]);
            return -1;
        }
        member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot",
                         ((PyTypeObject *)type)->tp_name, names[i]);
            return -1;
        }
        cls->offsets[i] = member->offset;
    }
    Py_XSETREF(cls->type, (PyTypeObject *)Py_NewRef(type));
    return 0;
}

static PyObject *
init(PyObject *module, PyObject *args)
{
    static const char *const tuple_fields[] = {"kinds", "values", "size"};
    static const char *const insert_fields[] = {"xid", "relation_id", "new_tuple"};
    static const char *const update_fields[] = {"xid", "relation_id", "old_kind", "old_tuple",
                                                "new_tuple"};
    static const char *const delete_fields[] = {"xid", "relation_id", "old_kind", "old_tuple"};
    static const char *const begin_fields[] = {"final_lsn", "commit_time", "xid"};
    static const char *const commit_fields[] = {"flags", "commit_lsn", "end_lsn", "commit_time"};
    PyObject *tuple_data, *insert, *update, *delete, *begin, *commit, *lsn, *epoch, *unchanged,
        *fb_insert, *fb_update, *fb_delete, *fb_begin, *fb_commit, *fb_decode;

    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOO:init", &tuple_data, &insert, &update, &delete,
                          &begin, &commit, &lsn, &epoch, &unchanged, &fb_insert, &fb_update,
                          &fb_delete, &fb_begin, &fb_commit, &fb_decode))
        return NULL;
    if (!PyCallable_Check(fb_insert) || !PyCallable_Check(fb_update) ||
        !PyCallable_Check(fb_delete) || !PyCallable_Check(fb_begin) ||
        !PyCallable_Check(fb_commit) || !PyCallable_Check(fb_decode) || !PyCallable_Check(lsn)) {
        PyErr_SetString(PyExc_TypeError, "init() expects callable fallbacks and LSN type");
        return NULL;
    }
    if (!PyDateTime_Check(epoch)) {
        PyErr_SetString(PyExc_TypeError, "init() expects the epoch as a datetime");
        return NULL;
    }
    if (bind_class(&TupleDataCls, tuple_data, tuple_fields, 3) < 0 ||
        bind_class(&InsertCls, insert, insert_fields, 3) < 0 ||
        bind_class(&UpdateCls, update, update_fields, 5) < 0 ||
        bind_class(&BeginCls, begin, begin_fields, 3) < 0 ||
        bind_class(&CommitCls, commit, commit_fields, 4) < 0 ||
        bind_class(&DeleteCls, delete, delete_fields, 4) < 0)
        return NULL;
    Py_XSETREF(Unchanged, Py_NewRef(unchanged));
    Py_XSETREF(LsnType, Py_NewRef(lsn));
    Py_XSETREF(Epoch, Py_NewRef(epoch));
    Py_XSETREF(FallbackInsert, Py_NewRef(fb_insert));
    Py_XSETREF(FallbackUpdate, Py_NewRef(fb_update));
    Py_XSETREF(FallbackDelete, Py_NewRef(fb_delete));
    Py_XSETREF(FallbackBegin, Py_NewRef(fb_begin));
    Py_XSETREF(FallbackCommit, Py_NewRef(fb_commit));
    Py_XSETREF(FallbackDecode, Py_NewRef(fb_decode));
    Py_RETURN_NONE;
}

/* One value (bytes or None) in COPY text format: \N for NULL. */
static inline Py_ssize_t
copy_field_size(PyObject *value)
{
    if (value == Py_None)
        return 2;
    return escaped_size(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
}

static inline char *
copy_field(char *out, PyObject *value)
{
    if (value == Py_None) {
        *out++ = '\\';
        *out++ = 'N';
        return out;
    }
    return escape_into(out, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
}

/* copy_text(rows): rows is a list of tuples of bytes or None, all of one width. Two passes:
 * size the result exactly, then fill it, so a large run costs one allocation. */
static PyObject *
copy_text(PyObject *module, PyObject *rows)
{
    Py_ssize_t nrows, r, c, width, size = 0;
    PyObject *result, *row;
    char *out;

    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "copy_text() expects a list of tuples");
        return NULL;
    }
    nrows = PyList_GET_SIZE(rows);
    for (r = 0; r < nrows; r++) {
        row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row)) {
            PyErr_SetString(PyExc_TypeError, "copy_text() expects a list of tuples");
            return NULL;
        }
        width = PyTuple_GET_SIZE(row);
        for (c = 0; c < width; c++) {
            PyObject *value = PyTuple_GET_ITEM(row, c);
            if (value != Py_None && !PyBytes_CheckExact(value)) {
                PyErr_Format(PyExc_TypeError, "copy_text(): row %zd column %zd is %.100s, not "
                             "bytes or None", r + 1, c + 1, Py_TYPE(value)->tp_name);
                return NULL;
            }
            size += copy_field_size(value) + 1;  /* the tab after it, or the newline */
        }
        if (width == 0)
            size += 1;
    }
    result = PyBytes_FromStringAndSize(NULL, size);
    if (result == NULL)
        return NULL;
    out = PyBytes_AS_STRING(result);
    for (r = 0; r < nrows; r++) {
        row = PyList_GET_ITEM(rows, r);
        width = PyTuple_GET_SIZE(row);
        for (c = 0; c < width; c++) {
            out = copy_field(out, PyTuple_GET_ITEM(row, c));
            *out++ = c + 1 < width ? '\t' : '\n';
        }
        if (width == 0)
            *out++ = '\n';
    }
    return result;
}

/* One field of a COPY row: where its bytes are, and whether it is NULL or holds escapes. */
typedef struct {
    const char *start;
    Py_ssize_t length;
    int null;
    int escaped;
} Field;

/* A text field's value: copy_text's escapes (backslash, tab, newline, carriage return) undone. */
static PyObject *
unescaped(const Field *field)
{
    PyObject *value = PyBytes_FromStringAndSize(NULL, field->length);
    const char *in = field->start, *end = field->start + field->length;
    char *out;
    if (value == NULL)
        return NULL;
    out = PyBytes_AS_STRING(value);
    while (in < end) {
        if (*in != '\\') {
            *out++ = *in++;
            continue;
        }
        if (in + 1 == end)
            goto bad;
        switch (in[1]) {
        case '\\': *out++ = '\\'; break;
        case 't': *out++ = '\t'; break;
        case 'n': *out++ = '\n'; break;
        case 'r': *out++ = '\r'; break;
        default: goto bad;
        }
        in += 2;
    }
    if (_PyBytes_Resize(&value, out - PyBytes_AS_STRING(value)) < 0)
        return NULL;
    return value;
bad:
    Py_DECREF(value);
    PyErr_SetString(PyExc_ValueError, "copy_fields(): an escape copy_text never writes");
    return NULL;
}

/* Room in *fields for field n (grown as needed). */
static int
field_room(Field **fields, Py_ssize_t *room, Py_ssize_t n)
{
    Field *more;
    if (n < *room)
        return 0;
    more = PyMem_Resize(*fields, Field, *room * 2);
    if (more == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *fields = more;
    *room *= 2;
    return 0;
}

/* The fields of the row at data[*at..end) into *fields; *at moves past the row. */
static Py_ssize_t
row_fields(const char *data, Py_ssize_t *at, Py_ssize_t end, int binary, Field **fields,
           Py_ssize_t *room)
{
    const unsigned char *bytes = (const unsigned char *)data;
    Py_ssize_t n = 0, count, p = *at;
    if (binary) {  /* a field count, then each field's length (-1: NULL) and bytes */
        if (end - p < 2)
            goto truncated;
        count = be16(bytes + p);
        p += 2;
        for (n = 0; n < count; n++) {
            Field field = {data + p + 4, 0, 0, 0};
            int32_t length;
            if (end - p < 4)
                goto truncated;
            length = (int32_t)be32(bytes + p);
            p += 4;
            if (length < 0) {
                field.null = 1;
            } else {
                if (end - p < length)
                    goto truncated;
                field.length = length;
                p += length;
            }
            if (field_room(fields, room, n) < 0)
                return -1;
            (*fields)[n] = field;
        }
        *at = p;
        return n;
    }
    for (;;) {  /* text: fields end at a tab, the row at a newline (escaped within values) */
        Field field = {data + p, 0, 0, 0};
        Py_ssize_t q = p;
        while (q < end && data[q] != '\t' && data[q] != '\n') {
            if (data[q] == '\\')
                field.escaped = 1;
            q++;
        }
        if (q == end)
            goto truncated;
        field.length = q - p;
        field.null = field.length == 2 && data[p] == '\\' && data[p + 1] == 'N';
        if (field_room(fields, room, n) < 0)
            return -1;
        (*fields)[n++] = field;
        p = q + 1;
        if (data[q] == '\n')
            break;
    }
    *at = p;
    return n;
truncated:
    PyErr_SetString(PyExc_ValueError, "copy_fields(): COPY data ends inside a row");
    return -1;
}

/* copy_fields(data, binary, order): the values of COPY data (text lines as copy_text writes
 * them, or binary tuples without the header and trailer), flattened in one list: for each row,
 * its fields at the positions in order (a tuple of ints), bytes or None. */
static PyObject *
copy_fields(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    PyObject *order, *out = NULL;
    Py_ssize_t norder, i, at = 0, room = 16, *positions = NULL;
    Field *fields = NULL;
    int binary;

    if (nargs != 3 || !PyTuple_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "copy_fields(data, binary, order: tuple)");
    binary = PyObject_IsTrue(args[1]);
    if (binary < 0 || PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    order = args[2];
    norder = PyTuple_GET_SIZE(order);
    positions = PyMem_New(Py_ssize_t, norder ? norder : 1);
    fields = PyMem_New(Field, room);
    out = PyList_New(0);
    if (positions == NULL || fields == NULL || out == NULL) {
        if (out != NULL)
            PyErr_NoMemory();
        goto fail;
    }
    for (i = 0; i < norder; i++) {
        positions[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(order, i));
        if (positions[i] == -1 && PyErr_Occurred())
            goto fail;
    }
    while (at < view.len) {
        Py_ssize_t n = row_fields(view.buf, &at, view.len, binary, &fields, &room);
        if (n < 0)
            goto fail;
        for (i = 0; i < norder; i++) {
            Field *field;
            PyObject *value;
            int appended;
            if (positions[i] < 0 || positions[i] >= n) {
                PyErr_Format(PyExc_ValueError, "copy_fields(): no field %zd in a row of %zd",
                             positions[i], n);
                goto fail;
            }
            field = &fields[positions[i]];
            if (field->null)
                value = Py_NewRef(Py_None);
            else if (field->escaped)
                value = unescaped(field);
            else
                value = PyBytes_FromStringAndSize(field->start, field->length);
            if (value == NULL)
                goto fail;
            appended = PyList_Append(out, value);
            Py_DECREF(value);
            if (appended < 0)
                goto fail;
        }
    }
    PyMem_Free(positions);
    PyMem_Free(fields);
    PyBuffer_Release(&view);
    return out;
fail:
    Py_XDECREF(out);
    PyMem_Free(positions);
    PyMem_Free(fields);
    PyBuffer_Release(&view);
    return NULL;
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS,
     "init(TupleData, Insert, Update, Delete, Begin, Commit, LSN, PG_EPOCH, UNCHANGED_TOAST, "
     "insert_fallback, update_fallback, delete_fallback, begin_fallback, commit_fallback, "
     "decode_fallback)"
     "\n--\n\nBind the message classes and the pure-Python decoders used for malformed input. "
     "Call once before decoding."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL | METH_KEYWORDS,
     "decode(data, in_stream=False)\n--\n\nDecode one pgoutput message: Begin, Commit, Insert, "
     "Update and Delete here, anything else by decode_fallback (see decoder.decode_pure)."},
    {"decode_begin", (PyCFunction)(void (*)(void))decode_begin, METH_FASTCALL,
     "decode_begin(buf, in_stream)\n--\n\nDecode a Begin message (type byte 'B')."},
    {"decode_commit", (PyCFunction)(void (*)(void))decode_commit, METH_FASTCALL,
     "decode_commit(buf, in_stream)\n--\n\nDecode a Commit message (type byte 'C')."},
    {"decode_insert", (PyCFunction)(void (*)(void))decode_insert, METH_FASTCALL,
     "decode_insert(buf, in_stream)\n--\n\nDecode an Insert message (type byte 'I')."},
    {"decode_update", (PyCFunction)(void (*)(void))decode_update, METH_FASTCALL,
     "decode_update(buf, in_stream)\n--\n\nDecode an Update message (type byte 'U')."},
    {"decode_delete", (PyCFunction)(void (*)(void))decode_delete, METH_FASTCALL,
     "decode_delete(buf, in_stream)\n--\n\nDecode a Delete message (type byte 'D')."},
    {"copy_text", copy_text, METH_O,
     "copy_text(rows)\n--\n\nRows (a list of tuples of bytes or None) as COPY text format."},
    {"copy_fields", (PyCFunction)(void (*)(void))copy_fields, METH_FASTCALL,
     "copy_fields(data, binary, order)\n--\n\nThe values of COPY text lines (as copy_text "
     "writes them) or binary tuples, in one list: each row's fields at the positions in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "applier.protocol._speedups",
    "C accelerator for pgoutput Begin/Commit/Insert/Update/Delete decoding; see decoder.py.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL)
        return NULL;
    KindK = PyUnicode_FromOrdinal('K');
    KindO = PyUnicode_FromOrdinal('O');
    if (KindK == NULL || KindO == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
