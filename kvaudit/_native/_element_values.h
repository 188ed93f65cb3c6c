/* The values of a row's elements from their bits, staged or where they lie in a mapping,
 * for _element_errors.c (included once, after Side and Batch): bf16 shifted into a
 * float32, fp16 converted (four at a time), fp8 through a table of the 256 codes' exact
 * values; each side times its K and V scales in the type the numpy path scales in
 * (float32 for 16-bit and 8-bit dtypes, float64 for 32-bit and wider). */

static float FP8_VALUES[2][256]; /* e4m3fn, e5m2: each code's value */

INLINE float f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

INLINE uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* An fp8 code's value with IEEE-like subnormals; has_inf: the all-ones exponent holds
 * Inf and NaN (e5m2), else only the all-ones code of each sign is NaN (e4m3fn). */
static float fp8_value(unsigned code, int exponent_bits, int mantissa_bits, int has_inf)
{
    unsigned top = (1u << exponent_bits) - 1, ones = (1u << mantissa_bits) - 1;
    unsigned exponent = (code >> mantissa_bits) & top, mantissa = code & ones;
    int bias = (1 << (exponent_bits - 1)) - 1;
    float value;
    if (exponent == top && (has_inf || mantissa == ones))
        value = (has_inf && mantissa == 0) ? INFINITY : NAN;
    else if (exponent == 0)
        value = ldexpf((float)mantissa, 1 - bias - mantissa_bits);
    else
        value = ldexpf((float)(mantissa | (ones + 1)), (int)exponent - bias - mantissa_bits);
    return (code & 0x80) ? -value : value;
}

/* An fp16's value, branch-free so that the loop vectorizes. */
INLINE float f16_value(uint16_t half)
{
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16, rest = half & 0x7fffu;
    uint32_t normal = (rest << 13) + ((127u - 15u) << 23); /* the exponent rebiased */
    uint32_t special = (rest << 13) | 0x7f800000u;         /* Inf, NaN with its payload */
    float subnormal = (float)(int32_t)rest * 0x1p-24f;      /* exact: rest < 2^10 */
    uint32_t bits = rest >= 0x7c00u ? special : rest >= 0x0400u ? normal : f32_bits(subnormal);
    return f32_from_bits(sign | bits);
}

/* Four fp16s' values at once: f16_value's steps on vectors. */
INLINE f32x4 f16_values(const uint8_t *raw)
{
    u16x4 halves;
    memcpy(&halves, raw, sizeof halves);
    u32x4 wide = __builtin_convertvector(halves, u32x4);
    u32x4 sign = (wide & 0x8000u) << 16, rest = wide & 0x7fffu;
    u32x4 normal = (rest << 13) + ((127u - 15u) << 23);
    u32x4 special = (rest << 13) | 0x7f800000u;
    f32x4 subnormal = __builtin_convertvector((i32x4)rest, f32x4) * 0x1p-24f;
    u32x4 is_special = (u32x4)((i32x4)rest >= 0x7c00), is_normal = (u32x4)((i32x4)rest >= 0x0400);
    u32x4 finite = SELECT(is_normal, normal, (u32x4)subnormal);
    return (f32x4)(sign | SELECT(is_special, special, finite));
}

INLINE uint16_t load16(const uint8_t *at)
{
    uint16_t u;
    memcpy(&u, at, sizeof u);
    return u;
}

/* Four bf16s' or fp16s' bits. */
INLINE u16x4 load_u16x4(const uint8_t *at)
{
    u16x4 u;
    memcpy(&u, at, sizeof u);
    return u;
}

/* A part of a side's row: the bits of its elements (staged, or where they lie in a
 * mapping), and through *start and *count which elements of the row they are. */
INLINE const uint8_t *row_part(const Side *side, Py_ssize_t row, const Batch *b, int part,
                               Py_ssize_t *start, Py_ssize_t *count)
{
    if (side->bits != NULL) {
        *start = 0;
        *count = b->elements;
        return side->bits + row * b->elements * KIND_SIZES[side->kind];
    }
    const int64_t *at = side->where + 2 * (part * b->heads * b->tokens + row);
    *start = side->part_start[part];
    *count = side->part_width[part];
    return b->maps->bases[at[0]] + at[1];
}

/* How many parts each of a side's rows is read in. */
INLINE int row_parts(const Side *side) { return side->bits != NULL ? 1 : side->parts; }

/* n elements of a narrow kind as float. */
INLINE void decode_narrow_span(int kind, const uint8_t *raw, Py_ssize_t n, float *out)
{
    switch (kind) {
    case BF16: /* the high half of a float32 */
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = f32_from_bits((uint32_t)load16(raw + 2 * i) << 16);
        break;
    case F16: {
        Py_ssize_t i = 0;
        for (; i + 4 <= n; i += 4) {
            f32x4 values = f16_values(raw + 2 * i);
            memcpy(out + i, &values, sizeof values);
        }
        for (; i < n; i++)
            out[i] = f16_value(load16(raw + 2 * i));
        break;
    }
    default: {
        const float *table = FP8_VALUES[kind == E5M2];
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = table[raw[i]];
    }
    }
}

/* A narrow side's row as float, times the side's scales in float (as numpy scales a
 * float32 buffer). */
