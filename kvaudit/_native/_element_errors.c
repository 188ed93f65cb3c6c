/* kvaudit._native._element_errors: the errors between two sides' values of one layer's batch in
 * one pass (docs/numeric.md), the fused form of kvaudit/numeric/value_errors.py's numpy path.
 *
 * Each side is given as the raw bits of its elements, [heads, tokens, elements] in its
 * layer's dtype; every (head, token) row is decoded (exactly, times the side's K and V
 * scales, in the type the numpy path decodes into: inside the loop where both sides are of
 * one narrow kind in whole vectors, else into a small buffer first), then reduced in one
 * loop: per row the largest |c - p| and |p|, per head the largest relative error, the
 * elements over tolerance, the NaN and Inf on one side only and the sum of squared errors
 * (in double), per token the largest scaled error over heads. Rows of finite errors take a
 * vectorized loop; a row with a NaN or Inf takes an element-by-element one.
 *
 * Plain C and the CPython API only (buffers through the buffer protocol: no numpy
 * headers); the GIL is released around the loops, so layers run on several threads. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h> /* madvise: releasing the mapped pages of rows read in place */
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "the elements' bits are read as little-endian"
#endif

#include "_inline.h"

/* The loops are compiled twice where the compiler targets x86-64: for AVX2 (vectors of
 * 32 bytes), chosen at load time where the CPU has it, and portable (vectors of 16 bytes:
 * SSE2, NEON) for every CPU. */
#if defined(__x86_64__) && defined(__GNUC__)
#define WITH_AVX2 1
#define AVX2 __attribute__((target("avx2")))
#include <immintrin.h>
static int use_avx2;
#else
#define WITH_AVX2 0
#endif

#define LANES 8 /* the widest vector's elements: rows are padded to a multiple */

/* The dtypes read here, in the order of KINDS (their kvaudit names). */
enum Kind { BF16, F16, F32, F64, E4M3FN, E5M2, KIND_COUNT };
static const char *const KIND_NAMES[KIND_COUNT] = {
    "bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
};
static const Py_ssize_t KIND_SIZES[KIND_COUNT] = {2, 2, 4, 8, 1, 1};

/* Narrow kinds are decoded into float (every value exact), wide ones into double. */
static int is_wide(int kind) { return kind == F32 || kind == F64; }

/* GNU C vectors: of 16 bytes (an SSE2 or NEON register), of 32 (an AVX2 one), and of 8
 * (the floats widened into 16 bytes of doubles). */
