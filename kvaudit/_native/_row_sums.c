/* The checksum's row sums on the CPU in C: the loop of kvaudit/checksum/kernels/numpy_cpu.py
 * (NumpyPart.row_sums) at memory speed, for the numpy backend.
 *
 * A row is one block of a piece view [blocks, kernel_blocks, heads, tokens, pieces]; its
 * sum (docs/checksum.md, "How kvaudit computes it") is
 *
 *     sum over (h, p) of  Y[h, p] * piece_weights[h, p]
 *   + sum over h of       head_weights[h] * (first * Y[h] + Z[h])      (mod 2**64)
 *
 * with Y[h, p] a piece's sum over the row's first `count` tokens, Y[h] its sum over pieces
 * and Z[h] = count * Y[h] - (the running sums Y_u[h] summed over tokens u). One pass over
 * the tokens, in token order, builds Y with one addition per piece and the running-sum
 * total with one more: the weights (64-bit multiplications) only meet Y, once per row.
 * Y for the heads and pieces of a tile stays in L1; the row is read once, in place.
 *
 * All arithmetic is on uint64_t, which wraps modulo 2**64 as the spec requires. Pieces of
 * 2 or 4 bytes are zero-extended; 8-byte pieces are read as their bits. Loads go through
 * memcpy: a dump's mapping may place a tensor at any byte offset, and memcpy of a fixed
 * size compiles to one (unaligned) load.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Words of Y one tile holds: 16 KiB, so that Y stays in L1 beside the row's stream. */
#define TILE_WORDS 2048

/* The AVX2 build of the loop beside the baseline one, picked at load time by the CPU
 * (gcc's function multiversioning needs ifunc, so glibc on x86-64). Built wheels stay
 * portable: no -march flag. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define MULTIVERSIONED __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MULTIVERSIONED
#endif

/* The helpers of the loop are inlined into each of its builds (an outlined helper would
 * have only the baseline build). */
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

/* A view's layout as the loop reads it: element strides in bytes, sizes. */
typedef struct {
    const char *data;
    Py_ssize_t itemsize;
    Py_ssize_t blocks, kernel_blocks, heads, tokens, pieces;
    Py_ssize_t block_step, kernel_block_step, head_step, token_step, piece_step;
} Layout;

/* The rows of one call and their weights (all int64 arrays read as uint64). */
typedef struct {
    Py_ssize_t count;
    const int64_t *block_ids, *first_tokens, *valid_tokens;
    const uint64_t *piece_weights, *head_weights;
    uint64_t *sums;
} Rows;

/* One token's pieces of one head: y[p] += x[p] for each piece, then the sum of the new
 * y (the running sums' total grows by it). TYPE is the piece's unsigned integer type;
 * STEP its stride in bytes, a constant in the contiguous case so that it vectorises. */
#define ADD_TOKEN(TYPE, STEP)                                                               \
    do {                                                                                    \
        for (Py_ssize_t p = 0; p < n; p++) {                                                \
            TYPE value;                                                                     \
            memcpy(&value, x + p * (STEP), sizeof value);                                   \
            y[p] += (uint64_t)value;                                                        \
            total += y[p];                                                                  \
        }                                                                                   \
    } while (0)

INLINE uint64_t add_token(uint64_t *restrict y, const char *restrict x, Py_ssize_t n,
                          Py_ssize_t itemsize, Py_ssize_t step)
{
    uint64_t total = 0;
    switch (itemsize) {
    case 8:
        if (step == 8) ADD_TOKEN(uint64_t, 8);
        else ADD_TOKEN(uint64_t, step);
        break;
    case 4:
        if (step == 4) ADD_TOKEN(uint32_t, 4);
        else ADD_TOKEN(uint32_t, step);
        break;
    default:
        if (step == 2) ADD_TOKEN(uint16_t, 2);
        else ADD_TOKEN(uint16_t, step);
        break;
    }
    return total;
}

/* One head's part of the row sum from its tile of Y: the weighted pieces plus the head
 * term, with Z = count * Y[h] - running (the running sums' total). */
INLINE uint64_t head_sum(const uint64_t *restrict y, const uint64_t *restrict weights,
                         Py_ssize_t n, uint64_t head_weight, uint64_t first, uint64_t count,
                         uint64_t running)
{
    uint64_t weighted = 0, pieces = 0;
    for (Py_ssize_t p = 0; p < n; p++) {
        weighted += y[p] * weights[p];
        pieces += y[p];
    }
    return weighted + head_weight * ((first + count) * pieces - running);
}

/* The sum of one row over its first `count` tokens, tile by tile of heads and pieces:
 * within a tile the tokens run in order (the running sums need it), the heads and pieces
 * of each token in memory order. */
