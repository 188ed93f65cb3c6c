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
 * Most views take a fast path (row_sum_words): contiguous 8-byte pieces, a multiple of 4
 * a cell, as every KV cache of 16- or 8-bit values has. It keeps each piece's running
 * sums' total R[h, p] beside Y (vectors of 4 pieces, in L1) instead of summing each new Y
 * across the cell's pieces, and adds 4 tokens at a time: per 4 pieces and token, one load
 * and two additions, Y and R loaded and stored once per 4 tokens, and no cost per cell
 * where a token's heads lie one after the other. The per-cell sums were what made small
 * cells (head size 64) cost more per byte than large ones (issue 28).
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

#include "_inline.h"
#include "_piece_views.h"

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

/* Four 8-byte pieces: one AVX2 register (two SSE2 registers in the baseline build). Only
 * inlined functions take or return one, so the warning that such a value's ABI differs
 * between builds (-Wpsabi) does not apply. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef uint64_t Words __attribute__((vector_size(32)));

/* Words of Y, and as many of R, one tile of the fast path holds: 2 x 8 KiB, in L1 beside
 * the row's stream. A multiple of 4. */
#define TILE_VECTOR_WORDS 1024

INLINE Words load_words(const char *x)
{
    Words words;
    memcpy(&words, x, sizeof words);
    return words;
}

INLINE uint64_t word_sum(Words words)
{
    return words[0] + words[1] + words[2] + words[3];
}

/* T (1, 2 or 4, a constant) tokens' `vectors` vectors of 4 pieces, from x[0 .. T-1], in
 * token order: y += x (Y so far), then r += y (R, the running sums' total, per piece).
 * Y and R are read and written once per T tokens; no sum across pieces is taken. */
#define ADD_TOKENS(T)                                                                       \
    do {                                                                                    \
        for (Py_ssize_t j = 0; j < vectors; j++) {                                          \
            Words yj = y[j], rj = r[j];                                                     \
            yj += load_words(x[0] + 32 * j);                                                \
            rj += yj;                                                                       \
            if ((T) > 1) {                                                                  \
                yj += load_words(x[1] + 32 * j);                                            \
                rj += yj;                                                                   \
            }                                                                               \
            if ((T) > 3) {                                                                  \
                yj += load_words(x[2] + 32 * j);                                            \
                rj += yj;                                                                   \
                yj += load_words(x[3] + 32 * j);                                            \
                rj += yj;                                                                   \
            }                                                                               \
            y[j] = yj;                                                                      \
            r[j] = rj;                                                                      \
        }                                                                                   \
    } while (0)

INLINE void add_tokens_4(Words *restrict y, Words *restrict r, const char *const *x,
                         Py_ssize_t vectors)
{
    ADD_TOKENS(4);
}

INLINE void add_tokens_2(Words *restrict y, Words *restrict r, const char *const *x,
                         Py_ssize_t vectors)
{
    ADD_TOKENS(2);
}

INLINE void add_tokens_1(Words *restrict y, Words *restrict r, const char *const *x,
                         Py_ssize_t vectors)
{
    ADD_TOKENS(1);
}

/* The tokens at x[0 .. tokens-1] (1 .. 4) into Y and R: `runs` runs of `vectors`
 * vectors, run k at byte offset k * run_step of each token, into y and r from
 * k * vectors. */
INLINE void add_tokens(Words *restrict y, Words *restrict r, const char **x, int tokens,
                       Py_ssize_t runs, Py_ssize_t run_step, Py_ssize_t vectors)
{
    const char *at[4];
    for (Py_ssize_t k = 0; k < runs; k++) {
        for (int t = 0; t < tokens; t++) at[t] = x[t] + k * run_step;
        Words *yk = y + k * vectors, *rk = r + k * vectors;
        if (tokens == 4)
            add_tokens_4(yk, rk, at, vectors);
        else if (tokens == 2)
            add_tokens_2(yk, rk, at, vectors);
        else
            add_tokens_1(yk, rk, at, vectors);
    }
}

/* The fast path of the row sum, for contiguous 8-byte pieces, a multiple of 4 a cell
 * (every KV cache of 16-bit or 8-bit values whose K and V rows are whole 32-byte words).
 * Like row_sum, tile by tile of heads and pieces, the tokens in order, each read once
 * where it lies and in memory order; but each piece's running sums are kept as R[h, p]
 * beside Y[h, p] (vectors in L1), so that the token loop takes no sum across pieces,
 * only two additions per 4 pieces and token, and Y and R are loaded and stored once per
 * 4 tokens. Where a token's heads of the tile lie one after the other (heads contiguous,
 * whole cells), the tile's heads are one run of vectors: no loop, and no cost, per cell.
 * Small cells (32 pieces at head size 64) then cost no more per byte than large ones. */