INLINE void decode_narrow(const Side *side, Py_ssize_t row, const Batch *b, float *out)
{
    Py_ssize_t n = b->elements;
    for (int part = 0; part < row_parts(side); part++) {
        Py_ssize_t start, count;
        const uint8_t *raw = row_part(side, row, b, part, &start, &count);
        decode_narrow_span(side->kind, raw, count, out + start);
    }
    float k_scale = (float)side->scales[0], v_scale = (float)side->scales[1];
    if (side->scales[0] != 1.0)
        for (Py_ssize_t i = 0; i < side->head_size; i++)
            out[i] *= k_scale;
    if (side->scales[1] != 1.0)
        for (Py_ssize_t i = side->head_size; i < n; i++)
            out[i] *= v_scale;
}

/* A side's row as float: only narrow sides are compared in float. */
INLINE void decode_row_f32(const Side *side, Py_ssize_t row, const Batch *b, float *out,
                           float *scratch)
{
    (void)scratch;
    decode_narrow(side, row, b, out);
}

/* A side's row as double: a narrow side decoded and scaled as float first, then widened
 * (numpy widens the float32 buffer); a wide side read and scaled in double. */
INLINE void decode_row_f64(const Side *side, Py_ssize_t row, const Batch *b, double *out,
                           float *scratch)
{
    Py_ssize_t n = b->elements;
    if (!is_wide(side->kind)) {
        decode_narrow(side, row, b, scratch);
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (double)scratch[i];
        return;
    }
    for (int part = 0; part < row_parts(side); part++) {
        Py_ssize_t start, count;
        const uint8_t *raw = row_part(side, row, b, part, &start, &count);
        if (side->kind == F32) {
            for (Py_ssize_t i = 0; i < count; i++) {
                float value;
                memcpy(&value, raw + 4 * i, sizeof value);
                out[start + i] = (double)value;
            }
        } else {
            memcpy(out + start, raw, (size_t)count * sizeof(double));
        }
    }
    if (side->scales[0] != 1.0)
        for (Py_ssize_t i = 0; i < side->head_size; i++)
            out[i] *= side->scales[0];
    if (side->scales[1] != 1.0)
        for (Py_ssize_t i = side->head_size; i < n; i++)
            out[i] *= side->scales[1];
}

/* A stretch of a row's elements that lies in one part of each side and under one scale
 * of each: rows whose stretches are whole vectors are decoded inside the reducing loop
 * (no row buffer). offset: its first element's byte in each side's part. */
typedef struct {
    Py_ssize_t start, count;
    int part[2];
    Py_ssize_t offset[2];
    float scale[2];
} Span;

#define MAX_SPANS (2 * MAX_PARTS + 4)

/* The first part of a side holding element i. */
static int part_of(const Side *side, Py_ssize_t i)
{
    int part = 0;
    while (part + 1 < row_parts(side) && side->part_start[part + 1] <= i)
        part++;
    return part;
}

/* A row's spans, in order, into spans; their count, or 0 where the row cannot be decoded
 * in the loop: the sides of different or wide kinds, or a span not whole vectors of LANES
 * (every span then starts at a multiple of LANES, so each element keeps its lane). */
static int row_spans(const Batch *b, Span *spans)
{
    const Side *sides = b->sides;
    Py_ssize_t n = b->elements, cuts[MAX_SPANS + 1];
    int count = 0;
    if (sides[0].kind != sides[1].kind || is_wide(sides[0].kind) || n <= 0)
        return 0;
    cuts[count++] = 0;
    for (int s = 0; s < 2; s++) {
        for (int e = 1; e < row_parts(&sides[s]); e++)
            cuts[count++] = sides[s].part_start[e];
        if (sides[s].head_size > 0 && sides[s].head_size < n)
            cuts[count++] = sides[s].head_size;
    }
    cuts[count++] = n;
    for (int i = 1; i < count; i++) /* insertion sort: a dozen cuts at most */
        for (int j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
            Py_ssize_t cut = cuts[j];
            cuts[j] = cuts[j - 1];
            cuts[j - 1] = cut;
        }
    int made = 0;
    for (int i = 0; i + 1 < count; i++) {
        Py_ssize_t start = cuts[i], length = cuts[i + 1] - start;
        if (length == 0)
            continue;
        if (start % LANES != 0 || length % LANES != 0)
            return 0;
        Span *span = &spans[made++];
        span->start = start;
        span->count = length;
        for (int s = 0; s < 2; s++) {
            const Side *side = &sides[s];
            int part = part_of(side, start);
            Py_ssize_t first = side->bits != NULL ? 0 : side->part_start[part];
            span->part[s] = part;
            span->offset[s] = (start - first) * KIND_SIZES[side->kind];
            /* Times 1 changes no finite value: rows with a NaN or Inf are decoded again. */
            span->scale[s] = (float)side->scales[start >= side->head_size];
        }
    }
    return made;
}

/* Whether a span scales a side (by other than 1). */
static int spans_scaled(const Span *spans, int count)
{
    for (int k = 0; k < count; k++)
        if (spans[k].scale[0] != 1.0f || spans[k].scale[1] != 1.0f)
            return 1;
    return 0;
}
