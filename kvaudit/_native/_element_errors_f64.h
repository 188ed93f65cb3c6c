/* The row loop's double copy for _element_errors_copies.h, included once per vector
 * width: F64_LANES (2: the portable copy, 4: the AVX2 one) and F64_TARGET (its instruction
 * set attribute). Doubles take the generic vector operations at both widths; the copies
 * differ only in their vectors and names. Both parameters are undefined at the end. */

#define REAL double
#define UINT uint64_t
#define ABS fabs
#define MAGNITUDE 0x7fffffffffffffff
#define DECODE_ROW decode_row_f64
#if F64_LANES == 2
#define VREAL f64x2
#define VBITS i64x2
#define NAME(x) x##_f64
#else
#define VREAL f64x4
#define VBITS i64x4
#define NAME(x) x##_f64_avx2
#endif
#define PART VREAL
#define VSQUARES VREAL
#define TARGET F64_TARGET
#define MAX_BITS GENERIC_MAX_BITS
#define MAX_REAL GENERIC_MAX_REAL
#define WIDEN GENERIC_WIDEN
#define MAX_OF_BITS NAME(max_of_bits)
#define MAX_OF_REAL NAME(max_of_real)
#define SUM_OF_BITS NAME(sum_of_bits)
#define PART_OF(v, at) (v)
#define FUSED 0
#include "_element_errors_row.h"

#undef F64_LANES
#undef F64_TARGET
