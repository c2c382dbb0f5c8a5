/*
 * C relay for the initial copy: moves COPY data from a source connection in COPY OUT to a target
 * connection in COPY IN without the GIL, so parallel copy sessions (threads) really run in
 * parallel and no Python code runs per row.
 *
 * Owns only the data loop and waiting for a final result. It links against no libpq: the
 * connections are psycopg's own (PGconn pointers), and bind() receives the addresses of the
 * functions of the very libpq psycopg loaded (relay.py finds and checks them). Starting and
 * finishing the COPY statements, errors and exceptions stay in Python (relay.py).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*getcopydata_f)(void *conn, char **buffer, int async);
typedef int (*putcopydata_f)(void *conn, const char *buffer, int nbytes);
typedef void (*freemem_f)(void *ptr);
typedef int (*conn_f)(void *conn);
typedef int (*setnonblocking_f)(void *conn, int arg);

static getcopydata_f PQgetCopyData;
static putcopydata_f PQputCopyData;
static freemem_f PQfreemem;
static conn_f PQsocket, PQconsumeInput, PQisBusy, PQisnonblocking, PQflush;
static setnonblocking_f PQsetnonblocking;

/* Rows are gathered into blocks of this size: one CopyData message (and far fewer libpq calls
 * and server-side messages) per block instead of one per row. */
#define BLOCK_SIZE (256 * 1024)

/* What relay() reports; mirrored by relay.py. */
enum { MORE = 0, SOURCE_END = 1, SOURCE_LOST = 2, TARGET_FAILED = 3 };

static PyObject *
bind(PyObject *self, PyObject *args)
{
    unsigned long long f[9];
    int i;
    if (!PyArg_ParseTuple(args, "KKKKKKKKK", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7],
                          &f[8]))
        return NULL;
    for (i = 0; i < 9; i++) {
        if (f[i] == 0) {
            PyErr_SetString(PyExc_ValueError, "a libpq function address is 0");
            return NULL;
        }
    }
    PQgetCopyData = (getcopydata_f)(uintptr_t)f[0];
    PQputCopyData = (putcopydata_f)(uintptr_t)f[1];
    PQfreemem = (freemem_f)(uintptr_t)f[2];
    PQsocket = (conn_f)(uintptr_t)f[3];
    PQconsumeInput = (conn_f)(uintptr_t)f[4];
    PQisBusy = (conn_f)(uintptr_t)f[5];
    PQisnonblocking = (conn_f)(uintptr_t)f[6];
    PQsetnonblocking = (setnonblocking_f)(uintptr_t)f[7];
    PQflush = (conn_f)(uintptr_t)f[8];
    Py_RETURN_NONE;
}

/* Send what libpq still holds for conn (psycopg may leave some in non-blocking mode), waiting
 * for the socket. Returns 0 on success, -1 when the connection failed. */
static int
flush_all(void *conn)
{
    int rc;
    while ((rc = PQflush(conn)) == 1) {
        struct pollfd pfd = {PQsocket(conn), POLLIN | POLLOUT, 0};
        if (pfd.fd < 0 || (poll(&pfd, 1, -1) < 0 && errno != EINTR))
            return -1;
    }
    return rc;
}

/* Read (without the GIL) until a result is ready on conn, so PQgetResult will not block.
 * Returns 0 on success, -1 when the connection failed. */