typedef float f32x2 __attribute__((vector_size(8)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x4 __attribute__((vector_size(8)));
typedef double f64x2 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef int64_t i64x2 __attribute__((vector_size(16)));
typedef int64_t i64x4 __attribute__((vector_size(32)));

/* Per lane, yes where take (all ones) and no where not (zero): integer vectors. */
#define SELECT(take, yes, no) (((take) & (yes)) | (~(take) & (no)))

/* The row loop's operations in portable vector code (_element_errors_row.h). */
#define GENERIC_MAX_BITS(x, y) SELECT((x) > (y), (x), (y))
#define GENERIC_MAX_REAL(x, y) ((VREAL)SELECT((x) > (y), (VBITS)(x), (VBITS)(y)))
#define GENERIC_WIDEN(a, at) __builtin_convertvector(PART_OF(a, at), VSQUARES)

#define MAX_PARTS 4 /* a row's parts read in place: a cell, or its K and V rows */

/* The dumps' file mappings rows are read from in place, held as buffers for the call (so
 * that none is unmapped meanwhile), and their first bytes. */
typedef struct {
    Py_ssize_t count;
    Py_buffer *views;
    const uint8_t **bases;
    int64_t *first_region; /* [count + 1]: each mapping's first entry in touched */
    uint8_t *touched;      /* per 2 MiB region of each mapping: read since last released */
    int64_t touched_count; /* how many are */
} Maps;

/* One side of a batch: its elements' bits, kind, and the scales of its K elements (the
 * first head_size of a row) and V elements (1 where none). The bits are either staged,
 * [heads, tokens, elements] in `bits`, or read in place from the mappings (`bits` NULL):
 * each row in `parts` pieces, part e holding the row's elements part_start[e] ..
 * part_start[e] + part_width[e] - 1 at byte where[(e * rows + row) * 2 + 1] of mapping
 * where[(e * rows + row) * 2] (rows = heads * tokens). */
typedef struct {
    const uint8_t *bits;
    int kind;
    Py_ssize_t head_size;
    double scales[2];
    int parts;
    Py_ssize_t part_start[MAX_PARTS], part_width[MAX_PARTS];
    const int64_t *where;
} Side;

#define WORST 5 /* worst token positions kept per head */
#define HEAD_BYTES 64 /* room for one head's figures of a batch, in either float type */

/* One layer's batch from request position lo: both sides, which rows both hold, the
 * shape, the tolerance; the layer's figures it is added to, and its token row. */
typedef struct {
    Side sides[2];
    const uint8_t *held; /* [heads, tokens] */
    Py_ssize_t heads, tokens, elements, lo;
    double atol, rtol;
    double *figures;          /* [4, heads]: max |c - p|, max rel, max |p|, sum of squares */
    int64_t *counts;          /* [3, heads]: tokens held, over tolerance, one-sided */
    double *worst_error;      /* [heads, WORST]: largest |c - p| first (0: none) */
    int64_t *worst_position;  /* [heads, WORST]: their request positions (-1: none) */
    double *token_row;        /* [tokens], or [heads, tokens] where by_head: largest
                                 scaled error (NaN where none held) */
    int by_head;              /* token_row per head (else the largest over heads) */
    double *head_ratio;       /* [heads] or NULL: largest |c - p| / (atol + rtol |p|) */
    double *token_ratio;      /* as token_row, or NULL: the largest such ratio */
    Maps *maps;               /* rows read in place: their mappings */
    Py_ssize_t chunk;         /* tokens compared head by head at a time (the rest: all) */
    Py_ssize_t release;       /* release the mapped regions read once they reach these
                                 bytes (checked after each chunk; 0: never) */
    int heads_inner;          /* within a chunk, token by token (else head by head) */
} Batch;

static void mark_rows_read(const Batch *b, Py_ssize_t h0, Py_ssize_t h1, Py_ssize_t first,
                           Py_ssize_t end);

#include "_element_values.h"

/* Keep a head's WORST positions of largest error, largest first, earliest on ties:
 * positions come in increasing order, so a later one enters only when strictly larger. */
static inline void keep_worst(double *error, int64_t *position, double value, int64_t at)
{
    if (!(value > error[WORST - 1]))
        return;
    int k = WORST - 1;
    for (; k > 0 && value > error[k - 1]; k--) {
        error[k] = error[k - 1];
        position[k] = position[k - 1];
    }
    error[k] = value;
    position[k] = at;
}

/* Add a head's figures of the batch to the layer's: maxima and the sum of squares. */
static inline void add_head(const Batch *b, Py_ssize_t h, double abs, double rel,
                            double scale, double squares)
{
    double *figures = b->figures + h;
    Py_ssize_t heads = b->heads;
    figures[0] = abs > figures[0] ? abs : figures[0];
    figures[heads] = rel > figures[heads] ? rel : figures[heads];
    figures[2 * heads] = scale > figures[2 * heads] ? scale : figures[2 * heads];
    figures[3 * heads] += squares;
}

#include "_element_errors_copies.h"

/* Which kind a name is; -1 if none. */
static int kind_of(PyObject *name)
{
    for (int kind = 0; kind < KIND_COUNT; kind++)
        if (PyUnicode_CompareWithASCIIString(name, KIND_NAMES[kind]) == 0)
            return kind;
    return -1;
}

/* Whether the shape fits the sides; sets ValueError if not. */
static int check_shape(const Batch *b)
{
    for (int s = 0; s < 2; s++) {
        Py_ssize_t head_size = b->sides[s].head_size;
        if (b->heads < 0 || b->tokens < 0 || head_size < 0 || head_size > b->elements) {
            PyErr_SetString(PyExc_ValueError, "bad batch shape");
            return 0;
        }
    }
    return 1;
}

/* Whether each buffer holds `want` bytes; sets ValueError if not (`first`: the number of
 * the first buffer, in messages). */
static int check_lengths(const Py_buffer *buffers, const Py_ssize_t *want, int count, int first)
{
    for (int i = 0; i < count; i++)
        if (buffers[i].len != want[i]) {
            PyErr_Format(PyExc_ValueError, "buffer %d holds %zd bytes, not %zd", first + i,
                         buffers[i].len, want[i]);
            return 0;
        }
    return 1;
}

/* The outputs (figures, counts, worst errors and positions, token row, and where given
 * the head and token tolerance ratios) checked for their sizes and set in the batch. */
static int take_outputs(Batch *b, Py_buffer *out)
{
    if ((out[5].obj == NULL) != (out[6].obj == NULL)) {
        PyErr_SetString(PyExc_TypeError, "head_ratio and token_ratio go together");
        return 0;
    }
    Py_ssize_t heads = b->heads;
    /* The token row may be one per head (heads of several requests compared at once). */
    b->by_head = heads > 1 && out[4].len == heads * b->tokens * 8;
    Py_ssize_t want[5] = {4 * heads * 8, 3 * heads * 8, heads * WORST * 8, heads * WORST * 8,
                          (b->by_head ? heads : 1) * b->tokens * 8};
    if (!check_lengths(out, want, 5, 3))
        return 0;
    b->figures = out[0].buf;
    b->counts = out[1].buf;
    b->worst_error = out[2].buf;
    b->worst_position = out[3].buf;
    b->token_row = out[4].buf;
    if (out[5].obj != NULL) {
        Py_ssize_t ratios[2] = {heads * 8, want[4]};
        if (!check_lengths(out + 5, ratios, 2, 8))
            return 0;
        b->head_ratio = out[5].buf;
        b->token_ratio = out[6].buf;
    }
    return 1;
}

/* The batch through the loop of its float type, AVX2 where the CPU has it, the GIL
 * released: the heads' figures, two rows of doubles and one of floats (a narrow side
 * widened to double), padded with zeros to whole vectors. None, or NULL with
 * MemoryError. */
static PyObject *run_batch(const Batch *b)
{
    size_t padded = ((size_t)b->elements + LANES - 1) / LANES * LANES;
    size_t head_floats = (size_t)b->heads * HEAD_BYTES / sizeof(float);
    float *buffers = calloc(head_floats + padded * 5, sizeof(float));
    if (buffers == NULL)
        return PyErr_NoMemory();
    int wide = is_wide(b->sides[0].kind) || is_wide(b->sides[1].kind);
    void *heads = buffers;
    double *p_row = (double *)(buffers + head_floats), *c_row = p_row + padded;
    float *scratch = (float *)(c_row + padded);
    Py_BEGIN_ALLOW_THREADS
#if WITH_AVX2
    if (use_avx2 && wide)
        compare_batch_f64_avx2(b, heads, p_row, c_row, scratch);
    else if (use_avx2)
        compare_batch_f32_avx2(b, heads, (float *)p_row, (float *)c_row, scratch);
    else
#endif
    if (wide)
        compare_batch_f64(b, heads, p_row, c_row, scratch);
    else
        compare_batch_f32(b, heads, (float *)p_row, (float *)c_row, scratch);
    Py_END_ALLOW_THREADS
    free(buffers);
    return Py_NewRef(Py_None);
}

/* A side's kind from its name; ValueError if not one read here. */
static int take_kind(Side *side, PyObject *name)
{
    side->kind = kind_of(name);
    if (side->kind < 0) {
        PyErr_Format(PyExc_ValueError, "cannot compare %U elements", name);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(compare_doc,
    "compare(p, c, held, shape, p_side, c_side, tolerance, lo, figures, counts,\n"
    "        worst_error, worst_position, token_row[, head_ratio, token_ratio])\n--\n\n"
    "Add one layer's batch from request position lo to its figures: p and c the bits of\n"
    "[heads, tokens, elements] elements, held the uint8 [heads, tokens] rows both sides\n"
    "hold, shape (heads, tokens, elements), each side (kind: a name in KINDS, head_size,\n"
    "K scale, V scale; 1.0 for none), tolerance (atol, rtol). Updates the float64 figures\n"
    "[4, heads] (max abs, max rel, max |p|, sum of squares), the int64 counts [3, heads]\n"
    "(tokens, over tolerance, one-sided NaN or Inf), the worst 5 errors [heads, 5] (float64)\n"
    "and positions (int64); fills the float64 token_row [tokens] (or [heads, tokens]: one\n"
    "row per head). Where given, updates the float64 head_ratio [heads] (the largest\n"
    "|c - p| / (atol + rtol |p|); with atol 0, max rel / rtol) and fills token_ratio as\n"
    "token_row (the largest such ratio of the token's heads).");

static PyObject *compare(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer in[3], out[7];
    PyObject *kinds[2];
    Batch b;
    memset(&b, 0, sizeof b);
    memset(out, 0, sizeof out);
    Side *p = &b.sides[0], *c = &b.sides[1];
    if (!PyArg_ParseTuple(args, "y*y*y*(nnn)(Undd)(Undd)(dd)nw*w*w*w*w*|w*w*", &in[0], &in[1],
                          &in[2], &b.heads, &b.tokens, &b.elements, &kinds[0], &p->head_size,
                          &p->scales[0], &p->scales[1], &kinds[1], &c->head_size,
                          &c->scales[0], &c->scales[1], &b.atol, &b.rtol, &b.lo, &out[0],
                          &out[1], &out[2], &out[3], &out[4], &out[5], &out[6]))
        return NULL;
    PyObject *result = NULL;
    if (!take_kind(p, kinds[0]) || !take_kind(c, kinds[1]) || !check_shape(&b))
        goto done;
    Py_ssize_t rows = b.heads * b.tokens;
    Py_ssize_t want[3] = {rows * b.elements * KIND_SIZES[p->kind],
                          rows * b.elements * KIND_SIZES[c->kind], rows};
    if (!check_lengths(in, want, 3, 0) || !take_outputs(&b, out))
        goto done;
    p->bits = in[0].buf;
    c->bits = in[1].buf;
    b.held = in[2].buf;
    result = run_batch(&b);
done:
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&in[i]);
    for (int i = 0; i < 7; i++)
        PyBuffer_Release(&out[i]);
    return result;
}

#include "_mapped_rows.h"

static PyMethodDef methods[] = {
    {"compare", compare, METH_VARARGS, compare_doc},
    {"compare_mapped", compare_mapped, METH_VARARGS, compare_mapped_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_element_errors",
    .m_doc = "One layer's batch of two sides' elements compared in one pass (docs/numeric.md).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__element_errors(void)
{
#if WITH_AVX2
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    for (unsigned code = 0; code < 256; code++) {
        FP8_VALUES[0][code] = fp8_value(code, 4, 3, 0);
        FP8_VALUES[1][code] = fp8_value(code, 5, 2, 1);
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *names = PyTuple_New(KIND_COUNT);
    if (names == NULL)
        goto fail;
    for (int kind = 0; kind < KIND_COUNT; kind++) {
        PyObject *name = PyUnicode_FromString(KIND_NAMES[kind]);
        if (name == NULL) {
            Py_DECREF(names);
            goto fail;
        }
        PyTuple_SET_ITEM(names, kind, name);
    }
    if (PyModule_AddObject(m, "KINDS", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
