/* kvaudit._native._value_reads: a dump's block rows read from its file into the [heads, tokens,
 * elements] order diff --numeric compares in (docs/numeric.md), without a step in Python
 * per row.
 *
 * Each row is read with one pread into a buffer of the row's size, and its cells (one
 * head's elements of one token, at fixed strides in the row) copied to their places while
 * it is in the core's cache. (A preadv scattering the cells straight into place, one iovec
 * each, measured slower: the kernel's copy per iovec costs more than the copy out of the
 * cache.) Plain C and the CPython API; the GIL is released around the reads. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* Where a row's cells are: cell (k, h, t) of a row (kernel block, head, token) at byte
 * k * stride[0] + h * stride[1] + t * stride[2] of it, `cell` bytes long; `span` bytes
 * read per row. */
typedef struct {
    Py_ssize_t span, count[3], stride[3], cell;
} RowLayout;

/* Where they go: the rows' tokens in order, position (r * count[0] + k) * count[2] + t,
 * from `first` on, `count` of them (the rows at a batch's ends are cut short), to byte
 * base + h * head + (position - first) * token of the output. */
typedef struct {
    Py_ssize_t base, head, token, first, count;
} Target;

/* The output's byte of head h at the rows' token position `position`. */
static Py_ssize_t target_at(const Target *to, Py_ssize_t h, Py_ssize_t position)
{
    return to->base + h * to->head + (position - to->first) * to->token;
}

/* Whether every cell read and written lies inside the row and the output; ValueError if
 * not. */
static int check_layout(const RowLayout *row, const Target *to, Py_ssize_t rows, Py_ssize_t out)
{
    Py_ssize_t last = row->cell;
    for (int i = 0; i < 3; i++) {
        if (row->count[i] < 1 || row->stride[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "bad row layout");
            return 0;
        }
        last += (row->count[i] - 1) * row->stride[i];
    }
    if (row->cell < 1 || last > row->span || to->base < 0 || to->head < 0 || to->token < 0 ||
        to->first < 0 || to->count < 0 ||
        to->first + to->count > rows * row->count[0] * row->count[2]) {
        PyErr_SetString(PyExc_ValueError, "bad row layout");
        return 0;
    }
    if (to->count > 0) {
        Py_ssize_t end = target_at(to, row->count[1] - 1, to->first + to->count - 1) + row->cell;
        if (end > out) {
            PyErr_Format(PyExc_ValueError, "the output holds %zd bytes, not %zd", out, end);
            return 0;
        }
    }
    return 1;
}

/* Read `span` bytes at `offset` into `into`, retried when a signal interrupts the read;
 * the bytes read (fewer: the file ended), or -1 (errno set). */
static ssize_t read_span(int fd, uint8_t *into, Py_ssize_t span, off_t offset)
{
    ssize_t got;
    do
        got = pread(fd, into, (size_t)span, offset);
    while (got < 0 && errno == EINTR);
    return got;
}

/* Read the rows, each into `row_buffer` (it stays in the core's cache) and its cells
 * copied out; returns how many were read whole, or -1 (errno set) on an error. */
static Py_ssize_t scatter(int fd, const int64_t *offsets, Py_ssize_t rows, const RowLayout *row,
                          const Target *to, uint8_t *out, uint8_t *row_buffer)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        ssize_t got = read_span(fd, row_buffer, row->span, (off_t)offsets[r]);
        if (got < 0)
            return -1;
        if (got != row->span)
            return r;
        for (Py_ssize_t k = 0; k < row->count[0]; k++)
            for (Py_ssize_t t = 0; t < row->count[2]; t++) {
                Py_ssize_t position = (r * row->count[0] + k) * row->count[2] + t;
                if (position < to->first || position >= to->first + to->count)
                    continue;
                for (Py_ssize_t h = 0; h < row->count[1]; h++)
                    memcpy(out + target_at(to, h, position),
                           row_buffer + k * row->stride[0] + h * row->stride[1] +
                               t * row->stride[2],
                           (size_t)row->cell);
            }
    }
    return rows;
}

PyDoc_STRVAR(scatter_rows_doc,
    "scatter_rows(fd, offsets, row, out, target) -> int\n--\n\n"
    "Read rows of an open file into out: offsets the int64 file offset of each row, row\n"
    "(span, kernel blocks, heads, tokens, their three byte strides, cell bytes), target\n"
    "(base, head stride, token stride in bytes, first, count): cell (k, h, t) of row r, at\n"
    "position p = (r * blocks + k) * tokens + t of the rows, goes to byte base + h * head +\n"
    "(p - first) * token of out if first <= p < first + count. Returns how many rows were\n"
    "read whole (fewer: the file ended); OSError where a read fails.");

static PyObject *scatter_rows(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    Py_buffer offsets, out;
    RowLayout row;
    Target to;
    if (!PyArg_ParseTuple(args, "iy*(nnnnnnnn)w*(nnnnn)", &fd, &offsets, &row.span,
                          &row.count[0], &row.count[1], &row.count[2], &row.stride[0],
                          &row.stride[1], &row.stride[2], &row.cell, &out, &to.base, &to.head,
                          &to.token, &to.first, &to.count))
        return NULL;
    PyObject *result = NULL;
    uint8_t *row_buffer = NULL;
    Py_ssize_t rows = offsets.len / (Py_ssize_t)sizeof(int64_t);
    if (offsets.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "offsets are not int64");
        goto done;
    }
    if (!check_layout(&row, &to, rows, out.len))
        goto done;
    row_buffer = malloc((size_t)row.span);
    if (row_buffer == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t done_rows;
    int error;
    Py_BEGIN_ALLOW_THREADS
    done_rows = scatter(fd, offsets.buf, rows, &row, &to, out.buf, row_buffer);
    error = errno;
    Py_END_ALLOW_THREADS
    if (done_rows < 0) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t(done_rows);
done:
    free(row_buffer);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"scatter_rows", scatter_rows, METH_VARARGS, scatter_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_value_reads",
    .m_doc = "A dump's rows read from its file into the order diff --numeric compares in.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__value_reads(void)
{
    return PyModule_Create(&module);
}
