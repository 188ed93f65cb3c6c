/* Rows decoded inside the reducing loop, for _element_errors_row.h (included by it where
 * FUSED, once per float copy, with its parameters): both sides of one narrow kind, the
 * row in spans of whole vectors (row_spans), each vector's values taken straight from
 * the bits, so that no row buffer is written and read again. */

/* WIDTH elements of a narrow kind from their bits (a constant where inlined). */
TARGET INLINE VREAL NAME(values)(int kind, const uint8_t *raw)
{
    VREAL out;
    if (kind == BF16) { /* the high half of a float32 */
        out = BF16_VALUES(raw);
    } else if (kind == F16) {
        for (int q = 0; q < WIDTH / 4; q++) {
            f32x4 four = f16_values(raw + 8 * q);
            memcpy((char *)&out + sizeof four * q, &four, sizeof four);
        }
    } else {
        const float *table = FP8_VALUES[kind == E5M2];
        for (int j = 0; j < WIDTH; j++)
            out[j] = table[raw[j]];
    }
    return out;
}

/* Row `at` decoded inside the loop, span by span (both sides of one narrow kind): as
 * row_fast, 0 where an error is not finite. kind and by_ratio: constants where inlined. */
TARGET INLINE int NAME(row_in_loop)(const Batch *b, Py_ssize_t at, const Span *spans, int count,
                             int kind, const NAME(Tolerance) *tol, int by_ratio, int scaled,
                             NAME(Row) *row)
{
    const uint8_t *parts[2][MAX_PARTS];
    for (int s = 0; s < 2; s++)
        for (int e = 0; e < row_parts(&b->sides[s]); e++) {
            Py_ssize_t start, width;
            parts[s][e] = row_part(&b->sides[s], at, b, e, &start, &width);
        }
    NAME(Lanes) l;
    NAME(lanes_clear)(&l);
    VBITS counted = {0};
    counted -= 1; /* all lanes: spans are whole vectors */
    Py_ssize_t size = KIND_SIZES[kind];
    for (int k = 0; k < count; k++) {
        const Span *span = &spans[k];
        const uint8_t *p = parts[0][span->part[0]] + span->offset[0];
        const uint8_t *c = parts[1][span->part[1]] + span->offset[1];
        REAL p_scale = span->scale[0], c_scale = span->scale[1];
#pragma GCC unroll 2
        for (Py_ssize_t i = 0; i < span->count; i += WIDTH) {
            VREAL p_values = NAME(values)(kind, p + i * size);
            VREAL c_values = NAME(values)(kind, c + i * size);
            if (scaled) {
                p_values *= p_scale;
                c_values *= c_scale;
            }
            NAME(lane_step)(&l, p_values, c_values, tol, by_ratio, counted);
        }
    }
    return NAME(row_of_lanes)(&l, row);
}
