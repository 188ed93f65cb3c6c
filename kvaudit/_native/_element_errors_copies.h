/* The row loop's copies for _element_errors.c (included once, after Batch and the value
 * decoding): _element_errors_row.h once per float type and vector width, with its
 * parameters; the AVX2 copies with intrinsics where GNU vectors compile into more
 * instructions. */

/* The row errors and the batch loop, once per float type and vector width (the header
 * undefines its parameters). */
#define REAL float
#define UINT uint32_t
#define ABS fabsf
#define MAGNITUDE 0x7fffffff
#define DECODE_ROW decode_row_f32
#define VREAL f32x4
#define VBITS i32x4
#define PART f32x2
#define VSQUARES f64x2
#define TARGET
#define MAX_BITS GENERIC_MAX_BITS
#define MAX_REAL GENERIC_MAX_REAL
#define WIDEN GENERIC_WIDEN
#define MAX_OF_BITS NAME(max_of_bits)
#define MAX_OF_REAL NAME(max_of_real)
#define SUM_OF_BITS NAME(sum_of_bits)
#define PART_OF(v, at) \
    ((at) == 0 ? __builtin_shufflevector(v, v, 0, 1) : __builtin_shufflevector(v, v, 2, 3))
#define FUSED 1
#define BF16_VALUES(raw) ((VREAL)(__builtin_convertvector(load_u16x4(raw), u32x4) << 16))
#define NAME(x) x##_f32
#include "_element_errors_row.h"

#define F64_LANES 2
#define F64_TARGET
#include "_element_errors_f64.h"

#if WITH_AVX2
/* The largest of eight non-negative int32s, of eight floats none of them NaN (at least 0),
 * and the sum of eight int32s: halves folded. */
AVX2 INLINE int32_t max_of_i32x8(i32x8 v)
{
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128((__m256i)v),
                              _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return _mm_cvtsi128_si32(m);
}

AVX2 INLINE float max_of_f32x8(f32x8 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x55));
    return _mm_cvtss_f32(m);
}

AVX2 INLINE int64_t sum_of_i32x8(i32x8 v)
{
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128((__m256i)v),
                              _mm256_extracti128_si256((__m256i)v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return _mm_cvtsi128_si32(m);
}

#define REAL float
#define UINT uint32_t
#define ABS fabsf
#define MAGNITUDE 0x7fffffff
#define DECODE_ROW decode_row_f32
#define VREAL f32x8
#define VBITS i32x8
#define PART f32x4
#define VSQUARES f64x4
#define TARGET AVX2
/* Intrinsics where GNU vectors compile into more instructions: max (the bits of
 * magnitudes are non-negative), widening, bf16 loads. maxps returns its second operand
 * unless the first is greater (NaN: never). */
#define MAX_BITS(x, y) ((VBITS)_mm256_max_epi32((__m256i)(x), (__m256i)(y)))
#define MAX_REAL(x, y) ((VREAL)_mm256_max_ps((__m256)(x), (__m256)(y)))
#define WIDEN(a, at)                                                                      \
    ((VSQUARES)_mm256_cvtps_pd((at) == 0 ? _mm256_castps256_ps128((__m256)(a))            \
                                         : _mm256_extractf128_ps((__m256)(a), 1)))
#define MAX_OF_BITS max_of_i32x8
#define MAX_OF_REAL max_of_f32x8
#define SUM_OF_BITS sum_of_i32x8
#define FUSED 1
#define BF16_VALUES(raw)                                                                  \
    ((VREAL)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(raw))), 16))
#define NAME(x) x##_f32_avx2
#include "_element_errors_row.h"

#define F64_LANES 4
#define F64_TARGET AVX2
#include "_element_errors_f64.h"
#endif
