/* A 5-D piece view [blocks, kernel_blocks, heads, tokens, pieces] and the int64 vectors
 * beside it, read from Python buffers: what every checksum loop of kvaudit/_native takes
 * (_row_sums.c, the seed lane; _strong_sums.c, the strong lane). */

#ifndef KVAUDIT_PIECE_VIEWS_H
#define KVAUDIT_PIECE_VIEWS_H

#include <Python.h>

#include <stdint.h>
#include <string.h>

/* A view's layout as the loops read it: element strides in bytes, sizes. */
typedef struct {
    const char *data;
    Py_ssize_t itemsize;
    Py_ssize_t blocks, kernel_blocks, heads, tokens, pieces;
    Py_ssize_t block_step, kernel_block_step, head_step, token_step, piece_step;
} Layout;

/* Whether a buffer format names an integer type of native byte order. */
static int integer_format(const char *format)
{
    if (format == NULL) return 1; /* "B", unsigned bytes */
    if (*format == '<' || *format == '=' || *format == '@') {
#if PY_BIG_ENDIAN
        if (*format == '<') return 0;
#endif
        format++;
    }
    return format[0] != '\0' && format[1] == '\0' && strchr("bBhHiIlLqQnN", format[0]) != NULL;
}

/* An int64 C-contiguous 1-D buffer of `length` items (-1: any length, set on return). */
static int int64_vector(Py_buffer *buffer, const char *name, Py_ssize_t *length)
{
    if (buffer->ndim != 1 || buffer->itemsize != 8 || !integer_format(buffer->format)
        || (buffer->strides != NULL && buffer->strides[0] != 8)) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous 1-D int64 array", name);
        return -1;
    }
    if (*length >= 0 && buffer->shape[0] != *length) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd values, expected %zd", name,
                     buffer->shape[0], *length);
        return -1;
    }
    *length = buffer->shape[0];
    return 0;
}

/* The layout of a 5-D piece view; -1 with an exception where it is not one. */
static int read_layout(const Py_buffer *view, Layout *layout)
{
    if (view->ndim != 5 || !integer_format(view->format)
        || (view->itemsize != 2 && view->itemsize != 4 && view->itemsize != 8)) {
        PyErr_SetString(PyExc_ValueError,
                        "pieces must be a 5-D array of 2-, 4- or 8-byte integers");
        return -1;
    }
    Py_ssize_t steps[5];
    for (int axis = 4; axis >= 0; axis--)
        steps[axis] = view->strides != NULL ? view->strides[axis]
                      : axis == 4           ? view->itemsize
                                            : steps[axis + 1] * view->shape[axis + 1];
    *layout = (Layout){
        .data = view->buf,
        .itemsize = view->itemsize,
        .blocks = view->shape[0],
        .kernel_blocks = view->shape[1],
        .heads = view->shape[2],
        .tokens = view->shape[3],
        .pieces = view->shape[4],
        .block_step = steps[0],
        .kernel_block_step = steps[1],
        .head_step = steps[2],
        .token_step = steps[3],
        .piece_step = steps[4],
    };
    return 0;
}

/* Every row within the view: its block exists and its token count fits the row. Checked
 * once per call by each loop, because the loops read wherever a block id points. */
static int check_rows(const Layout *v, Py_ssize_t count, const int64_t *block_ids,
                      const int64_t *valid_tokens)
{
    Py_ssize_t tokens_per_row = v->kernel_blocks * v->tokens;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (block_ids[i] < 0 || block_ids[i] >= v->blocks) {
            PyErr_Format(PyExc_IndexError, "block id %lld is outside the view's %zd blocks",
                         (long long)block_ids[i], v->blocks);
            return -1;
        }
        if (valid_tokens[i] < 0 || valid_tokens[i] > tokens_per_row) {
            PyErr_Format(PyExc_ValueError, "%lld valid tokens in a row of %zd",
                         (long long)valid_tokens[i], tokens_per_row);
            return -1;
        }
    }
    return 0;
}