INLINE uint64_t row_sum(const Layout *v, const Rows *rows, const char *row, uint64_t first,
                        Py_ssize_t count, uint64_t *y, uint64_t *running)
{
    Py_ssize_t tile_pieces = v->pieces < TILE_WORDS ? v->pieces : TILE_WORDS;
    Py_ssize_t tile_heads = TILE_WORDS / tile_pieces;
    uint64_t sum = 0;
    for (Py_ssize_t h0 = 0; h0 < v->heads; h0 += tile_heads) {
        Py_ssize_t heads = v->heads - h0 < tile_heads ? v->heads - h0 : tile_heads;
        for (Py_ssize_t p0 = 0; p0 < v->pieces; p0 += tile_pieces) {
            Py_ssize_t n = v->pieces - p0 < tile_pieces ? v->pieces - p0 : tile_pieces;
            memset(y, 0, (size_t)(heads * n) * sizeof *y);
            memset(running, 0, (size_t)heads * sizeof *running);
            const char *tile = row + h0 * v->head_step + p0 * v->piece_step;
            for (Py_ssize_t u = 0; u < count; u++) {
                const char *token = tile + (u / v->tokens) * v->kernel_block_step
                                    + (u % v->tokens) * v->token_step;
                for (Py_ssize_t h = 0; h < heads; h++)
                    running[h] += add_token(y + h * n, token + h * v->head_step, n,
                                            v->itemsize, v->piece_step);
            }
            for (Py_ssize_t h = 0; h < heads; h++) {
                const uint64_t *weights = rows->piece_weights + (h0 + h) * v->pieces + p0;
                sum += head_sum(y + h * n, weights, n, rows->head_weights[h0 + h], first,
                                (uint64_t)count, running[h]);
            }
        }
    }
    return sum;
}

/* Every row's sum into rows->sums; runs without the GIL. */
MULTIVERSIONED
static void all_row_sums(const Layout *v, const Rows *rows)
{
    uint64_t y[TILE_WORDS], running[TILE_WORDS];
    for (Py_ssize_t i = 0; i < rows->count; i++) {
        Py_ssize_t count = (Py_ssize_t)rows->valid_tokens[i];
        const char *row = v->data + (Py_ssize_t)rows->block_ids[i] * v->block_step;
        rows->sums[i] = count > 0 && v->pieces > 0 && v->heads > 0
                            ? row_sum(v, rows, row, (uint64_t)rows->first_tokens[i], count,
                                      y, running)
                            : 0;
    }
}

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
 * here, once per call, because the loop reads wherever a block id points. */
static int check_rows(const Layout *v, const Rows *rows)
{
    Py_ssize_t tokens_per_row = v->kernel_blocks * v->tokens;
    for (Py_ssize_t i = 0; i < rows->count; i++) {
        if (rows->block_ids[i] < 0 || rows->block_ids[i] >= v->blocks) {
            PyErr_Format(PyExc_IndexError, "block id %lld is outside the view's %zd blocks",
                         (long long)rows->block_ids[i], v->blocks);
            return -1;
        }
        if (rows->valid_tokens[i] < 0 || rows->valid_tokens[i] > tokens_per_row) {
            PyErr_Format(PyExc_ValueError, "%lld valid tokens in a row of %zd",
                         (long long)rows->valid_tokens[i], tokens_per_row);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(row_sums_doc,
             "row_sums(pieces, block_ids, first_tokens, valid_tokens, piece_weights, "
             "head_weights, sums)\n--\n\n"
             "Write into sums[i] the weighted sum (mod 2**64, as int64) of row "
             "block_ids[i] of the piece view pieces [blocks, kernel_blocks, heads, tokens, "
             "pieces] over its first valid_tokens[i] tokens, numbered from first_tokens[i]. "
             "The other arguments are contiguous 1-D int64 arrays: piece_weights "
             "[heads * pieces], head_weights [heads], sums (written) one per row.");

static PyObject *row_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"block_ids",     "first_tokens", "valid_tokens",
                                        "piece_weights", "head_weights", "sums"};
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "row_sums takes 7 arguments, %zd given", nargs);
        return NULL;
    }
    Py_buffer buffers[7];
    int held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &buffers[0], PyBUF_RECORDS_RO) < 0) goto done;
    for (held = 1; held < 7; held++) {
        int flags = held == 6 ? PyBUF_RECORDS : PyBUF_RECORDS_RO;
        if (PyObject_GetBuffer(args[held], &buffers[held], flags) < 0) goto done;
    }
    Layout layout;
    if (read_layout(&buffers[0], &layout) < 0) goto done;
    Py_ssize_t count = -1, piece_count = layout.heads * layout.pieces, heads = layout.heads;
    Py_ssize_t *lengths[6] = {&count, &count, &count, &piece_count, &heads, &count};
    for (int i = 0; i < 6; i++)
        if (int64_vector(&buffers[i + 1], names[i], lengths[i]) < 0) goto done;
    Rows rows = {
        .count = count,
        .block_ids = buffers[1].buf,
        .first_tokens = buffers[2].buf,
        .valid_tokens = buffers[3].buf,
        .piece_weights = buffers[4].buf,
        .head_weights = buffers[5].buf,
        .sums = buffers[6].buf,
    };
    if (check_rows(&layout, &rows) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    all_row_sums(&layout, &rows);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&buffers[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"row_sums", (PyCFunction)(void (*)(void))row_sums, METH_FASTCALL, row_sums_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvaudit._native._row_sums",
    .m_doc = "The numpy backend's row sums in C (kvaudit/checksum/kernels/numpy_cpu.py).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__row_sums(void)
{
    return PyModuleDef_Init(&module);
}
