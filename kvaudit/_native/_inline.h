/* INLINE: a helper forced inline into each build of the loop that calls it (a loop built
 * for several CPUs, multiversioned or AVX2 beside portable, would otherwise call an
 * outlined helper of the baseline build only). */

#ifndef KVAUDIT_INLINE_H
#define KVAUDIT_INLINE_H

#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#endif
