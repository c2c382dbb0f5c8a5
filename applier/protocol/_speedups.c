/*
 * C accelerator for the pgoutput hot path: Insert, Update and Delete messages, and the text
 * COPY rows the apply stage builds from their values (copy_text; applier/apply/copy.py holds
 * the pure-Python reference).
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
#include <stdint.h>

/* A class whose slots we fill directly; offsets[i] is where field i lives in the instance. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offsets[5];
} SlotClass;

static SlotClass TupleDataCls, InsertCls, UpdateCls, DeleteCls;
static PyObject *Unchanged;                    /* messages.UNCHANGED_TOAST */
static PyObject *FallbackInsert, *FallbackUpdate, *FallbackDelete;
static PyObject *KindK, *KindO;                /* 'K' and 'O', as chr() gives them */

/* Outcome of a parse step: done, malformed (let Python raise), or a Python error is set. */
enum { OK = 0, MALFORMED = 1, FAILED = -1 };

static inline uint32_t
be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
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
    Py_ssize_t p = *pos, ncols, i;
    PyObject *kinds, *values, *fields[2];
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
    *out = build(&TupleDataCls, fields, 2);
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
    static const char *const tuple_fields[] = {"kinds", "values"};
    static const char *const insert_fields[] = {"xid", "relation_id", "new_tuple"};
    static const char *const update_fields[] = {"xid", "relation_id", "old_kind", "old_tuple",
                                                "new_tuple"};
    static const char *const delete_fields[] = {"xid", "relation_id", "old_kind", "old_tuple"};
    PyObject *tuple_data, *insert, *update, *delete, *unchanged, *fb_insert, *fb_update,
        *fb_delete;

    if (!PyArg_ParseTuple(args, "OOOOOOOO:init", &tuple_data, &insert, &update, &delete,
                          &unchanged, &fb_insert, &fb_update, &fb_delete))
        return NULL;
    if (!PyCallable_Check(fb_insert) || !PyCallable_Check(fb_update) ||
        !PyCallable_Check(fb_delete)) {
        PyErr_SetString(PyExc_TypeError, "init() expects callable fallbacks");
        return NULL;
    }
    if (bind_class(&TupleDataCls, tuple_data, tuple_fields, 2) < 0 ||
        bind_class(&InsertCls, insert, insert_fields, 3) < 0 ||
        bind_class(&UpdateCls, update, update_fields, 5) < 0 ||
        bind_class(&DeleteCls, delete, delete_fields, 4) < 0)
        return NULL;
    Py_XSETREF(Unchanged, Py_NewRef(unchanged));
    Py_XSETREF(FallbackInsert, Py_NewRef(fb_insert));
    Py_XSETREF(FallbackUpdate, Py_NewRef(fb_update));
    Py_XSETREF(FallbackDelete, Py_NewRef(fb_delete));
    Py_RETURN_NONE;
}

/* Bytes of one value in COPY text format: \N for NULL, else the value with backslash, tab,
 * newline and carriage return escaped. */
static inline Py_ssize_t
copy_field_size(PyObject *value)
{
    const char *p;
    Py_ssize_t n, i, size;
    if (value == Py_None)
        return 2;
    p = PyBytes_AS_STRING(value);
    n = PyBytes_GET_SIZE(value);
    size = n;
    for (i = 0; i < n; i++)
        if (p[i] == '\\' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r')
            size++;
    return size;
}

static inline char *
copy_field(char *out, PyObject *value)
{
    const char *p;
    Py_ssize_t n, i;
    if (value == Py_None) {
        *out++ = '\\';
        *out++ = 'N';
        return out;
    }
    p = PyBytes_AS_STRING(value);
    n = PyBytes_GET_SIZE(value);
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

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS,
     "init(TupleData, Insert, Update, Delete, UNCHANGED_TOAST, insert_fallback, "
     "update_fallback, delete_fallback)\n--\n\nBind the message classes and the pure-Python "
     "decoders used for malformed input. Call once before decoding."},
    {"decode_insert", (PyCFunction)(void (*)(void))decode_insert, METH_FASTCALL,
     "decode_insert(buf, in_stream)\n--\n\nDecode an Insert message (type byte 'I')."},
    {"decode_update", (PyCFunction)(void (*)(void))decode_update, METH_FASTCALL,
     "decode_update(buf, in_stream)\n--\n\nDecode an Update message (type byte 'U')."},
    {"decode_delete", (PyCFunction)(void (*)(void))decode_delete, METH_FASTCALL,
     "decode_delete(buf, in_stream)\n--\n\nDecode a Delete message (type byte 'D')."},
    {"copy_text", copy_text, METH_O,
     "copy_text(rows)\n--\n\nRows (a list of tuples of bytes or None) as COPY text format."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "applier.protocol._speedups",
    "C accelerator for pgoutput Insert/Update/Delete decoding; see decoder.py.", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    KindK = PyUnicode_FromOrdinal('K');
    KindO = PyUnicode_FromOrdinal('O');
    if (KindK == NULL || KindO == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