INLINE uint64_t row_sum_words(const Layout *v, const Rows *rows, const char *row,
                              uint64_t first, Py_ssize_t count, Words *y, Words *r)
{
    Py_ssize_t tile_pieces = v->pieces < TILE_VECTOR_WORDS ? v->pieces : TILE_VECTOR_WORDS;
    Py_ssize_t tile_heads = TILE_VECTOR_WORDS / tile_pieces;
    int whole_cells = tile_pieces == v->pieces && v->head_step == v->pieces * 8;
    const uint64_t span = first + (uint64_t)count;
    uint64_t sum = 0;
    for (Py_ssize_t h0 = 0; h0 < v->heads; h0 += tile_heads) {
        Py_ssize_t heads = v->heads - h0 < tile_heads ? v->heads - h0 : tile_heads;
        for (Py_ssize_t p0 = 0; p0 < v->pieces; p0 += tile_pieces) {
            Py_ssize_t n = v->pieces - p0 < tile_pieces ? v->pieces - p0 : tile_pieces;
            /* Runs of vectors per token: one of all heads, or one per head. */
            Py_ssize_t runs = whole_cells ? 1 : heads;
            Py_ssize_t vectors = (whole_cells ? heads * n : n) / 4;
            memset(y, 0, (size_t)(heads * n) * sizeof(uint64_t));
            memset(r, 0, (size_t)(heads * n) * sizeof(uint64_t));
            const char *tile = row + h0 * v->head_step + p0 * 8;
            Py_ssize_t left = count;
            for (const char *block = tile; left > 0; block += v->kernel_block_step) {
                Py_ssize_t tokens = left < v->tokens ? left : v->tokens;
                left -= tokens;
                for (Py_ssize_t u = 0; u < tokens;) {
                    int step = tokens - u >= 4 ? 4 : tokens - u >= 2 ? 2 : 1;
                    const char *x[4];
                    for (int t = 0; t < step; t++) x[t] = block + (u + t) * v->token_step;
                    add_tokens(y, r, x, step, runs, v->head_step, vectors);
                    u += step;
                }
            }
            for (Py_ssize_t h = 0; h < heads; h++) {
                const Words *yh = y + h * (n / 4), *rh = r + h * (n / 4);
                const char *weights =
                    (const char *)(rows->piece_weights + (h0 + h) * v->pieces + p0);
                Words weighted = {0}, pieces = {0}, running = {0};
                for (Py_ssize_t j = 0; j < n / 4; j++) {
                    weighted += yh[j] * load_words(weights + 32 * j);
                    pieces += yh[j];
                    running += rh[j];
                }
                uint64_t head_term = span * word_sum(pieces) - word_sum(running);
                sum += word_sum(weighted) + rows->head_weights[h0 + h] * head_term;
            }
        }
    }
    return sum;
}

/* Whether the fast path reads the view: contiguous 8-byte pieces, a multiple of 4. */
static int words_layout(const Layout *v)
{
    return v->itemsize == 8 && v->piece_step == 8 && v->pieces % 4 == 0;
}

/* Every row's sum into rows->sums; runs without the GIL. */
MULTIVERSIONED
static void all_row_sums(const Layout *v, const Rows *rows)
{
    uint64_t y[TILE_WORDS], running[TILE_WORDS];
    Words vy[TILE_VECTOR_WORDS / 4], vr[TILE_VECTOR_WORDS / 4];
    int words = words_layout(v);
    for (Py_ssize_t i = 0; i < rows->count; i++) {
        Py_ssize_t count = (Py_ssize_t)rows->valid_tokens[i];
        const char *row = v->data + (Py_ssize_t)rows->block_ids[i] * v->block_step;
        uint64_t first = (uint64_t)rows->first_tokens[i];
        if (count <= 0 || v->pieces <= 0 || v->heads <= 0)
            rows->sums[i] = 0;
        else if (words)
            rows->sums[i] = row_sum_words(v, rows, row, first, count, vy, vr);
        else
            rows->sums[i] = row_sum(v, rows, row, first, count, y, running);
    }
}

PyDoc_STRVAR(row_sums_doc,
             "row_sums(pieces, block_ids, first_tokens, valid_tokens, piece_weights, "
             "head_weights, sums)\n--\n\n"
             "Write into sums[i] the weighted sum (mod 2**64, as int64) of row "
             "block_ids[i] of the piece view pieces [blocks, kernel_blocks, heads, tokens, "
             "pieces] over its first valid_tokens[i] tokens, numbered from first_tokens[i]. "
             "The other arguments are contiguous 1-D int64 arrays: piece_weights "
             "[heads * pieces], head_weights [heads], sums (written) one per row.");

/* The call's rows, read from its checked buffers, through the loop. */
static void run_row_sums(const Layout *layout, const Py_buffer buffers[7])
{
    Rows rows = {
        .count = buffers[1].shape[0],
        .block_ids = buffers[1].buf,
        .first_tokens = buffers[2].buf,
        .valid_tokens = buffers[3].buf,
        .piece_weights = buffers[4].buf,
        .head_weights = buffers[5].buf,
        .sums = buffers[6].buf,
    };
    all_row_sums(layout, &rows);
}

static PyObject *row_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"block_ids",     "first_tokens", "valid_tokens",
                                        "piece_weights", "head_weights", "sums"};
    static const Py_ssize_t lengths[] = {PER_ROW,        PER_ROW,  PER_ROW,
                                         PER_HEAD_PIECE, PER_HEAD, PER_ROW};
    return call_loop("row_sums", args, nargs, names, lengths, run_row_sums);
}

LOOP_MODULE(_row_sums, row_sums, row_sums_doc,
            "The numpy backend's row sums in C (kvaudit/checksum/kernels/numpy_cpu.py).")
