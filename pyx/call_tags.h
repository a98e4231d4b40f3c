/* The tags of a collective's messages on the algorithms' channel. Bits 0-3: the algorithm's own tag.
 * Bits 4-14: a code of what every rank must agree on (the collective, dtype, reduce op and root),
 * never 0. Bits 15-30: the call's number in the group, modulo 2**16. A transport with only 15 bits of
 * tag (MPI promises tags up to 32767; Open MPI has 31 bits) folds the number into a hash instead.
 *
 * So a message of another call is never taken for this one's. On a wide transport (TCP, shared
 * memory, Open MPI) a rank can also tell, from a message nobody has taken yet, that its sender is in
 * another collective: the same call number with another code, or an earlier call's message that was
 * never taken (a peer ahead sends a later number, which is not an error).
 *
 * The wide code is not a hash where it need not be: calls that differ in one thing only (the
 * collective, the dtype, the built-in reduce op, or the root of a group of under 2047 ranks) always
 * get different codes, as a hash into 2047 values would not (reduce_scatter's BOR of int16 and of
 * int64 got one, and passed as one call). A user op's mark (its fingerprint modulo 240) is hashed. */
#ifndef ENGINE_CALL_TAGS_H
#define ENGINE_CALL_TAGS_H

#include <stdint.h>

#define ENG_CALL_ALGO_BITS 4
#define ENG_CALL_CODES 2047          /* bits 4-14, 0 apart */
#define ENG_CALL_KINDS 10            /* a call word's collective: below this */
#define ENG_CALL_DTYPES 22           /* its dtype + 1 (0: none): below this */
#define ENG_CALL_MARKS 9             /* its built-in op marks 0-7 and 9 (no reduction) as 0-8 */
#define ENG_CALL_ROOT_STRIDE 661     /* prime, and 9 * 22 * 10 = 1980 codes below 2047: a root moves the
                                      * code by a multiple of this, never back onto itself below 2047 ranks */

static inline uint64_t eng_call_mix(uint64_t h) {
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;   /* splitmix64's finalizer */
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
  return h ^ (h >> 31);
}

/* call_hash: a call word (pyx/engine/_core.pxd call_word: collective, dtype + 1, op mark, 0, root + 1
 * in bits 32-63). */
static inline int eng_call_tag_base(uint64_t call_hash, uint64_t seq, int wide) {
  if (!wide) {
    uint64_t h = eng_call_mix(call_hash ^ seq * 0x9E3779B97F4A7C15ULL);
    return (int)(1 + h % ENG_CALL_CODES) << ENG_CALL_ALGO_BITS;
  }
  uint64_t kind = call_hash & 0xff, dtype = (call_hash >> 8) & 0xff, mark = (call_hash >> 16) & 0xff;
  uint64_t root = call_hash >> 32, code;
  if (kind < ENG_CALL_KINDS && dtype < ENG_CALL_DTYPES && (mark < 8 || mark == 9))
    code = (kind * ENG_CALL_DTYPES + dtype) * ENG_CALL_MARKS + (mark == 9 ? 8 : mark);
  else   /* a user op's mark */
    code = eng_call_mix(call_hash & 0xFFFFFFFFULL) % ENG_CALL_CODES;
  code = (code + (root % ENG_CALL_CODES) * ENG_CALL_ROOT_STRIDE) % ENG_CALL_CODES;
  return (int)((1 + code) << ENG_CALL_ALGO_BITS) | (int)((seq & 0xFFFF) << 15);
}

/* Whether a message with tag `tag`, which no receive took, shows its sender in another collective
 * than the running call (tag base `running`; 0 where no call runs: the signature exchange). */
static inline int eng_other_call(int running, int tag) {
  uint32_t mine = (uint32_t)running, theirs = (uint32_t)tag & ~((1u << ENG_CALL_ALGO_BITS) - 1);
  if (mine == 0 || theirs == 0 || tag < 0) return 0;
  uint32_t ahead = ((theirs >> 15) - (mine >> 15)) & 0xFFFF;
  if (ahead == 0) return theirs != mine;
  return ahead >= 0x8000;
}

#endif
