/*
 * C frame reader for the replication stream (applier/source/stream.py drives it): takes the
 * CopyData frames libpq already holds for a START_REPLICATION connection and appends the payload
 * of each XLogData frame to a list, with no Python code and one bytes object per frame. A large
 * backlog is a million frames or more; in Python each costs a call, a memoryview, a slice and a
 * copy.
 *
 * Owns only that loop. It stops at anything it does not take (a keepalive or any other frame,
 * handed back whole), when libpq holds no complete frame, at the end of the stream or an error:
 * keepalives, feedback, waiting for the socket and errors stay in Python. It links against no
 * libpq: the connection is psycopg's own (a PGconn pointer) and bind() receives the addresses of
 * the functions of the very libpq psycopg loaded (applier/libpq.py finds and checks them).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*getcopydata_f)(void *conn, char **buffer, int async);
typedef void (*freemem_f)(void *ptr);

static getcopydata_f PQgetCopyData;
static freemem_f PQfreemem;

/* What take() reports; mirrored by stream.py. 0, -1 and -2 are PQgetCopyData's own: no complete
 * frame held, the stream ended, an error. */
enum { LIMIT = 1, OTHER = 2 };

/* XLogData: 'w', WAL start, WAL end, send time (8 bytes each), then the payload. */
#define XLOGDATA_HEADER 25

static PyObject *
bind(PyObject *self, PyObject *args)
{
    unsigned long long getcopydata, freemem;
    if (!PyArg_ParseTuple(args, "KK", &getcopydata, &freemem))
        return NULL;
    if (getcopydata == 0 || freemem == 0) {
        PyErr_SetString(PyExc_ValueError, "a libpq function address is 0");
        return NULL;
    }
    PQgetCopyData = (getcopydata_f)(uintptr_t)getcopydata;
    PQfreemem = (freemem_f)(uintptr_t)freemem;
    Py_RETURN_NONE;
}

static uint64_t
be64(const unsigned char *p)
{
    uint64_t v = 0;
    int i;
    for (i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

/* take(pgconn_ptr, payloads, limit) -> (outcome, bytes received, WAL start of the last XLogData
 * taken or -1, the other frame or None) */
static PyObject *
take(PyObject *self, PyObject *args)
{
    unsigned long long ptr;
    PyObject *payloads, *other = Py_None;
    Py_ssize_t limit;
    long long received = 0, last_start = -1;
    int outcome;
    void *conn;

    if (!PyArg_ParseTuple(args, "KO!n", &ptr, &PyList_Type, &payloads, &limit))
        return NULL;
    if (PQgetCopyData == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_frames.bind() has not been called");
        return NULL;
    }
    if (ptr == 0) {
        PyErr_SetString(PyExc_ValueError, "null PGconn");
        return NULL;
    }
    conn = (void *)(uintptr_t)ptr;
    for (;;) {
        char *buffer = NULL;
        int n;
        if (PyList_GET_SIZE(payloads) >= limit) {
            outcome = LIMIT;
            break;
        }
        n = PQgetCopyData(conn, &buffer, 1);
        if (n <= 0) {
            if (buffer != NULL)
                PQfreemem(buffer);
            outcome = n;
            break;
        }
        received += n;
        if (buffer[0] == 'w' && n >= XLOGDATA_HEADER) {
            PyObject *payload = PyBytes_FromStringAndSize(buffer + XLOGDATA_HEADER, n - XLOGDATA_HEADER);
            last_start = (long long)be64((const unsigned char *)buffer + 1);
            PQfreemem(buffer);
            if (payload == NULL)
                return NULL;
            if (PyList_Append(payloads, payload) < 0) {
                Py_DECREF(payload);
                return NULL;
            }
            Py_DECREF(payload);
            continue;
        }
        other = PyBytes_FromStringAndSize(buffer, n);
        PQfreemem(buffer);
        if (other == NULL)
            return NULL;
        outcome = OTHER;
        return Py_BuildValue("iLLN", outcome, received, last_start, other);
    }
    return Py_BuildValue("iLLO", outcome, received, last_start, other);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(PQgetCopyData, PQfreemem)\n--\n\nThe addresses of psycopg's libpq functions."},
    {"take", take, METH_VARARGS,
     "take(pgconn_ptr, payloads, limit)\n--\n\nAppend the payloads of the XLogData frames libpq "
     "holds to payloads (up to limit in all); (outcome, bytes received, WAL start of the last "
     "taken or -1, the frame it stopped at or None)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "applier.source._frames",
    "C frame reader: XLogData payloads from psycopg's libpq straight into a list.", -1, methods,
};

PyMODINIT_FUNC
PyInit__frames(void)
{
    return PyModule_Create(&module_def);
}