static int
wait_ready(void *conn)
{
    while (PQisBusy(conn)) {
        struct pollfd pfd = {PQsocket(conn), POLLIN, 0};
        if (pfd.fd < 0)
            return -1;
        if (poll(&pfd, 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (!PQconsumeInput(conn))
            return -1;
    }
    return 0;
}

static int
get_conn(PyObject *arg, void **out)
{
    unsigned long long ptr = PyLong_AsUnsignedLongLong(arg);
    if (ptr == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (ptr == 0) {
        PyErr_SetString(PyExc_ValueError, "null PGconn");
        return -1;
    }
    *out = (void *)(uintptr_t)ptr;
    return 0;
}

static int
bound(void)
{
    if (PQgetCopyData == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_relay.bind() has not been called");
        return 0;
    }
    return 1;
}

static PyObject *
relay(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *source, *target;
    long long limit, moved = 0;
    int state = MORE, fill = 0, was_nonblocking;
    char *block;

    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "relay(source, target, limit) takes 3 arguments");
        return NULL;
    }
    if (!bound() || get_conn(args[0], &source) < 0 || get_conn(args[1], &target) < 0)
        return NULL;
    limit = PyLong_AsLongLong(args[2]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    block = PyMem_RawMalloc(BLOCK_SIZE);
    if (block == NULL)
        return PyErr_NoMemory();

    Py_BEGIN_ALLOW_THREADS
    /* psycopg keeps its connections non-blocking, where PQputCopyData grows libpq's output buffer
     * without bound when the target is slower than the source. Blocking mode makes libpq wait
     * for the socket instead (reading input meanwhile, so the two sides cannot deadlock). */
    was_nonblocking = PQisnonblocking(target);
    if (was_nonblocking && (flush_all(target) != 0 || PQsetnonblocking(target, 0) != 0))
        state = TARGET_FAILED;
    while (state == MORE && moved < limit) {
        char *row = NULL;
        int n = PQgetCopyData(source, &row, 0);
        if (n < 0) {
            state = n == -1 ? SOURCE_END : SOURCE_LOST;
            break;
        }
        if (fill + n > BLOCK_SIZE && fill > 0) {
            if (PQputCopyData(target, block, fill) != 1)
                state = TARGET_FAILED;
            fill = 0;
        }
        if (state == MORE) {
            if (n >= BLOCK_SIZE) {
                if (PQputCopyData(target, row, n) != 1)
                    state = TARGET_FAILED;
            }
            else {
                memcpy(block + fill, row, n);
                fill += n;
            }
            moved += n;
        }
        PQfreemem(row);
    }
    if (fill > 0 && state != TARGET_FAILED && PQputCopyData(target, block, fill) != 1)
        state = TARGET_FAILED;
    if (was_nonblocking && PQsetnonblocking(target, 1) != 0 && state != SOURCE_LOST)
        state = TARGET_FAILED;
    /* The source's COPY has ended: read until its final result is in, so Python can take it
     * without blocking while holding the GIL. */
    if (state == SOURCE_END && wait_ready(source) < 0)
        state = SOURCE_LOST;
    Py_END_ALLOW_THREADS

    PyMem_RawFree(block);
    return Py_BuildValue("(iL)", state, moved);
}

static PyObject *
wait_result(PyObject *self, PyObject *arg)
{
    void *conn;
    int rc;
    if (!bound() || get_conn(arg, &conn) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = wait_ready(conn);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc == 0);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(PQgetCopyData, PQputCopyData, PQfreemem, PQsocket, PQconsumeInput, PQisBusy, "
     "PQisnonblocking, PQsetnonblocking, PQflush)\n--\n\nThe addresses of psycopg's libpq functions. "
     "Call once before relay()."},
    {"relay", (PyCFunction)(void (*)(void))relay, METH_FASTCALL,
     "relay(source, target, limit)\n--\n\nMove COPY data from the source PGconn (COPY OUT) to "
     "the target PGconn (COPY IN) until the source's COPY ends or about limit bytes moved. "
     "Returns (state, bytes moved); state 0: more to come, 1: the source's COPY ended (its "
     "result is ready), 2: the source connection failed, 3: the target connection failed."},
    {"wait_result", wait_result, METH_O,
     "wait_result(conn)\n--\n\nWait without the GIL until PQgetResult will not block; False "
     "when the connection failed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "applier.sync._relay",
    "C relay of COPY data between two libpq connections; see relay.py.", -1, methods,
};

PyMODINIT_FUNC
PyInit__relay(void)
{
    return PyModule_Create(&module_def);
}
