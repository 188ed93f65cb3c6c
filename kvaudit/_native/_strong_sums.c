/* The checksum's strong lane on the CPU in C (docs/checksum.md, "The strong lane").
 *
 * A row is one block of a piece view [blocks, kernel_blocks, heads, tokens, pieces]. Its
 * strong sum is, modulo the prime P = 2**64 - 59,
 *
 *     sum over its cell rows (h, u) of  N[h, u] * head_weights[h] * token_weights[t mod 4096]
 *
 * with t = first + u the token's request position and N[h, u] the cell row's pieces
 * x_0 .. x_{n-1} read as one little-endian number, sum of x_p * 2**(64 p), reduced mod P.
 * Since 2**64 = 59 (mod P), N is a Horner sum from the last piece down: r = r * 59 + x_p,
 * one 64x64 multiplication by a small constant per piece, folded back below 2**64 at
 * once. Four cell rows run side by side, so that the multiplier's latency is hidden.
 * The weights (64-bit residues) meet each cell row once.
 *
 * Pieces of 2 or 4 bytes are zero-extended; loads go through memcpy, as in _row_sums.c.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_piece_views.h"

typedef unsigned __int128 u128;

/* P = 2**64 - 59; 2**64 is 59 modulo P. */
#define PRIME_GAP 59u
#define PRIME ((uint64_t)0 - PRIME_GAP)
#define TOKEN_PLACES 4096

/* The rows of one call and their weights. */
typedef struct {
    Py_ssize_t count;
    const int64_t *block_ids, *first_tokens, *valid_tokens;
    const uint64_t *head_weights, *token_weights;
    uint64_t *sums;
} Rows;

/* A value below 2**128 folded to one below 2**64 that is equal modulo P. */
static inline uint64_t fold(u128 value)
{
    uint64_t low = (uint64_t)value;
    u128 high = (value >> 64) * PRIME_GAP;
    u128 once = high + low; /* below 2**71 */
    uint64_t low2 = (uint64_t)once;
    uint64_t high2 = (uint64_t)(once >> 64) * PRIME_GAP; /* below 2**13 */
    uint64_t sum = low2 + high2;
    return sum < low2 ? sum + PRIME_GAP : sum; /* a carry past 2**64 is worth 59 */
}

/* A value below 2**64 as its residue in [0, P). */
static inline uint64_t reduce(uint64_t value)
{
    return value >= PRIME ? value - PRIME : value;
}

static inline uint64_t mul_mod(uint64_t a, uint64_t b)
{
    return reduce(fold((u128)a * b));
}

static inline uint64_t add_mod(uint64_t a, uint64_t b)
{
    a = reduce(a);
    b = reduce(b);
    uint64_t sum = a + b;
    if (sum < a) sum += PRIME_GAP; /* past 2**64: 2**64 - P = 59 */
    return reduce(sum);
}

static inline uint64_t load_piece(const char *at, Py_ssize_t itemsize)
{
    if (itemsize == 8) {
        uint64_t value;
        memcpy(&value, at, 8);
        return value;
    }
    if (itemsize == 4) {
        uint32_t value;
        memcpy(&value, at, 4);
        return value;
    }
    uint16_t value;
    memcpy(&value, at, 2);
    return value;
}

/* One Horner step: r * 2**64 + x, folded below 2**64 (r * 59 + x < 2**70). */
static inline uint64_t horner(uint64_t r, uint64_t x)
{
    u128 value = (u128)r * PRIME_GAP + x;
    uint64_t low = (uint64_t)value, top = (uint64_t)(value >> 64); /* top < 59 */
    /* top * 59 by shifts: the multiplier stays free for the next step's product. */
    uint64_t high = (top << 6) - (top << 2) - top;
    uint64_t sum = low + high;
    return sum < low ? sum + PRIME_GAP : sum;
}

/* A cell row: where its first piece lies, and its weight. */
typedef struct {
    const char *at;
    uint64_t weight;
} CellRow;

/* 8 bytes at `at` as a little-endian piece. */
static inline uint64_t load_word(const char *at)
{
    uint64_t value;
    memcpy(&value, at, 8);
    return value;
}

/* The fast path of `numbers`: contiguous 8-byte pieces, 8 cell rows side by side (the
 * multiplier's latency is hidden behind 7 other chains). Returns the rows it did. */
static Py_ssize_t numbers_of_words(const CellRow *cells, Py_ssize_t n, Py_ssize_t last,
                                   uint64_t *out)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t r[8] = {0};
        const char *a[8];
        for (int c = 0; c < 8; c++) a[c] = cells[i + c].at + last * 8;
        for (Py_ssize_t q = 0; q <= last; q++) {
            Py_ssize_t back = -q * 8;
            for (int c = 0; c < 8; c++) r[c] = horner(r[c], load_word(a[c] + back));
        }
        for (int c = 0; c < 8; c++) out[i + c] = r[c];
    }
    return i;
}

/* Cell rows whose numbers are computed in one go. */
#define BATCH 256

