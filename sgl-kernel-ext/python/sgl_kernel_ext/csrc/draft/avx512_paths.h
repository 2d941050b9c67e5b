// Draft-decode attention: the AVX-512 paths (kvquant rows a segment at a time, the key-score paths of
// kvquant, rotatekv and kivi) or, built without AVX-512, stand-ins that say they never apply.
#pragma once

#include "kvquant_rows.h"

#ifdef DRAFT_AVX512
#include "kvquant_segments.h"
#include "kvquant_scores.h"
#include "value_sums.h"
#include "rotatekv_scores.h"
#include "kivi_scores.h"
#else
namespace {

inline bool key_scores_apply(const Compressed&, const Shape&) { return false; }
inline bool key_scores_request(const Compressed&, int64_t) { return false; }
inline void scored_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, Scratch&) {}
inline void rkv_scored_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, Scratch&) {}
inline void kivi_scored_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, Scratch&) {}
inline bool kvquant_segments(const Compressed&, const Shape&) { return false; }
template <Elem TO>
void kvquant_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, float*, float*, Scratch&) {}

}  // namespace
#endif
