/* The errors of one (head, token) row of values in one float type, and the batch loop:
 * included by _element_errors.c once per float type and vector width, with parameters
 * REAL (float or double), UINT (its bits), ABS (fabsf or fabs), MAGNITUDE (all bits but
 * the sign), DECODE_ROW (a side's row into REALs), VREAL and VBITS (vectors of REALs and of
 * signed integers of their size), PART and VSQUARES (vectors of as many REALs and doubles,
 * the squares widened), MAX_BITS(x, y) and MAX_REAL(x, y) (per lane x > y ? x : y),
 * WIDEN(a, at) (part `at` of a as VSQUARES), MAX_OF_BITS, MAX_OF_REAL and SUM_OF_BITS (of
 * a vector's lanes: non-negative bits, non-negative REALs, counts), FUSED (1: narrow rows decoded inside the
 * loop, BF16_VALUES(raw) giving a vector of bf16 values), TARGET (the loop's instruction
 * set attribute) and NAME(x) (each copy's own names); they are undefined at the end.
 *
 * Every operation is the numpy path's (kvaudit/numeric/value_errors.py) in the same type, so the
 * figures come out bit for bit the same; only the sums of squares are kept in double. */

#define WIDTH ((int)(sizeof(VREAL) / sizeof(REAL)))
#define SQUARES_WIDTH ((int)(sizeof(VSQUARES) / sizeof(double)))
#define PARTS (WIDTH / SQUARES_WIDTH)

/* A non-negative REAL as its bits: such floats order as their bits do, NaN above Inf. */
TARGET INLINE UINT NAME(bits_of)(REAL x)
{
    UINT u;
    memcpy(&u, &x, sizeof u);
    return u;
}