/* The number N of `n` (at most BATCH) cell rows, 4 side by side. */
#if defined(__GNUC__)
__attribute__((noinline))
#endif
static void numbers(const CellRow *cells, Py_ssize_t n, const Layout *v, uint64_t *out)
{
    Py_ssize_t i = 0;
    if (n > BATCH) n = BATCH;
    Py_ssize_t last = v->pieces - 1, step = v->piece_step, size = v->itemsize;
    if (size == 8 && step == 8) i = numbers_of_words(cells, n, last, out);
    for (; i + 4 <= n; i += 4) {
        uint64_t r0 = 0, r1 = 0, r2 = 0, r3 = 0;
        const char *a0 = cells[i].at, *a1 = cells[i + 1].at, *a2 = cells[i + 2].at,
                   *a3 = cells[i + 3].at;
        for (Py_ssize_t q = 0; q <= last; q++) {
            Py_ssize_t offset = (last - q) * step;
            r0 = horner(r0, load_piece(a0 + offset, size));
            r1 = horner(r1, load_piece(a1 + offset, size));
            r2 = horner(r2, load_piece(a2 + offset, size));
            r3 = horner(r3, load_piece(a3 + offset, size));
        }
        out[i] = r0;
        out[i + 1] = r1;
        out[i + 2] = r2;
        out[i + 3] = r3;
    }
    uint64_t *slot = out + i;
    for (const CellRow *cell = cells + i, *end = cells + n; cell < end; cell++, slot++) {
        uint64_t r = 0;
        for (Py_ssize_t q = 0; q <= last; q++)
            r = horner(r, load_piece(cell->at + (last - q) * step, size));
        *slot = r;
    }
}

/* Every row's strong sum into rows->sums; runs without the GIL. */
static void all_strong_sums(const Layout *v, const Rows *rows)
{
    CellRow cells[BATCH];
    uint64_t values[BATCH];
    Py_ssize_t per_row = v->kernel_blocks * v->tokens;
    for (Py_ssize_t i = 0; i < rows->count; i++) {
        Py_ssize_t count = (Py_ssize_t)rows->valid_tokens[i];
        const char *row = v->data + (Py_ssize_t)rows->block_ids[i] * v->block_step;
        uint64_t first = (uint64_t)rows->first_tokens[i];
        uint64_t total = 0;
        Py_ssize_t held = 0;
        if (count > per_row) count = per_row;
        for (Py_ssize_t h = 0; h < v->heads && v->pieces > 0; h++) {
            for (Py_ssize_t u = 0; u < count; u++) {
                Py_ssize_t k = u / v->tokens, t = u % v->tokens;
                uint64_t place = (first + (uint64_t)u) % TOKEN_PLACES;
                cells[held].at = row + k * v->kernel_block_step + h * v->head_step
                                 + t * v->token_step;
                cells[held].weight = mul_mod(rows->head_weights[h], rows->token_weights[place]);
                if (++held == BATCH) {
                    numbers(cells, held, v, values);
                    for (Py_ssize_t c = 0; c < held; c++)
                        total = add_mod(total, mul_mod(reduce(values[c]), cells[c].weight));
                    held = 0;
                }
            }
        }
        numbers(cells, held, v, values);
        for (Py_ssize_t c = 0; c < held; c++)
            total = add_mod(total, mul_mod(reduce(values[c]), cells[c].weight));
        rows->sums[i] = total;
    }
}

PyDoc_STRVAR(strong_sums_doc,
             "strong_sums(pieces, block_ids, first_tokens, valid_tokens, head_weights, "
             "token_weights, sums)\n--\n\n"
             "Write into sums[i] the strong-lane sum (a residue modulo 2**64 - 59, as int64 "
             "bits) of row block_ids[i] of the piece view pieces [blocks, kernel_blocks, "
             "heads, tokens, pieces] over its first valid_tokens[i] tokens, numbered from "
             "first_tokens[i]. The other arguments are contiguous 1-D int64 arrays: "
             "head_weights [heads], token_weights [4096], sums (written) one per row.");

/* The call's rows, read from its checked buffers, through the loop. */
static void run_strong_sums(const Layout *layout, const Py_buffer buffers[7])
{
    Rows rows = {
        .count = buffers[1].shape[0],
        .block_ids = buffers[1].buf,
        .first_tokens = buffers[2].buf,
        .valid_tokens = buffers[3].buf,
        .head_weights = buffers[4].buf,
        .token_weights = buffers[5].buf,
        .sums = buffers[6].buf,
    };
    all_strong_sums(layout, &rows);
}

static PyObject *strong_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"block_ids",    "first_tokens",  "valid_tokens",
                                        "head_weights", "token_weights", "sums"};
    static const Py_ssize_t lengths[] = {PER_ROW,  PER_ROW,      PER_ROW,
                                         PER_HEAD, TOKEN_PLACES, PER_ROW};
    return call_loop("strong_sums", args, nargs, names, lengths, run_strong_sums);
}

LOOP_MODULE(_strong_sums, strong_sums, strong_sums_doc,
            "The checksum's strong lane in C (kvaudit/checksum/strong.py).")