/* The call's 7 buffers: the piece view, then 6 int64 vectors of which the last is
 * written; `*held` counts those taken (to release), -1 with an exception on failure. */
static int take_buffers(PyObject *const *args, Py_buffer buffers[7], int *held)
{
    for (*held = 0; *held < 7; (*held)++) {
        int flags = *held == 6 ? PyBUF_RECORDS : PyBUF_RECORDS_RO;
        if (PyObject_GetBuffer(args[*held], &buffers[*held], flags) < 0) return -1;
    }
    return 0;
}

/* What a vector of a loop's call holds: one value per row, per head, per head and piece,
 * or a fixed count (>= 0). */
enum { PER_ROW = -1, PER_HEAD = -2, PER_HEAD_PIECE = -3 };

/* A loop's whole call taken and checked: 7 arguments (`function` in the error), their
 * buffers (`*held` of them to release), the piece view's layout, the 6 vectors `names`
 * of the lengths `lengths` (block ids, first tokens and valid tokens first, the written
 * sums last), and every row within the view; -1 with an exception on failure. */
static int take_call(const char *function, PyObject *const *args, Py_ssize_t nargs,
                     const char *const names[6], const Py_ssize_t lengths[6],
                     Py_buffer buffers[7], int *held, Layout *layout)
{
    *held = 0;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "%s takes 7 arguments, %zd given", function, nargs);
        return -1;
    }
    if (take_buffers(args, buffers, held) < 0 || read_layout(&buffers[0], layout) < 0)
        return -1;
    Py_ssize_t rows = -1;
    for (int i = 0; i < 6; i++) {
        Py_ssize_t length = lengths[i] == PER_HEAD         ? layout->heads
                            : lengths[i] == PER_HEAD_PIECE ? layout->heads * layout->pieces
                                                           : lengths[i];
        if (int64_vector(&buffers[i + 1], names[i], lengths[i] == PER_ROW ? &rows : &length) < 0)
            return -1;
    }
    return check_rows(layout, rows, buffers[1].buf, buffers[3].buf);
}

/* A loop over a call's rows: the view's layout and the call's 7 buffers, all checked. */
typedef void (*Loop)(const Layout *layout, const Py_buffer buffers[7]);

/* A loop's Python function: the call taken and checked (`take_call`), then `loop` run
 * without the GIL; None, or NULL with an exception. */
static PyObject *call_loop(const char *function, PyObject *const *args, Py_ssize_t nargs,
                           const char *const names[6], const Py_ssize_t lengths[6], Loop loop)
{
    Py_buffer buffers[7];
    int held = 0;
    Layout layout;
    PyObject *result = NULL;
    if (take_call(function, args, nargs, names, lengths, buffers, &held, &layout) == 0) {
        Py_BEGIN_ALLOW_THREADS
        loop(&layout, buffers);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    for (int i = 0; i < held; i++) PyBuffer_Release(&buffers[i]);
    return result;
}

/* The module `kvaudit._native.NAME` of one loop function: its method table, its
 * definition and its init function. */
#define LOOP_MODULE(NAME, FUNCTION, FUNCTION_DOC, MODULE_DOC)                                 \
    static PyMethodDef methods[] = {                                                         \
        {#FUNCTION, (PyCFunction)(void (*)(void))FUNCTION, METH_FASTCALL, FUNCTION_DOC},     \
        {NULL, NULL, 0, NULL},                                                               \
    };                                                                                       \
    static struct PyModuleDef module = {                                                     \
        PyModuleDef_HEAD_INIT,                                                               \
        .m_name = "kvaudit._native." #NAME,                                                  \
        .m_doc = MODULE_DOC,                                                                 \
        .m_size = 0,                                                                         \
        .m_methods = methods,                                                                \
    };                                                                                       \
    PyMODINIT_FUNC PyInit_##NAME(void)                                                       \
    {                                                                                        \
        return PyModuleDef_Init(&module);                                                    \
    }

#endif