TARGET INLINE REAL NAME(from_bits)(UINT u)
{
    REAL x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Row errors: the largest |c - p| and |p| (NaN where a p is NaN), the largest
 * |c - p| / |p| (0 / 0 skipped, at least 0), with atol not 0 the largest
 * |c - p| / (atol + rtol |p|) (NaN skipped, at least 0; with atol 0 it is rel / rtol,
 * taken in add_errors), the elements over tolerance and with a NaN or Inf on one side
 * only, the sum of the squared errors, whether a value was one-sided. */
typedef struct {
    REAL abs, scale, rel, ratio;
    int64_t over, nonfinite;
    double squares;
    int one_sided;
} NAME(Row);

/* The tolerance in REAL: numpy rounds the Python floats to the array's type. by_ratio:
 * with atol 0, "over" is |c - p| / |p| > rtol, as the numpy path tests it. */
typedef struct {
    REAL atol, rtol;
    int by_ratio;
} NAME(Tolerance);

/* WIDTH accumulators each, in vectors. Lane j takes elements j, j + WIDTH, ... of a row,
 * and the lanes are summed in order: the results do not depend on the vectors' width
 * beyond the sums of squares' rounding. Magnitudes' bits are compared as
 * signed integers: with the sign bit clear, they order as the floats do, NaN above Inf. */
typedef struct {
    VBITS abs, scale, over; /* over: minus the count (a true comparison is -1) */
    VREAL rel, ratio; /* ratio: |c - p| / (atol + rtol |p|), where atol is not 0 */
    VSQUARES squares[PARTS]; /* lanes in order */
} NAME(Lanes);

/* WIDTH elements (p, c) into the lanes; counted: the lanes that hold elements of the row. */
TARGET INLINE void NAME(lane_step)(NAME(Lanes) *l, VREAL p, VREAL c,
                                   const NAME(Tolerance) *tol, int by_ratio, VBITS counted)
{
    VBITS a_bits = (VBITS)(c - p) & MAGNITUDE, scale_bits = (VBITS)p & MAGNITUDE;
    VREAL a = (VREAL)a_bits, scale = (VREAL)scale_bits, rel = a / scale;
    VBITS over;
    if (by_ratio) {
        over = rel > tol->rtol;
    } else {
        VREAL bound = scale * tol->rtol + tol->atol;
        over = a > bound;
        /* bound > 0 (atol > 0): a NaN only where p is (a row taken exactly then). */
        l->ratio = MAX_REAL(a / bound, l->ratio);
    }
    l->over += over & counted;
    l->abs = MAX_BITS(a_bits, l->abs);
    l->scale = MAX_BITS(scale_bits, l->scale);
    /* NaN (0 / 0: both 0) compares false: it never enters. */
    l->rel = MAX_REAL(rel, l->rel);
    /* Widened part by part: as many doubles as a register holds. */
    for (int at = 0; at < PARTS; at++) {
        VSQUARES wide = WIDEN(a, at);
        l->squares[at] += wide * wide;
    }
}

/* The lanes over a row (zero-padded to whole vectors); by_ratio a constant where
 * inlined, so that the loop holds no branch. */
TARGET INLINE void NAME(lanes_over)(NAME(Lanes) *l, const REAL *p, const REAL *c, Py_ssize_t n,
                             const NAME(Tolerance) *tol, int by_ratio)
{
    VBITS counted = {0}, lane = {0};
    counted -= 1; /* all lanes */
    for (int j = 0; j < WIDTH; j++)
        lane[j] = j;
    Py_ssize_t i = 0;
    VREAL p_at, c_at;
    for (; i + WIDTH <= n; i += WIDTH) {
        memcpy(&p_at, p + i, sizeof p_at);
        memcpy(&c_at, c + i, sizeof c_at);
        NAME(lane_step)(l, p_at, c_at, tol, by_ratio, counted);
    }
    if (i < n) { /* padding (0 against 0) adds nothing but could be "over" a negative atol */
        memcpy(&p_at, p + i, sizeof p_at);
        memcpy(&c_at, c + i, sizeof c_at);
        NAME(lane_step)(l, p_at, c_at, tol, by_ratio, lane < (int)(n - i));
    }
}

/* Lanes all zero. */
TARGET INLINE void NAME(lanes_clear)(NAME(Lanes) *l)
{
    VBITS none = {0};
    VREAL zero = {0};
    VSQUARES zeros = {0};
    l->abs = l->scale = l->over = none;
    l->rel = l->ratio = zero;
    for (int at = 0; at < PARTS; at++)
        l->squares[at] = zeros;
}

/* The largest of a vector's lanes, and the sum of its lanes: portable forms. */
TARGET INLINE UINT NAME(max_of_bits)(VBITS v)
{
    UINT most = 0;
    for (int j = 0; j < WIDTH; j++)
        most = (UINT)v[j] > most ? (UINT)v[j] : most;
    return most;
}

TARGET INLINE REAL NAME(max_of_real)(VREAL v)
{
    REAL most = 0;
    for (int j = 0; j < WIDTH; j++)
        most = v[j] > most ? v[j] : most;
    return most;
}

TARGET INLINE int64_t NAME(sum_of_bits)(VBITS v)
{
    int64_t sum = 0;
    for (int j = 0; j < WIDTH; j++)
        sum += (int64_t)v[j];
    return sum;
}

/* The row's errors from its lanes (maxima and counts in any order, the squares summed in
 * lane order): 0 (and *row undefined) where
 * they are not all finite (NaN or Inf on a side, or c - p overflowing). */
TARGET INLINE int NAME(row_of_lanes)(const NAME(Lanes) *l, NAME(Row) *row)
{
    row->abs = NAME(from_bits)((UINT)MAX_OF_BITS(l->abs));
    if (!isfinite(row->abs))
        return 0;
    row->scale = NAME(from_bits)((UINT)MAX_OF_BITS(l->scale));
    row->rel = MAX_OF_REAL(l->rel);
    row->ratio = MAX_OF_REAL(l->ratio);
    row->over = -(int64_t)SUM_OF_BITS(l->over);
    /* The squares in lane order (0 + x is x: they are not negative). */
    row->squares = l->squares[0][0];
    for (int j = 1; j < WIDTH; j++)
        row->squares += l->squares[j / SQUARES_WIDTH][j % SQUARES_WIDTH];
    row->nonfinite = 0;
    row->one_sided = 0;
    return 1;
}

/* The row where every error is finite (so both sides are): returns 0, leaving *row
 * undefined, where one is not (NaN or Inf on a side, or c - p overflowing). */
TARGET INLINE int NAME(row_fast)(const REAL *p, const REAL *c, Py_ssize_t n,
                          const NAME(Tolerance) *tol, NAME(Row) *row)
{
    NAME(Lanes) l;
    NAME(lanes_clear)(&l);
    if (tol->by_ratio)
        NAME(lanes_over)(&l, p, c, n, tol, 1);
    else
        NAME(lanes_over)(&l, p, c, n, tol, 0);
    return NAME(row_of_lanes)(&l, row);
}

/* The row element by element with NaN and Inf (docs/numeric.md): NaN against NaN and an
 * Inf against the same Inf agree (error 0); any other non-finite error is infinite, and a
 * one-sided one (NaN or Inf on one side only) is also counted, over tolerance, out of the
 * squares, and makes the row's relative error infinite. */
TARGET static void NAME(row_exact)(const REAL *p, const REAL *c, Py_ssize_t n,
                            const NAME(Tolerance) *tol, NAME(Row) *row)
{
    UINT scale = 0;
    memset(row, 0, sizeof *row);
    for (Py_ssize_t i = 0; i < n; i++) {
        REAL a = ABS(c[i] - p[i]), magnitude = ABS(p[i]);
        int one_sided = 0;
        if (!isfinite(a)) {
            int p_nan = isnan(p[i]) != 0, c_nan = isnan(c[i]) != 0;
            if ((p_nan && c_nan) || p[i] == c[i]) {
                a = 0;
            } else {
                a = (REAL)INFINITY;
                /* An Inf agrees only with the same Inf: against a number, a NaN or the
                 * opposite Inf it is an Inf on one side only. */
                one_sided = p_nan != c_nan || isinf(p[i]) || isinf(c[i]);
            }
        }
        REAL rel = a / magnitude;
        int over;
        if (tol->by_ratio) {
            over = rel > tol->rtol;
        } else {
            REAL bound = magnitude * tol->rtol + tol->atol, ratio = a / bound;
            over = a > bound;
            row->ratio = ratio > row->ratio ? ratio : row->ratio; /* NaN never enters */
        }
        /* A NaN has no magnitude: the largest |p| is over the other values. */
        UINT magnitude_bits = isnan(magnitude) ? 0 : NAME(bits_of)(magnitude);
        row->abs = a > row->abs ? a : row->abs;
        scale = magnitude_bits > scale ? magnitude_bits : scale;
        row->rel = rel > row->rel ? rel : row->rel;
        row->over += one_sided || over;
        if (one_sided) {
            row->nonfinite++;
            row->one_sided = 1;
        } else {
            row->squares += (double)a * (double)a;
        }
    }
    row->scale = NAME(from_bits)(scale);
    if (row->one_sided)
        row->rel = row->ratio = (REAL)INFINITY;
}

/* Per-head figures of one batch, filled row by row. */
typedef struct {
    REAL abs, rel, ratio;
    UINT scale;
    int64_t tokens, over, nonfinite;
    double squares;
} NAME(Head);

/* Add one row's errors to its head, its token's scaled error max |c - p| / max |p| in
 * REAL (0 / 0 is 0; infinite where one-sided; the layers x tokens picture), its token's
 * tolerance ratio where asked (token_ratio) and its head's worst positions. The row's
 * tolerance ratio is its largest |c - p| / (atol + rtol |p|), or with atol 0 its largest
 * relative error over rtol (in REAL; 0 / 0 is 0): above 1 exactly where an element is over
 * the tolerance, but for rounding at the border. */
TARGET INLINE void NAME(add_errors)(const Batch *b, NAME(Head) *head, Py_ssize_t h, Py_ssize_t t,
                             const NAME(Row) *row)
{
    UINT scale_bits = NAME(bits_of)(row->scale);
    head->abs = row->abs > head->abs ? row->abs : head->abs;
    head->rel = row->rel > head->rel ? row->rel : head->rel;
    REAL over = b->atol == 0 ? row->rel / (REAL)b->rtol : row->ratio;
    over = isnan(over) ? 0 : over;
    head->ratio = over > head->ratio ? over : head->ratio;
    head->scale = scale_bits > head->scale ? scale_bits : head->scale;
    head->tokens++;
    head->over += row->over;
    head->nonfinite += row->nonfinite;
    head->squares += row->squares;
    REAL ratio = row->abs / row->scale;
    double scaled = row->one_sided ? INFINITY : isnan(ratio) ? 0.0 : (double)ratio;
    double *slot = b->token_row + (b->by_head ? h * b->tokens + t : t);
    if (scaled > *slot)
        *slot = scaled;
    if (b->token_ratio != NULL) {
        double *ratio_slot = b->token_ratio + (b->by_head ? h * b->tokens + t : t);
        if ((double)over > *ratio_slot)
            *ratio_slot = (double)over;
    }
    keep_worst(b->worst_error + h * WORST, b->worst_position + h * WORST, (double)row->abs,
               b->lo + t);
}

/* One held row (h, t) decoded into p_row and c_row (scratch: a narrow side on its way to
 * double), its errors added. */
TARGET INLINE void NAME(add_held)(const Batch *b, NAME(Head) *head, Py_ssize_t h, Py_ssize_t t,
                           REAL *p_row, REAL *c_row, float *scratch,
                           const NAME(Tolerance) *tol)
{
    Py_ssize_t at = h * b->tokens + t;
    DECODE_ROW(&b->sides[0], at, b, p_row, scratch);
    DECODE_ROW(&b->sides[1], at, b, c_row, scratch);
    NAME(Row) row;
    if (!NAME(row_fast)(p_row, c_row, b->elements, tol, &row))
        NAME(row_exact)(p_row, c_row, b->elements, tol, &row);
    NAME(add_errors)(b, head, h, t, &row);
}

#if FUSED
#include "_element_errors_fused.h"
#endif

/* The batch's held rows, chunk by chunk (compare_batch); spans: where count > 0, each
 * row decoded inside the loop (kind and by_ratio: constants where inlined), else into
 * p_row and c_row first. */
TARGET INLINE void NAME(batch_rows)(const Batch *b, NAME(Head) *heads_at, REAL *p_row, REAL *c_row,
                             float *scratch, const NAME(Tolerance) *tol, const Span *spans,
                             int count, int kind, int by_ratio, int scaled)
{
    Py_ssize_t heads = b->heads, tokens = b->tokens;
    Py_ssize_t chunk = b->chunk > 0 ? b->chunk : tokens;
    for (Py_ssize_t first = 0; first < tokens; first += chunk) {
        Py_ssize_t end = first + chunk < tokens ? first + chunk : tokens;
        int heads_inner = b->heads_inner;
        Py_ssize_t outer = heads_inner ? end - first : heads;
        Py_ssize_t inner = heads_inner ? heads : end - first;
        /* Several requests' heads (by_head), head by head: their rows lie in as many
         * places as requests, so each head's are marked read (and the budget checked)
         * after it, not the whole chunk's at once. */
        int mark_heads = b->release && b->by_head && !heads_inner;
        for (Py_ssize_t o = 0; o < outer; o++) {
            for (Py_ssize_t i = 0; i < inner; i++) {
                Py_ssize_t h = heads_inner ? i : o, t = first + (heads_inner ? o : i);
                if (!b->held[h * tokens + t])
                    continue;
#if FUSED
                NAME(Row) row;
                if (count > 0) {
                    if (!NAME(row_in_loop)(b, h * tokens + t, spans, count, kind, tol, by_ratio,
                                           scaled, &row)) {
                        DECODE_ROW(&b->sides[0], h * tokens + t, b, p_row, scratch);
                        DECODE_ROW(&b->sides[1], h * tokens + t, b, c_row, scratch);
                        NAME(row_exact)(p_row, c_row, b->elements, tol, &row);
                    }
                    NAME(add_errors)(b, &heads_at[h], h, t, &row);
                    continue;
                }
#endif
                NAME(add_held)(b, &heads_at[h], h, t, p_row, c_row, scratch, tol);
            }
            if (mark_heads)
                mark_rows_read(b, o, o + 1, first, end);
        }
        if (b->release && !mark_heads)
            mark_rows_read(b, 0, heads, first, end);
    }
}

/* batch_rows with rows decoded in the loop, by_ratio and scaled made constants. */
TARGET INLINE void NAME(rows_of_kind)(const Batch *b, NAME(Head) *heads_at, REAL *p_row,
                                      REAL *c_row, float *scratch, const NAME(Tolerance) *tol,
                                      const Span *spans, int count, int kind, int scaled)
{
    if (tol->by_ratio && scaled)
        NAME(batch_rows)(b, heads_at, p_row, c_row, scratch, tol, spans, count, kind, 1, 1);
    else if (tol->by_ratio)
        NAME(batch_rows)(b, heads_at, p_row, c_row, scratch, tol, spans, count, kind, 1, 0);
    else if (scaled)
        NAME(batch_rows)(b, heads_at, p_row, c_row, scratch, tol, spans, count, kind, 0, 1);
    else
        NAME(batch_rows)(b, heads_at, p_row, c_row, scratch, tol, spans, count, kind, 0, 0);
}

/* One layer's batch: every held row added to its head (heads_at: zeroed room for the
 * heads' figures), each head then added to the layer's. The rows go chunk by chunk of
 * tokens, head by head within a chunk: staged rows in one chunk ([heads, tokens] is their
 * order in memory), rows read in place a block of tokens at a time (its rows stay in the
 * core's cache while every head is read from them; their regions are marked read after
 * it, and released on the budget where asked). Either way each head sees its tokens in
 * increasing order: the figures are the same bits. Rows of whole vectors of one narrow kind
 * are decoded inside the reducing loop. */
TARGET static void NAME(compare_batch)(const Batch *b, NAME(Head) *heads_at, REAL *p_row,
                                       REAL *c_row, float *scratch)
{
    NAME(Tolerance) tol = {(REAL)b->atol, (REAL)b->rtol, b->atol == 0};
    Py_ssize_t heads = b->heads, tokens = b->tokens;
    Py_ssize_t cells = (b->by_head ? heads : 1) * tokens;
    for (Py_ssize_t t = 0; t < cells; t++)
        b->token_row[t] = -1.0; /* below any scaled error: no head held yet */
    if (b->token_ratio != NULL)
        for (Py_ssize_t t = 0; t < cells; t++)
            b->token_ratio[t] = -1.0;
    Span spans[MAX_SPANS];
    int count = FUSED ? row_spans(b, spans) : 0;
    int kind = b->sides[0].kind, scaled = count > 0 && spans_scaled(spans, count);
    if (count == 0)
        NAME(batch_rows)(b, heads_at, p_row, c_row, scratch, &tol, spans, 0, 0, 0, 0);
    else if (kind == BF16)
        NAME(rows_of_kind)(b, heads_at, p_row, c_row, scratch, &tol, spans, count, BF16, scaled);
    else if (kind == F16)
        NAME(rows_of_kind)(b, heads_at, p_row, c_row, scratch, &tol, spans, count, F16, scaled);
    else /* fp8: the kind picks a table of values; mostly scaled */
        NAME(rows_of_kind)(b, heads_at, p_row, c_row, scratch, &tol, spans, count, kind, 1);
    for (Py_ssize_t h = 0; h < heads; h++) {
        const NAME(Head) *head = &heads_at[h];
        REAL scale = NAME(from_bits)(head->scale);
        add_head(b, h, (double)head->abs, (double)head->rel, isnan(scale) ? 0.0 : (double)scale,
                 head->squares);
        b->counts[h] += head->tokens;
        b->counts[heads + h] += head->over;
        b->counts[2 * heads + h] += head->nonfinite;
        if (b->head_ratio != NULL && (double)head->ratio > b->head_ratio[h])
            b->head_ratio[h] = (double)head->ratio;
    }
    for (Py_ssize_t t = 0; t < cells; t++)
        if (b->token_row[t] < 0)
            b->token_row[t] = NAN;
    if (b->token_ratio != NULL)
        for (Py_ssize_t t = 0; t < cells; t++)
            if (b->token_ratio[t] < 0)
                b->token_ratio[t] = NAN;
}

_Static_assert(sizeof(NAME(Head)) <= HEAD_BYTES, "HEAD_BYTES holds a head's figures");

#undef WIDTH
#undef SQUARES_WIDTH
#undef PARTS
#undef REAL
#undef UINT
#undef ABS
#undef MAGNITUDE
#undef DECODE_ROW
#undef VREAL
#undef VBITS
#undef PART
#undef VSQUARES
#undef TARGET
#undef FUSED
#undef MAX_BITS
#undef MAX_REAL
#undef WIDEN
#undef MAX_OF_BITS
#undef MAX_OF_REAL
#undef SUM_OF_BITS
#undef PART_OF
#undef BF16_VALUES
#undef NAME
